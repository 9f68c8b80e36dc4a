"""Paged attention as a Pallas kernel on the Triton backend (GPU; interpretable on CPU).

One kernel serves decode (one query per sequence), speculative verification and chunked prefill
(several queries per sequence, each at its own position). Grid ``(batch, kv_head, query block x
split)``: each program takes a tile of queries -- ``block_t`` consecutive tokens times the query group
of one kv head, padded to at least 16 rows for the tensor cores -- through a contiguous share of the
visible pages, one page per loop step, dequantizing it in registers; the splits are merged by
log-sum-exp outside. The pages are compacted first (``compact_pages``) and each query block
reads only the slots its queries can see (``slot_ranges``), so the loop has no branch and Triton can
pipeline its loads. Quantized pages are read as "pieces": contiguous dim ranges that unpack without lane
shuffles (see ``layouts``), each with its own small dot.

Coded keys (``key_calibration``) are never decoded: the query is folded into the coding once
(``hadamard(q / scale)``, outside the kernel), dotted with the stored codes like any page, and the
centre's share ``q . rope(center, pos)`` is added per page from two small dots against a per-program
table of the in-page offsets' cosines and sines (see :class:`KeyCalibration`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Bool, Float, Int

from zgen.errors import ConfigError
from zgen.pallas.common import (
    RUNNING_MAX_INIT,
    cdiv,
    finish_softmax,
    merge_partials,
    query_blocks,
    soft_cap as apply_soft_cap,
    softmax_rescale,
    ungroup_queries,
    visible,
)
from zgen.pallas.paged_attention.common import rope_cos_sin, slot_ranges, split_pages
from zgen.pallas.paged_attention.layouts import (
    Q3_LEVELS,
    Fp8Pages,
    KeyCalibration,
    KVPages,
    Q3Pages,
    Q4Pages,
    leading_shape,
)
from zgen.pallas.triton_utils import MIN_DOT, dot_nn, dot_nt, next_pow2, prev_pow2

@dataclasses.dataclass(frozen=True)
class PageReader:
    """How a kernel consumes one page of a layout, with the dequantization folded where it is cheapest.

    ``prepare(q_pieces)`` runs once per program (e.g. per-group query sums); ``logits(refs, page, q_pieces,
    prepared)`` returns the unscaled ``q . k`` of the page's tokens, ``[rows, page_size]`` f32;
    ``values(refs, page, p)`` returns ``p @ v`` for the probabilities ``p`` ``[rows, page_size]`` f32, one
    ``[rows, width]`` f32 tile per entry of ``pieces`` (``(start, width)`` dim ranges that unpack
    without lane shuffles, see ``layouts``).
    """

    pieces: tuple[tuple[int, int], ...]
    num_refs: int
    logits: Callable[[Sequence[jax.Ref], Array, Sequence[Array], Sequence[Array]], Array]
    values: Callable[[Sequence[jax.Ref], Array, Array], list[Array]]
    prepare: Callable[[Sequence[Array]], list[Array]] = lambda q_pieces: []


def _columns(ref: jax.Ref, p: Array, n: int) -> list[Array]:
    """The ``n`` per-token f32 columns ``[page_size]`` of a small metadata leaf of page ``p``.

    2-byte metadata (bf16 scales and mins) arrives bitcast to pairs in u32 (``widen_metadata``): a
    column of 2-byte values is a strided 2-byte load that Triton neither vectorizes nor pipelines, so
    every loop step waited for it (144 such loads per thread per page for Q4 on the H200 PTX). A u32
    column is a 4-byte load that goes through cp.async with the pages; a bf16 half becomes f32 with a
    shift (low half) or a mask (high half).
    """
    if ref.dtype == jnp.uint32:
        cols = []
        for j in range(cdiv(n, 2)):
            word = ref[p, :, j]
            cols.append(jax.lax.bitcast_convert_type(word << 16, jnp.float32))
            cols.append(jax.lax.bitcast_convert_type((word >> 16) << 16, jnp.float32))
        return cols[:n]
    return [ref[p, :, j].astype(jnp.float32) for j in range(n)]


def widen_metadata(leaf: Array) -> Array:
    """Bitcast a 2-byte metadata leaf ``[..., n]`` (n even) to u32 pairs ``[..., n/2]`` (free in XLA)."""
    if leaf.dtype.itemsize != 2 or leaf.shape[-1] % 2:
        return leaf
    return jax.lax.bitcast_convert_type(leaf.reshape(*leaf.shape[:-1], leaf.shape[-1] // 2, 2), jnp.uint32)


def _scaled(p: Array, col: Array, dtype: jnp.dtype) -> Array:
    return (p * col[None, :]).astype(dtype)


def _native_reader(head_dim: int, dtype: jnp.dtype) -> PageReader:
    pieces = ((0, head_dim),)

    def tile(refs: Sequence[jax.Ref], p: Array) -> Array:
        return refs[0][p].astype(dtype)

    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], _: Sequence[Array]) -> Array:
        return dot_nt(q[0], tile(refs, p))

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        return [dot_nn(probs.astype(dtype), tile(refs, p))]

    return PageReader(pieces, 1, logits, values)


def _fp8_reader(head_dim: int, dtype: jnp.dtype) -> PageReader:
    """E4M3 tiles go to the dot as they are (exact in bf16); the per-token scale multiplies the logits
    (K) or the probabilities (V), ``page_size`` values per row instead of ``page_size * D``."""

    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], _: Sequence[Array]) -> Array:
        vals, scale = refs
        return dot_nt(q[0], vals[p].astype(dtype)) * scale[p][None, :]

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        vals, scale = refs
        return [dot_nn(_scaled(probs, scale[p], dtype), vals[p].astype(dtype))]

    return PageReader(((0, head_dim),), 2, logits, values)


def _q4_reader(head_dim: int, group: int, dtype: jnp.dtype) -> PageReader:
    """Codes ``c`` in 0..15 are exact in bf16, so the dots run on the raw codes and the group's scale
    ``s`` and min ``z`` act on whole rows: per group ``g`` and token ``t``,

        q . k_t = sum_g s_tg (q_g . c_tg) + z_tg sum(q_g)        (K: sum(q_g) computed once)
        (p @ v)_g = (p * s_g) @ c_g + (p @ z_g)                    (V: a [rows] vector per group)

    so the per-element work is a shift or mask and an int->bf16 convert; no per-element FMA.
    """
    half = head_dim // 2
    n = half // group  # groups per half
    groups = 2 * n

    def codes(packed: jax.Ref, p: Array) -> list[Array]:
        """Code tiles in group order (low nibbles: dims [0, D/2), high nibbles: [D/2, D))."""
        lows, highs = [], []
        for j in range(n):
            byte = packed[p, :, pl.ds(j * group, group)].astype(jnp.int32)
            lows.append((byte & 0xF).astype(dtype))
            highs.append((byte >> 4).astype(dtype))
        return lows + highs

    def prepare(q: Sequence[Array]) -> list[Array]:
        return [jnp.sum(qg.astype(jnp.float32), axis=1) for qg in q]

    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], qsum: Sequence[Array]) -> Array:
        packed, scale, zero = refs
        s_cols, z_cols = _columns(scale, p, groups), _columns(zero, p, groups)
        out = None
        for qg, cg, sg, zg, qs in zip(q, codes(packed, p), s_cols, z_cols, qsum, strict=True):
            term = dot_nt(qg, cg) * sg[None, :] + qs[:, None] * zg[None, :]
            out = term if out is None else out + term
        assert out is not None
        return out

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        packed, scale, zero = refs
        s_cols, z_cols = _columns(scale, p, groups), _columns(zero, p, groups)
        return [
            dot_nn(_scaled(probs, sg, dtype), cg) + jnp.sum(probs * zg[None, :], axis=1)[:, None]
            for cg, sg, zg in zip(codes(packed, p), s_cols, z_cols, strict=True)
        ]

    pieces = tuple((h * half + j * group, group) for h in range(2) for j in range(n))
    return PageReader(pieces, 3, logits, values, prepare)


def _q3_reader(head_dim: int, group: int, dtype: jnp.dtype) -> PageReader:
    """Bit ``i`` of the plane bytes gives the dim block ``[i*D/8, (i+1)*D/8)``; each element picks its
    level with a 7-select tree on its 3 bits (the levels are constants). The group's scale acts on
    rows, as Q4's does: it multiplies the logits (K) or the probabilities (V)."""
    width = head_dim // 8
    groups = head_dim // group

    def levels(refs: Sequence[jax.Ref], p: Array) -> list[Array]:
        """Unscaled level tiles, one per dim block."""
        planes = refs[0]
        bits = [planes[p, :, b, :].astype(jnp.int32) for b in range(3)]
        out = []
        for i in range(8):
            b0, b1, b2 = ((plane & (1 << i)) != 0 for plane in bits)
            pair = [jnp.where(b0, Q3_LEVELS[2 * c + 1], Q3_LEVELS[2 * c]) for c in range(4)]
            quad = [jnp.where(b1, pair[2 * c + 1], pair[2 * c]) for c in range(2)]
            out.append(jnp.where(b2, quad[1], quad[0]))
        return out

    def block_scales(refs: Sequence[jax.Ref], p: Array) -> list[Array]:
        """The scale column ``[page_size]`` of each dim block's group."""
        cols = _columns(refs[1], p, groups)
        return [cols[i * width // group] for i in range(8)]

    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], _: Sequence[Array]) -> Array:
        terms = [
            dot_nt(qi, li.astype(dtype)) * si[None, :]
            for qi, li, si in zip(q, levels(refs, p), block_scales(refs, p), strict=True)
        ]
        return functools.reduce(jnp.add, terms)

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        return [
            dot_nn(_scaled(probs, si, dtype), li.astype(dtype))
            for li, si in zip(levels(refs, p), block_scales(refs, p), strict=True)
        ]

    return PageReader(tuple((i * width, width) for i in range(8)), 2, logits, values)


def page_reader(pages: KVPages, head_dim: int, dtype: jnp.dtype) -> PageReader:
    if isinstance(pages, Fp8Pages):
        return _fp8_reader(head_dim, dtype)
    if isinstance(pages, Q4Pages):
        return _q4_reader(head_dim, pages.group_size, dtype)
    if isinstance(pages, Q3Pages):
        return _q3_reader(head_dim, pages.group_size, dtype)
    return _native_reader(head_dim, dtype)


def kernel_leaves(pages: KVPages) -> list[Array]:
    """The leaves the kernel reads: the data leaf as stored, 2-byte metadata widened to u32 pairs."""
    first, *meta = jax.tree_util.tree_leaves(pages)
    return [first, *(widen_metadata(leaf) for leaf in meta)] if not isinstance(pages, jax.Array) else [first]


def _mean_logits(
    refs: Sequence[jax.Ref], page_size: int, dtype: jnp.dtype
) -> Callable[[Array], Array]:
    """``mean(start)``: ``q . rope(shift, pos)`` of a page whose first token sits at ``start``
    (``[rows, page_size]``). With ``a``, ``b`` from :meth:`KeyCalibration.mean_products`, the angle
    ``(start + i) f`` splits by angle addition: ``a'' = a cos(start f) + b sin(start f)``, ``b'' = b
    cos(start f) - a sin(start f)``, then ``a'' @ cos(i f) + b'' @ sin(i f)`` over the page's offsets
    ``i``, whose table is built once per program. The sink's gap is added at position 0."""
    a_ref, b_ref, gap_ref, freq_ref = refs
    a, b, gap, freq = a_ref[...], b_ref[...], gap_ref[...], freq_ref[...]
    cos_off, sin_off = rope_cos_sin(jnp.arange(page_size), freq)  # [page, half]

    def mean(start: Array) -> Array:
        cos_start, sin_start = rope_cos_sin(start, freq)
        a_page = a * cos_start[None, :] + b * sin_start[None, :]
        b_page = b * cos_start[None, :] - a * sin_start[None, :]
        out = dot_nt(a_page.astype(dtype), cos_off.astype(dtype)) + dot_nt(b_page.astype(dtype), sin_off.astype(dtype))
        first = (start + jnp.arange(page_size)) == 0
        return out + jnp.where(first[None, :], gap[:, None], 0.0)

    return mean


def _kernel(
    q_ref: jax.Ref,
    qpos_ref: jax.Ref,
    *refs: jax.Ref,
    k_reader: PageReader,
    v_reader: PageReader,
    coded: bool,
    page_size: int,
    pages_per_split: int,
    splits: int,
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> None:
    k_refs, refs = refs[: k_reader.num_refs], refs[k_reader.num_refs :]
    v_refs, refs = refs[: v_reader.num_refs], refs[v_reader.num_refs :]
    coding_refs, refs = (refs[:4], refs[4:]) if coded else ((), refs)
    tables_ref, logical_ref, lo_ref, hi_ref, o_ref, lse_ref = refs
    split_start = (pl.program_id(2) % splits) * pages_per_split
    start = jnp.maximum(lo_ref[0], split_start)
    end = jnp.minimum(hi_ref[0], split_start + pages_per_split)
    qpos = qpos_ref[...][:, None]
    rows = q_ref.shape[0]
    q_pieces = [q_ref[:, pl.ds(dim, width)] for dim, width in k_reader.pieces]
    prepared = k_reader.prepare(q_pieces)
    mean = _mean_logits(coding_refs, page_size, q_ref.dtype) if coded else None

    def step(slot: Array, carry: tuple[Array, Array, list[Array]]) -> tuple[Array, Array, list[Array]]:
        m, l, acc = carry
        page = tables_ref[slot]
        first = logical_ref[slot] * page_size
        pos = first + jnp.arange(page_size)
        s = k_reader.logits(k_refs, page, q_pieces, prepared)
        if mean is not None:
            s = s + mean(first)
        ok = visible(qpos, pos[None, :], qpos + 1, causal=True, window=window)
        s = jnp.where(ok, apply_soft_cap(s * scale, soft_cap), -jnp.inf)
        m, l, p, alpha = softmax_rescale(m, l, s)
        pv = v_reader.values(v_refs, page, p)
        return m, l, [a * alpha[:, None] + c for a, c in zip(acc, pv, strict=True)]

    init = (
        jnp.full((rows,), RUNNING_MAX_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        [jnp.zeros((rows, width), jnp.float32) for _, width in v_reader.pieces],
    )
    m, l, acc = jax.lax.fori_loop(start, jnp.maximum(start, end), step, init)
    for (dim, width), a in zip(v_reader.pieces, acc, strict=True):
        o_ref[:, pl.ds(dim, width)] = finish_softmax(a, m, l)[0]
    lse_ref[...] = finish_softmax(acc[0], m, l)[1]


def _leaf_spec(leaf: Array) -> pl.BlockSpec:
    """The whole of one kv head's pages; the kernel indexes pages itself."""
    trailing = leaf.ndim - 1
    return pl.BlockSpec((None, *leaf.shape[1:]), lambda b, h, i: (h,) + (0,) * trailing)


def supports(k_pages: KVPages) -> bool:
    """Pages the kernel can tile: the page is the key tile of its dots."""
    page_size = leading_shape(k_pages)[2]
    return page_size >= MIN_DOT and page_size & (page_size - 1) == 0


def _default_warps(k_pages: KVPages) -> int:
    """Q3's select trees run 3.6x faster with 2 warps than with 4 on an H200 (32k, coded keys): with
    N=16 value dots Triton puts every warp on the whole page. The other formats measured within run
    noise of each other with 2 and 4 (fp8 better with 4)."""
    return 2 if isinstance(k_pages, Q3Pages) else 4


def _launch(num_queries: int, group: int) -> tuple[int, int]:
    """``(block_t, rows)``: one token's query group for decode, else up to 64 rows of tokens x group."""
    block_t = 1 if num_queries == 1 else min(next_pow2(num_queries), max(1, prev_pow2(64 // group)))
    return block_t, max(MIN_DOT, next_pow2(block_t * group))


def paged_attention(
    q: Float[Array, "b t h d"],
    k_pages: KVPages,
    v_pages: KVPages,
    block_tables: Int[Array, "b pages_per_seq"],
    q_positions: Int[Array, "b t"],
    page_mask: Bool[Array, "b pages_per_seq"],
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    key_calibration: KeyCalibration | None = None,
    interpret: bool = False,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
) -> Float[Array, "b t h d"]:
    b, t, h, d = q.shape
    kvh, _, page_size = leading_shape(k_pages)
    if not supports(k_pages):
        raise ConfigError(
            f"the Triton paged kernel needs a power-of-two page_size >= {MIN_DOT}, got {page_size}; "
            "use implementation='xla' or None"
        )
    block_t, rows = _launch(t, h // kvh)
    q_tiles, q_pos = query_blocks(q, q_positions, kvh, block_t, rows)
    blocks = q_tiles.shape[2]
    per_split, tables, logical, count = split_pages(block_tables, page_mask, b * kvh * blocks, num_splits)
    splits = cdiv(block_tables.shape[1], per_split)
    lo, hi = slot_ranges(logical, count, q_pos, page_size, sliding_window)

    per_query_tile = lambda width: pl.BlockSpec(  # noqa: E731
        (None, None, None, rows, width), lambda b, h, i: (b, h, i // splits, 0, 0)
    )
    coding_inputs: list[Array] = []
    coding_specs: list[pl.BlockSpec] = []
    if key_calibration is not None:
        # The query folded into the coding, and what the centre's share of each logit needs.
        mean_a, mean_b, sink_gap = key_calibration.mean_products(q_tiles, head_axis=1)
        q_tiles = key_calibration.fold_into_queries(q_tiles, head_axis=1).astype(q.dtype)
        coding_inputs = [mean_a, mean_b, sink_gap, key_calibration.inv_freq.astype(jnp.float32)]
        coding_specs = [
            per_query_tile(d // 2),
            per_query_tile(d // 2),
            pl.BlockSpec((None, None, None, rows), lambda b, h, i: (b, h, i // splits, 0)),
            pl.BlockSpec((d // 2,), lambda b, h, i: (0,)),
        ]
    k_leaves = kernel_leaves(k_pages)
    v_leaves = kernel_leaves(v_pages)
    kernel = functools.partial(
        _kernel,
        k_reader=page_reader(k_pages, d, q.dtype),
        v_reader=page_reader(v_pages, d, q.dtype),
        coded=key_calibration is not None,
        page_size=page_size,
        pages_per_split=per_split,
        splits=splits,
        scale=scale,
        soft_cap=soft_cap,
        window=sliding_window,
    )
    per_block = pl.BlockSpec((None, None, 1), lambda b, h, i: (b, i // splits, 0))
    per_seq = pl.BlockSpec((None, tables.shape[1]), lambda b, h, i: (b, 0))
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, blocks * splits),
        in_specs=[
            per_query_tile(d),
            pl.BlockSpec((None, None, rows), lambda b, h, i: (b, i // splits, 0)),
            *map(_leaf_spec, k_leaves),
            *map(_leaf_spec, v_leaves),
            *coding_specs,
            per_seq,
            per_seq,
            per_block,
            per_block,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, None, rows, d), lambda b, h, i: (b, h, i // splits, i % splits, 0, 0)),
            pl.BlockSpec((None, None, None, None, rows), lambda b, h, i: (b, h, i // splits, i % splits, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, blocks, splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, blocks, splits, rows), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or _default_warps(k_pages), num_stages=num_stages),
        interpret=interpret,
        name="zgen_paged_attention",
    )(q_tiles, q_pos, *k_leaves, *v_leaves, *coding_inputs, tables, logical, lo[..., None], hi[..., None])
    return ungroup_queries(merge_partials(out, lse), t, h, block_t).astype(q.dtype)
