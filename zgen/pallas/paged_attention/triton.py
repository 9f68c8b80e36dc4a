"""Paged attention as a Pallas kernel on the Triton backend (GPU; interpretable on CPU).

One kernel serves decode (one query per sequence), speculative verification and chunked prefill
(several queries per sequence, each at its own position). Grid ``(batch, kv_head, query block x
split)``: each program takes a tile of queries -- ``block_t`` consecutive tokens times the query group
of one kv head, padded to at least 16 rows for the tensor cores -- through a contiguous share of the
visible pages, one page per loop step, dequantizing it in registers; the splits are merged by
log-sum-exp outside. The pages are compacted first (``compact_pages``) and each query block
reads only the slots its queries can see (``slot_ranges``), so the loop has no branch and Triton can
pipeline its loads. Quantized pages are read as "pieces": contiguous dim ranges that unpack without lane
shuffles (see ``layouts``), each with its own small dot. A decode step (one query a row, keys not coded)
needs no padded tiles: each program loads its query group from the row's heads, masked to the tile,
and with one split writes the finished rows itself.

Coded keys (``key_calibration``) are never decoded: the query is folded into the coding once
(``hadamard(q / scale)``, outside the kernel), dotted with the stored codes like any page, and the
centre's share ``q . rope(center, pos)`` is added per page from two small dots against a table of
the in-page offsets' cosines and sines (see :class:`KeyCalibration`, ``_coding_inputs``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence, TypeAlias

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Bool, Float, Int

from zgen.errors import ConfigError
from zgen.pallas.common import (
    RUNNING_MAX_INIT,
    base2_logits,
    finish_softmax,
    merge_partials,
    query_blocks,
    softmax_rescale,
    ungroup_queries,
    visible,
)
from zgen.pallas.paged_attention.common import slot_ranges, split_count, split_pages
from zgen.pallas.paged_attention.layouts import (
    FP8_MAX,
    Q3_LEVELS,
    Fp8Pages,
    KeyCalibration,
    KVPages,
    Q3Pages,
    Q4Pages,
    leading_shape,
)
from zgen.pallas.triton_utils import (
    MIN_DOT,
    dot_nn,
    dot_nt,
    load_rotated,
    nibble_tiles,
    own_key_carry,
    prev_pow2,
    rope_table,
    widen_metadata,
)
from zgen.rope import rope_cos_sin
from zgen.shapes import cdiv, next_pow2


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


# Queries go to the fp8 dots in float16, scaled by a power of two so their largest entry stays below this.
_F16_QUERY_MAX = 2.0**14


def _fp8_reader(head_dim: int, dtype: jnp.dtype) -> PageReader:
    """For bf16 queries, E4M3 tiles become float16 with one hardware convert per two values (exact) and
    the dots run in float16: a bf16 target would need a second convert per value. The query is scaled
    into float16's range by a power of two ``f`` (once per program). The per-token scale multiplies the
    logits (K) or the probabilities (V), ``page_size`` values per row instead of ``page_size * D``; on V
    it is taken relative to the page's largest so the float16 probabilities keep their precision.
    Other query dtypes (f32, f16) hold E4M3 exactly and dot in their own dtype the same way."""
    dot_dtype = jnp.float16 if dtype == jnp.bfloat16 else dtype

    def prepare(q: Sequence[Array]) -> list[Array]:
        q32 = q[0].astype(jnp.float32)
        factor = jnp.exp2(jnp.maximum(jnp.ceil(jnp.log2(jnp.max(jnp.abs(q32)) / _F16_QUERY_MAX)), 0.0))
        return [(q32 / factor).astype(dot_dtype), factor]

    def tile(vals: jax.Ref, p: Array) -> Array:
        page = vals[p]  # E4M3, or its bytes where the kernel also stores into the pool (appending)
        page = jax.lax.bitcast_convert_type(page, jnp.float8_e4m3fn) if page.dtype == jnp.uint8 else page
        return page.astype(dot_dtype)

    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], prepared: Sequence[Array]) -> Array:
        vals, scale = refs
        q_dot, factor = prepared
        return dot_nt(q_dot, tile(vals, p)) * (scale[p] * factor)[None, :]

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        vals, scale = refs
        tokens = scale[p]
        top = jnp.max(tokens)
        w = (probs * (tokens / top)[None, :]).astype(dot_dtype)
        return [dot_nn(w, tile(vals, p)) * top]

    return PageReader(((0, head_dim),), 2, logits, values, prepare)


def _q4_reader(head_dim: int, group: int, dtype: jnp.dtype) -> PageReader:
    """The dots run on ``L = 128 + c`` for the codes ``c``, exact in bf16 and made by bit operations on
    the byte (``nibble_tiles``); a group's scale ``s`` and min ``z`` (``k = s c + z = s L + z'``, ``z' = z - 128 s``) act
    on whole rows:

        q . k_t = sum_g s_tg (q_g . L_tg) + z'_tg sum(q_g)       (K: sum(q_g) computed once)
        (p @ v)_g = w_g @ L_g + sum_t (p_t z_tg - 128 w_tg)      (V: w = bf16(p * s_g))

    The V correction subtracts the offset through the rounded ``w`` the dot saw, so it cancels exactly. Per element
    that leaves a mask or shift and an or on the byte; no per-element convert or FMA.
    """
    half = head_dim // 2
    n = half // group  # groups per half
    groups = 2 * n

    def codes(packed: jax.Ref, p: Array) -> list[Array]:
        """Nibble tiles in group order (low nibbles: dims [0, D/2), high nibbles: [D/2, D))."""
        lows, highs = [], []
        for j in range(n):
            low, high = nibble_tiles(packed[p, :, pl.ds(j * group, group)], dtype)
            lows.append(low)
            highs.append(high)
        return lows + highs

    def prepare(q: Sequence[Array]) -> list[Array]:
        return [jnp.sum(qg.astype(jnp.float32), axis=1) for qg in q]

    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], qsum: Sequence[Array]) -> Array:
        packed, scale, zero = refs
        terms = [
            dot_nt(qg, lg) * sg[None, :] + qs[:, None] * (zg - 128 * sg)[None, :]
            for qg, lg, sg, zg, qs in zip(q, codes(packed, p), _columns(scale, p, groups), _columns(zero, p, groups), qsum, strict=True)
        ]
        return functools.reduce(jnp.add, terms)

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        packed, scale, zero = refs
        out = []
        for lg, sg, zg in zip(codes(packed, p), _columns(scale, p, groups), _columns(zero, p, groups), strict=True):
            w = (probs * sg[None, :]).astype(dtype)
            correction = jnp.sum(probs * zg[None, :] - 128 * w.astype(jnp.float32), axis=1)
            out.append(dot_nn(w, lg) + correction[:, None])
        return out

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


def _mean_logits(refs: Sequence[jax.Ref], page_size: int, dtype: jnp.dtype) -> Callable[[Array, Array], Array]:
    """``mean(logical_page, start)``: ``q . rope(shift, pos)`` of a page whose first token sits at
    ``start`` (``[rows, page_size]``). With ``a``, ``b`` from :meth:`KeyCalibration.mean_products`, the
    angle ``(start + i) f`` splits by angle addition: ``a'' = a cos(start f) + b sin(start f)``, ``b'' =
    b cos(start f) - a sin(start f)``, then ``a'' @ cos(i f) + b'' @ sin(i f)`` over the page's offsets
    ``i``. The angles' cosines and sines come as tables or are computed here from the frequencies (see
    ``_coding_inputs``). The sink's gap is added at position 0."""
    a, b, gap = (ref[...] for ref in refs[:3])
    if len(refs) == 4:  # frequencies: the offsets' table once per program, the page start's per page
        freq = refs[3][...]
        cos_off, sin_off = (x.astype(dtype) for x in rope_cos_sin(jnp.arange(page_size), freq))  # [page, half]

        def start_angles(logical: Array, start: Array) -> tuple[Array, Array]:
            del logical
            return rope_cos_sin(start, freq)

    else:  # tables at every page start and in-page offset
        cos_start_ref, sin_start_ref, cos_off_ref, sin_off_ref = refs[3:]
        cos_off, sin_off = cos_off_ref[...], sin_off_ref[...]

        def start_angles(logical: Array, start: Array) -> tuple[Array, Array]:
            del start
            return cos_start_ref[logical], sin_start_ref[logical]

    def mean(logical: Array, start: Array) -> Array:
        cos_start, sin_start = (x[None, :] for x in start_angles(logical, start))
        a_page = a * cos_start + b * sin_start
        b_page = b * cos_start - a * sin_start
        out = dot_nt(a_page.astype(dtype), cos_off) + dot_nt(b_page.astype(dtype), sin_off)
        first = (start + jnp.arange(page_size)) == 0
        return out + jnp.where(first[None, :], gap[:, None], 0.0)

    return mean


def _kernel(
    q_ref: jax.Ref,
    qpos_ref: jax.Ref,
    *refs: jax.Ref,
    k_reader: PageReader,
    v_reader: PageReader,
    coding_inputs: int,
    page_size: int,
    pages_per_split: int,
    splits: int,
    rows: int,
    group: int | None,
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> None:
    """``group`` set: one decode token a row, whose kv head's query group is read straight from the
    row's heads ``q_ref`` ``[h, d]`` (masked to ``rows``) at position ``qpos_ref`` ``[1]``; with one split the
    finished output goes straight into the group's rows of ``o_ref`` ``[group, d]``. Otherwise ``q_ref``
    is a padded tile of queries at positions ``qpos_ref`` ``[rows]``, and the outputs are a split's
    partial output and log-sum-exp."""
    k_refs, refs = refs[: k_reader.num_refs], refs[k_reader.num_refs :]
    v_refs, refs = refs[: v_reader.num_refs], refs[v_reader.num_refs :]
    coding_refs, refs = refs[:coding_inputs], refs[coding_inputs:]
    tables_ref, logical_ref, lo_ref, hi_ref, o_ref, *lse_ref = refs
    split_start = (pl.program_id(2) % splits) * pages_per_split
    start = jnp.maximum(lo_ref[0], split_start)
    end = jnp.minimum(hi_ref[0], split_start + pages_per_split)
    row = jnp.arange(rows)
    in_group = row < (rows if group is None else group)
    lanes = lambda dim, width: dim + jnp.arange(width)[None, :]  # noqa: E731
    if group is None:
        qpos = qpos_ref[...][:, None]
        q_pieces = [q_ref[:, pl.ds(dim, width)] for dim, width in k_reader.pieces]
    else:  # no padded copy of the queries: padding rows load as zeros and sit at position -1
        qpos = jnp.where(in_group, qpos_ref[0], -1)[:, None]
        heads = (pl.program_id(1) * group + row)[:, None]
        q_pieces = [
            pltriton.load(q_ref.at[heads, lanes(dim, width)], mask=in_group[:, None], other=0.0)
            for dim, width in k_reader.pieces
        ]
    prepared = k_reader.prepare(q_pieces)
    mean = _mean_logits(coding_refs, page_size, q_pieces[0].dtype) if coding_refs else None
    init = (
        jnp.full((rows,), RUNNING_MAX_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        [jnp.zeros((rows, width), jnp.float32) for _, width in v_reader.pieces],
    )
    m, l, acc = _attend_pages(
        k_refs, v_refs, tables_ref, logical_ref, q_pieces, prepared, qpos, qpos + 1, init, start, end,
        k_reader=k_reader, v_reader=v_reader, mean=mean, page_size=page_size, scale=scale, soft_cap=soft_cap, window=window,
    )
    _store_output(o_ref, lse_ref, v_reader.pieces, m, l, acc, row, in_group)


def _attend_pages(
    k_refs: Sequence[jax.Ref],
    v_refs: Sequence[jax.Ref],
    tables_ref: jax.Ref,
    logical_ref: jax.Ref | None,
    q_pieces: Sequence[Array],
    prepared: Sequence[Array],
    qpos: Array,
    length: Array,
    carry: tuple[Array, Array, list[Array]],
    start: Array,
    end: Array,
    *,
    k_reader: PageReader,
    v_reader: PageReader,
    mean: Callable[[Array, Array], Array] | None,
    page_size: int,
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> tuple[Array, Array, list[Array]]:
    """The online softmax of a query tile (positions ``qpos`` ``[rows, 1]``) over the page slots
    ``[start, end)`` of ``tables_ref``, one page a step: keys below ``length`` that the queries see.
    ``logical_ref`` gives each slot's place in the sequence (compacted tables); None: the slot's own."""

    def step(slot: Array, carry: tuple[Array, Array, list[Array]]) -> tuple[Array, Array, list[Array]]:
        m, l, acc = carry
        page = tables_ref[slot]
        logical = slot if logical_ref is None else logical_ref[slot]
        first = logical * page_size
        pos = first + jnp.arange(page_size)
        s = k_reader.logits(k_refs, page, q_pieces, prepared)
        if mean is not None:
            s = s + mean(logical, first)
        ok = visible(qpos, pos[None, :], length, causal=True, window=window)
        s = jnp.where(ok, base2_logits(s, scale, soft_cap), -jnp.inf)
        m, l, p, alpha = softmax_rescale(m, l, s, base2=True)
        pv = v_reader.values(v_refs, page, p)
        return m, l, [a * alpha[:, None] + c for a, c in zip(acc, pv, strict=True)]

    return jax.lax.fori_loop(start, jnp.maximum(start, end), step, carry)


def _store_output(
    o_ref: jax.Ref, lse_ref: Sequence[jax.Ref], pieces: Sequence[tuple[int, int]], m: Array, l: Array, acc: Sequence[Array],
    row: Array, in_group: Array,
) -> None:
    """A split's partial output and log-sum-exp (``lse_ref`` given), or the finished rows of the group
    (``in_group``) straight into ``o_ref``."""
    for (dim, width), a in zip(pieces, acc, strict=True):
        out = finish_softmax(a, m, l, base2=True)[0]
        if lse_ref:
            o_ref[:, pl.ds(dim, width)] = out
        else:
            lanes = dim + jnp.arange(width)[None, :]
            pltriton.store(o_ref.at[row[:, None], lanes], out.astype(o_ref.dtype), mask=in_group[:, None])
    if lse_ref:
        lse_ref[0][...] = finish_softmax(acc[0], m, l, base2=True)[1]


def _leaf_spec(leaf: Array) -> pl.BlockSpec:
    """The whole of one kv head's pages; the kernel indexes pages itself."""
    trailing = leaf.ndim - 1
    return pl.BlockSpec((None, *leaf.shape[1:]), lambda b, h, i: (h,) + (0,) * trailing)


def supports(k_pages: KVPages) -> bool:
    """Pages the kernel can tile: the page is the key tile of its dots."""
    page_size = leading_shape(k_pages)[2]
    return page_size >= MIN_DOT and page_size & (page_size - 1) == 0


# A quantized page's loop is bound by latency, not bytes: its programs go faster in more, shorter
# splits. Rows of length 0 still count as programs when the split is chosen, so a batch padded to a
# power of two got splits twice as long (H200, coded q4, 33 rows of 32k padded to 64: 2.44 ms with
# 256-page splits, 1.84 with 128; bf16 pages are faster with the longer splits: 1.10 vs 1.24 ms).
QUANTIZED_SPLIT_PAGES = 128


def _default_warps(k_pages: KVPages) -> int:
    """Quantized pages run best with 2 warps, bf16 with 4 (H200, 32k, fifth kernel run: fp8 0.225 vs
    0.275 ms, q4 0.373 vs 0.397, coded q4 0.496 vs 0.515, coded q3 3.08 vs 3.24; bf16 0.283 vs 0.315):
    with N=16 value dots Triton puts every warp on the whole page, so fewer warps dequantize it fewer
    times."""
    return 4 if isinstance(k_pages, jax.Array) else 2


def _launch(num_queries: int, group: int) -> tuple[int, int]:
    """``(block_t, rows)``: one token's query group for decode, else up to 64 rows of tokens x group."""
    block_t = 1 if num_queries == 1 else min(next_pow2(num_queries), max(1, prev_pow2(64 // group)))
    return block_t, max(MIN_DOT, next_pow2(block_t * group))


def _coding_inputs(
    q_tiles: Float[Array, "b kvh blocks rows d"], calibration: KeyCalibration, k_pages: KVPages, pages_per_seq: int
) -> tuple[Float[Array, "b kvh blocks rows d"], list[Array]]:
    """The query folded into the coding, and what the centre's share of each logit needs: the
    query-mean products ``a``, ``b`` and the sink's gap per query row, then the angles. Tables of the
    cosines and sines at every page start ``[pages_per_seq, D/2]`` (f32) and in-page offset ``[page,
    D/2]`` (dot dtype) keep sines out of the loop: coded q4 0.64 -> 0.48 ms at 32k on an H200 (fifth
    kernel run). Q3, already at 255 registers with spills, ran 1.9x slower with them (1.69 -> 3.19 ms),
    so its kernel gets the frequencies and computes the angles itself, as before."""
    mean_a, mean_b, sink_gap = calibration.mean_products(q_tiles, head_axis=1)
    folded = calibration.fold_into_queries(q_tiles, head_axis=1).astype(q_tiles.dtype)
    if isinstance(k_pages, Q3Pages):
        return folded, [mean_a, mean_b, sink_gap, calibration.inv_freq.astype(jnp.float32)]
    page_size = leading_shape(k_pages)[2]
    cos_start, sin_start = rope_cos_sin(jnp.arange(pages_per_seq) * page_size, calibration.inv_freq)
    cos_off, sin_off = rope_cos_sin(jnp.arange(page_size), calibration.inv_freq)
    dtype = q_tiles.dtype
    return folded, [mean_a, mean_b, sink_gap, cos_start, sin_start, cos_off.astype(dtype), sin_off.astype(dtype)]


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
    g = h // kvh
    block_t, rows = _launch(t, g)
    # A decode step reads each kv head's query group from the row's heads in the kernel (coded keys
    # fold the queries into tiles outside anyway): the padded tiles cost a copy a layer (~7 µs at
    # 128 rows of Llama-3-8B's heads on an H200) and, with one split, the merge and the ungrouping two more.
    direct = t == 1 and key_calibration is None
    if direct:
        q_tiles, q_pos, blocks = q[:, 0], q_positions.astype(jnp.int32), 1
    else:
        q_tiles, q_pos = query_blocks(q, q_positions, kvh, block_t, rows)
        blocks = q_tiles.shape[2]
    longest = None if isinstance(k_pages, jax.Array) else QUANTIZED_SPLIT_PAGES
    per_split, tables, logical, count = split_pages(block_tables, page_mask, b * kvh * blocks, num_splits, longest)
    splits = cdiv(block_tables.shape[1], per_split)
    lo, hi = slot_ranges(logical, count, q_pos[:, None] if direct else q_pos, page_size, sliding_window)

    per_query_tile = lambda width: pl.BlockSpec(  # noqa: E731
        (None, None, None, rows, width), lambda b, h, i: (b, h, i // splits, 0, 0)
    )
    if direct:
        q_specs = [pl.BlockSpec((None, h, d), lambda b, h, i: (b, 0, 0)), pl.BlockSpec((None, 1), lambda b, h, i: (b, 0))]
    else:
        q_specs = [per_query_tile(d), pl.BlockSpec((None, None, rows), lambda b, h, i: (b, i // splits, 0))]
    coding_inputs: list[Array] = []
    coding_specs: list[pl.BlockSpec] = []
    if key_calibration is not None:
        q_tiles, coding_inputs = _coding_inputs(q_tiles, key_calibration, k_pages, block_tables.shape[1])
        whole = lambda x: pl.BlockSpec(x.shape, lambda b, h, i: (0,) * x.ndim)  # noqa: E731
        coding_specs = [
            per_query_tile(d // 2),
            per_query_tile(d // 2),
            pl.BlockSpec((None, None, None, rows), lambda b, h, i: (b, h, i // splits, 0)),
            *map(whole, coding_inputs[3:]),
        ]
    k_leaves = kernel_leaves(k_pages)
    v_leaves = kernel_leaves(v_pages)
    kernel = functools.partial(
        _kernel,
        k_reader=page_reader(k_pages, d, q.dtype),
        v_reader=page_reader(v_pages, d, q.dtype),
        coding_inputs=len(coding_inputs),
        page_size=page_size,
        pages_per_split=per_split,
        splits=splits,
        rows=rows,
        group=g if direct else None,
        scale=scale,
        soft_cap=soft_cap,
        window=sliding_window,
    )
    per_block = pl.BlockSpec((None, None, 1), lambda b, h, i: (b, i // splits, 0))
    per_seq = pl.BlockSpec((None, tables.shape[1]), lambda b, h, i: (b, 0))
    finished = direct and splits == 1
    if finished:
        out_specs = [pl.BlockSpec((None, None, g, d), lambda b, h, i: (b, h, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, kvh, g, d), q.dtype)]
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, None, rows, d), lambda b, h, i: (b, h, i // splits, i % splits, 0, 0)),
            pl.BlockSpec((None, None, None, None, rows), lambda b, h, i: (b, h, i // splits, i % splits, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((b, kvh, blocks, splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, blocks, splits, rows), jnp.float32),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(b, kvh, blocks * splits),
        in_specs=[
            *q_specs,
            *map(_leaf_spec, k_leaves),
            *map(_leaf_spec, v_leaves),
            *coding_specs,
            per_seq,
            per_seq,
            per_block,
            per_block,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or _default_warps(k_pages), num_stages=num_stages),
        interpret=interpret,
        name="zgen_paged_attention",
    )(q_tiles, q_pos, *k_leaves, *v_leaves, *coding_inputs, tables, logical, lo[..., None], hi[..., None])
    if finished:
        return outs[0].reshape(b, 1, h, d)
    return ungroup_queries(merge_partials(*outs), t, h, block_t).astype(q.dtype)


# The appending decode kernel aims at half the programs of TARGET_PROGRAMS: on an H200 (Llama-3-8B
# heads, batch 8, bf16 pages of 64, 64 steps in one loop, merge included) 8 splits against 16 took
# 82 against 91 us a layer at 8,000 tokens and 23 against 25 at 1,000; 4 and 2 splits were slower.
APPEND_TARGET_PROGRAMS = 512


def _append_kernel(
    heads_ref: jax.Ref,
    rope_ref: jax.Ref,
    pos_ref: jax.Ref,
    page_ref: jax.Ref,
    *refs: jax.Ref,
    reader: PageReader,
    kv_heads: int,
    group: int,
    rows: int,
    page_size: int,
    pages_per_split: int,
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> None:
    """One decode token a row over plain or fp8 pages: rotate its query group and key (``heads_ref``:
    the row's query heads, new keys, new values, before RoPE; ``rope_ref``: its ``rope_table`` row),
    attend over the stored keys before ``pos`` plus its own key from registers (as the pool will hold
    it: fp8 tokens quantized first), and store its key and value in page ``page_ref`` at offset ``pos %
    page_size`` after split 0's loop (another split may read that slot meanwhile, old or new, and masks
    it either way)."""
    n = reader.num_refs
    k_refs, v_refs, (tables_ref, lo_ref, hi_ref) = refs[:n], refs[n : 2 * n], refs[2 * n : 2 * n + 3]
    outs = refs[2 * n + 3 :]
    o_ref, lse_ref, k_out_refs, v_out_refs = outs[0], outs[1:-2 * n], outs[-2 * n : -n], outs[-n:]
    kv_head, split = pl.program_id(1), pl.program_id(2)
    pos, page = pos_ref[0], page_ref[0]
    row = jnp.arange(rows)
    in_group = row < group
    q = load_rotated(heads_ref, kv_head * group + row, rope_ref, in_group[:, None])
    own_row = jnp.full((1,), kv_heads * group + kv_head, jnp.int32)
    lanes = jnp.arange(heads_ref.shape[-1])[None, :]
    k_stored, k_new = _stored_token(load_rotated(heads_ref, own_row, rope_ref), k_refs)
    v_stored, v_new = _stored_token(pltriton.load(heads_ref.at[(own_row + kv_heads)[:, None], lanes]), v_refs)
    m, l, acc = own_key_carry(q, k_new, v_new, (split == 0) & (pos >= 0) & in_group, scale=scale, soft_cap=soft_cap)
    split_start = split * pages_per_split
    m, l, acc_pieces = _attend_pages(
        k_refs, v_refs, tables_ref, None, [q], reader.prepare([q]), jnp.where(in_group, pos, -1)[:, None], pos,
        (m, l, [acc]), jnp.maximum(lo_ref[0], split_start), jnp.minimum(hi_ref[0], split_start + pages_per_split),
        k_reader=reader, v_reader=reader, mean=None, page_size=page_size, scale=scale, soft_cap=soft_cap, window=window,
    )
    _store_output(o_ref, lse_ref, reader.pieces, m, l, acc_pieces, row, in_group)

    @pl.when((split == 0) & (page >= 0))
    def _store() -> None:
        offset = pl.ds(pos % page_size, 1)
        for out_ref, value in zip((*k_out_refs, *v_out_refs), (*k_stored, *v_stored), strict=True):
            out_ref[page, offset] = value


def _stored_token(x: Float[Array, "1 d"], leaves: Sequence[jax.Ref]) -> tuple[list[Array], Float[Array, "1 d"]]:
    """A token as a pool of ``leaves`` stores it (plain: in the leaf's dtype; fp8: E4M3 bytes and a
    per-token scale, as :func:`~zgen.pallas.paged_attention.layouts.quantize_fp8` does), and the value
    the pool then holds, in f32."""
    if len(leaves) == 1:
        stored = x.astype(leaves[0].dtype)
        return [stored], stored.astype(jnp.float32)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=1)
    token_scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    code = (x / token_scale[:, None]).astype(jnp.float8_e4m3fn)
    return [jax.lax.bitcast_convert_type(code, jnp.uint8), token_scale], code.astype(jnp.float32) * token_scale[:, None]


AppendPages: TypeAlias = Float[Array, "kvh pages page_size d"] | Fp8Pages


def _append_leaves(pages: AppendPages) -> list[Array]:
    """What the appending kernel reads and stores: a plain pool, or fp8 values as bytes and their scales."""
    if isinstance(pages, Fp8Pages):
        return [jax.lax.bitcast_convert_type(pages.values, jnp.uint8), pages.scale]
    return [pages]


def _from_leaves(pages: AppendPages, leaves: Sequence[Array]) -> AppendPages:
    if isinstance(pages, Fp8Pages):
        return Fp8Pages(values=jax.lax.bitcast_convert_type(leaves[0], pages.values.dtype), scale=leaves[1])
    return leaves[0]


def append_decode_attention(
    q: Float[Array, "b 1 h d"],
    k_new: Float[Array, "b 1 kvh d"],
    v_new: Float[Array, "b 1 kvh d"],
    k_pages: AppendPages,
    v_pages: AppendPages,
    block_tables: Int[Array, "b pages_per_seq"],
    positions: Int[Array, "b 1"],
    *,
    inv_freq: Float[Array, " half"] | None,
    sliding_window: int | None,
    soft_cap: float | None,
    scale: float,
    interpret: bool = False,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
) -> tuple[Float[Array, "b 1 h d"], AppendPages, AppendPages]:
    """A paged decode step's RoPE, page write and attention in one kernel over plain (float) or fp8
    pages, updated in place: :func:`~zgen.pallas.flash_attention.triton.append_decode_attention`'s
    step with the keys in pages (fp8 tokens quantized in the kernel). A row's visible pages are a run
    of its table (``[lo, hi)``: no compaction); splits of equal page runs as in :func:`paged_attention`,
    merged outside unless there is one."""
    b, _, h, d = q.shape
    kvh, _, page_size = leading_shape(k_pages)
    if not supports(k_pages):
        raise ConfigError(
            f"the Triton paged kernel needs a power-of-two page_size >= {MIN_DOT}, got {page_size}; "
            "use implementation='reference' or None"
        )
    g = h // kvh
    rows = max(MIN_DOT, next_pow2(g))
    pps = block_tables.shape[1]
    pos = positions[:, 0].astype(jnp.int32)
    hi = jnp.clip(pos // page_size + 1, 0, pps)  # the pages holding slots 0..pos (pos -1: none)
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.minimum(jnp.maximum(pos + 1 - sliding_window, 0) // page_size, hi)
    own = jnp.take_along_axis(block_tables, jnp.clip(pos // page_size, 0, pps - 1)[:, None], axis=1)[:, 0]
    page = jnp.where((pos >= 0) & (pos < pps * page_size), own, -1).astype(jnp.int32)  # -1 (also unallocated): no write
    per_split = cdiv(pps, split_count(pps, b * kvh, num_splits, target=APPEND_TARGET_PROGRAMS))
    splits = cdiv(pps, per_split)
    k_leaves, v_leaves = _append_leaves(k_pages), _append_leaves(v_pages)
    kernel = functools.partial(
        _append_kernel, reader=page_reader(k_pages, d, q.dtype), kv_heads=kvh, group=g, rows=rows, page_size=page_size,
        pages_per_split=per_split, scale=scale, soft_cap=soft_cap, window=sliding_window,
    )
    per_row = pl.BlockSpec((None, 1), lambda b, h, i: (b, 0))
    pools = [_leaf_spec(leaf) for leaf in k_leaves + v_leaves]
    if splits == 1:
        out_specs = [pl.BlockSpec((None, None, g, d), lambda b, h, i: (b, h, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, kvh, g, d), q.dtype)]
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, rows, d), lambda b, h, i: (b, h, i, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, i: (b, h, i, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((b, kvh, splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32),
        ]
    inputs = [
        jnp.concatenate([q, k_new, v_new], axis=2)[:, 0],
        rope_table(pos, inv_freq, d),
        pos[:, None],
        page[:, None],
        *k_leaves,
        *v_leaves,
        jnp.maximum(block_tables, 0).astype(jnp.int32),
        lo[:, None],
        hi[:, None],
    ]
    outs = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[
            pl.BlockSpec((None, h + 2 * kvh, d), lambda b, h, i: (b, 0, 0)),
            pl.BlockSpec((None, 2, d), lambda b, h, i: (b, 0, 0)),
            per_row,
            per_row,
            *pools,
            pl.BlockSpec((None, pps), lambda b, h, i: (b, 0)),
            per_row,
            per_row,
        ],
        out_specs=[*out_specs, *pools],
        out_shape=[*out_shape, *(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in k_leaves + v_leaves)],
        input_output_aliases={4 + i: len(out_shape) + i for i in range(len(pools))},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or _default_warps(k_pages), num_stages=num_stages),
        interpret=interpret,
        name="zgen_paged_append_decode",
    )(*inputs)
    n = len(k_leaves)
    stored = outs[len(out_shape) :]
    out = outs[0] if splits == 1 else merge_partials(outs[0], outs[1])[:, :, :g].astype(q.dtype)
    return out.reshape(b, 1, h, d), _from_leaves(k_pages, stored[:n]), _from_leaves(v_pages, stored[n:])
