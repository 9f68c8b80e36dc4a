"""Paged decode attention as a Pallas kernel on the Triton backend (GPU; interpretable on CPU).

Grid ``(batch, kv_head, split)``: each program takes the whole query group of one kv head (padded to
16 rows for the tensor cores) through a contiguous share of the sequence's visible pages, one page
per loop step, dequantizing the page in registers; the splits are merged by log-sum-exp outside.
The pages are compacted first (``compact_pages``) so the loop has no branch and Triton can pipeline
its loads. Quantized pages are read as "pieces": contiguous dim ranges that unpack without lane
shuffles (see ``layouts``), each with its own small dot.
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

from zgen.pallas.common import RUNNING_MAX_INIT, finish_softmax, merge_partials, soft_cap as apply_soft_cap, softmax_rescale, visible
from zgen.pallas.paged_attention.common import group_queries, split_pages
from zgen.pallas.paged_attention.layouts import Fp8Pages, KVPages, Q3Pages, Q4Pages, leading_shape
from zgen.pallas.triton_utils import MIN_DOT, dot_nn, dot_nt, next_pow2

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

    2-byte metadata (bf16 scales, codebooks) arrives bitcast to pairs in u32 (``widen_metadata``): a
    column of 2-byte values is a strided 2-byte load that Triton neither vectorizes nor pipelines, so
    every loop step waited for it (144 such loads per thread per page for Q4 on the H200 PTX). A u32
    column is a 4-byte load that goes through cp.async with the pages; a bf16 half becomes f32 with a
    shift (low half) or a mask (high half).
    """
    if ref.dtype == jnp.uint32:
        cols = []
        for j in range(-(-n // 2)):
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
    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], _: Sequence[Array]) -> Array:
        return dot_nt(q[0], refs[0][p].astype(dtype))

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        return [dot_nn(probs.astype(dtype), refs[0][p].astype(dtype))]

    return PageReader(((0, head_dim),), 1, logits, values)


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


def _q3_reader(head_dim: int, dtype: jnp.dtype) -> PageReader:
    """Bit ``i`` of the plane bytes gives the dim block ``[i*D/8, (i+1)*D/8)``; each element picks its
    codebook entry with a 7-select tree on its 3 bits, the 8 entries being per-token columns (from 4
    u32 words, so their loads pipeline with the pages)."""
    width = head_dim // 8

    def tiles(refs: Sequence[jax.Ref], p: Array) -> list[Array]:
        planes, codebook = refs
        bits = [planes[p, :, b, :].astype(jnp.int32) for b in range(3)]
        cb = [c[:, None] for c in _columns(codebook, p, 8)]
        out = []
        for i in range(8):
            b0, b1, b2 = ((plane & (1 << i)) != 0 for plane in bits)
            pair = [jnp.where(b0, cb[2 * c + 1], cb[2 * c]) for c in range(4)]
            quad = [jnp.where(b1, pair[2 * c + 1], pair[2 * c]) for c in range(2)]
            out.append(jnp.where(b2, quad[1], quad[0]).astype(dtype))
        return out

    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], _: Sequence[Array]) -> Array:
        return functools.reduce(jnp.add, [dot_nt(qi, ki) for qi, ki in zip(q, tiles(refs, p), strict=True)])

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        pd = probs.astype(dtype)
        return [dot_nn(pd, vi) for vi in tiles(refs, p)]

    return PageReader(tuple((i * width, width) for i in range(8)), 2, logits, values)


def page_reader(pages: KVPages, head_dim: int, dtype: jnp.dtype) -> PageReader:
    if isinstance(pages, Fp8Pages):
        return _fp8_reader(head_dim, dtype)
    if isinstance(pages, Q4Pages):
        return _q4_reader(head_dim, pages.group_size, dtype)
    if isinstance(pages, Q3Pages):
        return _q3_reader(head_dim, dtype)
    return _native_reader(head_dim, dtype)


def kernel_leaves(pages: KVPages) -> list[Array]:
    """The leaves the kernel reads: the data leaf as stored, 2-byte metadata widened to u32 pairs."""
    first, *meta = jax.tree_util.tree_leaves(pages)
    return [first, *(widen_metadata(leaf) for leaf in meta)] if not isinstance(pages, jax.Array) else [first]


def _kernel(
    q_ref: jax.Ref,
    *refs: jax.Ref,
    k_reader: PageReader,
    v_reader: PageReader,
    page_size: int,
    pages_per_split: int,
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> None:
    k_refs, refs = refs[: k_reader.num_refs], refs[k_reader.num_refs :]
    v_refs, refs = refs[: v_reader.num_refs], refs[v_reader.num_refs :]
    tables_ref, logical_ref, count_ref, length_ref, o_ref, lse_ref = refs
    length = length_ref[0]
    first = pl.program_id(2) * pages_per_split
    steps = jnp.clip(count_ref[0] - first, 0, pages_per_split)
    q_pieces = [q_ref[:, pl.ds(start, width)] for start, width in k_reader.pieces]
    prepared = k_reader.prepare(q_pieces)
    rows = q_ref.shape[0]

    def step(i: Array, carry: tuple[Array, Array, list[Array]]) -> tuple[Array, Array, list[Array]]:
        m, l, acc = carry
        page = tables_ref[first + i]
        s = k_reader.logits(k_refs, page, q_pieces, prepared)
        pos = logical_ref[first + i] * page_size + jnp.arange(page_size)
        ok = visible(length - 1, pos, length, causal=True, window=window)
        s = jnp.where(ok[None, :], apply_soft_cap(s * scale, soft_cap), -jnp.inf)
        m, l, p, alpha = softmax_rescale(m, l, s)
        pv = v_reader.values(v_refs, page, p)
        acc = [a * alpha[:, None] + c for a, c in zip(acc, pv, strict=True)]
        return m, l, acc

    init = (
        jnp.full((rows,), RUNNING_MAX_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        [jnp.zeros((rows, width), jnp.float32) for _, width in v_reader.pieces],
    )
    m, l, acc = jax.lax.fori_loop(0, steps, step, init)
    for (start, width), a in zip(v_reader.pieces, acc, strict=True):
        o_ref[:, pl.ds(start, width)] = finish_softmax(a, m, l)[0]
    lse_ref[...] = finish_softmax(acc[0], m, l)[1]


def _leaf_spec(leaf: Array) -> pl.BlockSpec:
    """The whole of one kv head's pages; the kernel indexes pages itself."""
    trailing = leaf.ndim - 1
    return pl.BlockSpec((None, *leaf.shape[1:]), lambda b, h, s: (h,) + (0,) * trailing)


def paged_decode_attention(
    q: Float[Array, "b h d"],
    k_pages: KVPages,
    v_pages: KVPages,
    block_tables: Int[Array, "b pages_per_seq"],
    lengths: Int[Array, " b"],
    page_mask: Bool[Array, "b pages_per_seq"],
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    interpret: bool = False,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Float[Array, "b h d"]:
    b, h, d = q.shape
    kvh, _, page_size = leading_shape(k_pages)
    if page_size < MIN_DOT or page_size & (page_size - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two page_size >= {MIN_DOT}, got {page_size}")
    g = h // kvh
    rows = max(MIN_DOT, next_pow2(g))
    qg = group_queries(q, kvh, rows)
    per_split, tables, logical, count = split_pages(block_tables, page_mask, kvh, num_splits)
    splits = tables.shape[1] // per_split

    k_leaves = kernel_leaves(k_pages)
    v_leaves = kernel_leaves(v_pages)
    kernel = functools.partial(
        _kernel,
        k_reader=page_reader(k_pages, d, q.dtype),
        v_reader=page_reader(v_pages, d, q.dtype),
        page_size=page_size,
        pages_per_split=per_split,
        scale=scale,
        soft_cap=soft_cap,
        window=sliding_window,
    )
    per_row = pl.BlockSpec((None, 1), lambda b, h, s: (b, 0))
    per_seq = pl.BlockSpec((None, splits * per_split), lambda b, h, s: (b, 0))
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda b, h, s: (b, h, 0, 0)),
            *map(_leaf_spec, k_leaves),
            *map(_leaf_spec, v_leaves),
            per_seq,
            per_seq,
            per_row,
            per_row,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="zgen_paged_decode",
    )(qg, *k_leaves, *v_leaves, tables, logical, count[:, None], lengths[:, None])
    return merge_partials(out, lse)[:, :, :g].reshape(b, h, d).astype(q.dtype)
