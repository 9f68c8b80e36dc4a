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

Coded keys (``key_calibration``) and keys stored before RoPE (``key_rope``) take another path: the
page's keys are dequantized to f32 tiles, decoded (the inverse Hadamard rotation as dots against the
rotation matrix, straight into the two halves of the head vector, then unscaled and re-centred; the
key at position 0 on its own centre) and rotated to their positions (cos/sin of ``position *
inv_freq``, from one table of in-page offsets per program and the page's start angle per step),
before the query dot.
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
from zgen.pallas.common import RUNNING_MAX_INIT, finish_softmax, merge_partials, soft_cap as apply_soft_cap, softmax_rescale, visible
from zgen.pallas.paged_attention.common import (
    cdiv,
    query_blocks,
    rope_cos_sin,
    rotate_halves,
    slot_ranges,
    split_pages,
    ungroup_queries,
)
from zgen.pallas.paged_attention.layouts import (
    Q3_LEVELS,
    Fp8Pages,
    KeyCalibration,
    KVPages,
    Q3Pages,
    Q4Pages,
    hadamard_matrix,
    leading_shape,
)
from zgen.pallas.triton_utils import MIN_DOT, dot_nn, dot_nt, next_pow2

@dataclasses.dataclass(frozen=True)
class PageReader:
    """How a kernel consumes one page of a layout, with the dequantization folded where it is cheapest.

    ``prepare(q_pieces)`` runs once per program (e.g. per-group query sums); ``logits(refs, page, q_pieces,
    prepared)`` returns the unscaled ``q . k`` of the page's tokens, ``[rows, page_size]`` f32;
    ``values(refs, page, p)`` returns ``p @ v`` for the probabilities ``p`` ``[rows, page_size]`` f32, one
    ``[rows, width]`` f32 tile per entry of ``pieces`` (``(start, width)`` dim ranges that unpack
    without lane shuffles, see ``layouts``); ``tiles(refs, page)`` returns the page's dequantized
    vectors, one ``[page_size, width]`` f32 tile per piece (for keys that must be decoded first).
    Pieces are symmetric: piece ``j`` of the first half pairs with piece ``j + len/2`` of the second,
    as RoPE pairs dim ``d`` with ``d + D/2``.
    """

    pieces: tuple[tuple[int, int], ...]
    num_refs: int
    logits: Callable[[Sequence[jax.Ref], Array, Sequence[Array], Sequence[Array]], Array]
    values: Callable[[Sequence[jax.Ref], Array, Array], list[Array]]
    tiles: Callable[[Sequence[jax.Ref], Array], list[Array]]
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


def _halves(head_dim: int) -> tuple[tuple[int, int], ...]:
    return ((0, head_dim // 2), (head_dim // 2, head_dim // 2))


def _native_reader(head_dim: int, dtype: jnp.dtype, split: bool) -> PageReader:
    """``split``: read the page as its two halves (what decoding keys needs), else as one tile."""
    pieces = _halves(head_dim) if split else ((0, head_dim),)

    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], _: Sequence[Array]) -> Array:
        return functools.reduce(jnp.add, [dot_nt(qi, ki.astype(dtype)) for qi, ki in zip(q, tiles(refs, p), strict=True)])

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        return [dot_nn(probs.astype(dtype), vi.astype(dtype)) for vi in tiles(refs, p)]

    def tiles(refs: Sequence[jax.Ref], p: Array) -> list[Array]:
        return [refs[0][p, :, pl.ds(start, width)].astype(jnp.float32) for start, width in pieces]

    return PageReader(pieces, 1, logits, values, tiles)


def _fp8_reader(head_dim: int, dtype: jnp.dtype, split: bool) -> PageReader:
    """E4M3 tiles go to the dot as they are (exact in bf16); the per-token scale multiplies the logits
    (K) or the probabilities (V), ``page_size`` values per row instead of ``page_size * D``."""
    pieces = _halves(head_dim) if split else ((0, head_dim),)

    def raw(vals: jax.Ref, p: Array) -> list[Array]:
        return [vals[p, :, pl.ds(start, width)] for start, width in pieces]

    def logits(refs: Sequence[jax.Ref], p: Array, q: Sequence[Array], _: Sequence[Array]) -> Array:
        vals, scale = refs
        dots = [dot_nt(qi, ki.astype(dtype)) for qi, ki in zip(q, raw(vals, p), strict=True)]
        return functools.reduce(jnp.add, dots) * scale[p][None, :]

    def values(refs: Sequence[jax.Ref], p: Array, probs: Array) -> list[Array]:
        vals, scale = refs
        scaled = _scaled(probs, scale[p], dtype)
        return [dot_nn(scaled, vi.astype(dtype)) for vi in raw(vals, p)]

    def tiles(refs: Sequence[jax.Ref], p: Array) -> list[Array]:
        vals, scale = refs
        return [vi.astype(jnp.float32) * scale[p][:, None] for vi in raw(vals, p)]

    return PageReader(pieces, 2, logits, values, tiles)


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

    def tiles(refs: Sequence[jax.Ref], p: Array) -> list[Array]:
        packed, scale, zero = refs
        s_cols, z_cols = _columns(scale, p, groups), _columns(zero, p, groups)
        return [
            cg.astype(jnp.float32) * sg[:, None] + zg[:, None]
            for cg, sg, zg in zip(codes(packed, p), s_cols, z_cols, strict=True)
        ]

    pieces = tuple((h * half + j * group, group) for h in range(2) for j in range(n))
    return PageReader(pieces, 3, logits, values, tiles, prepare)


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

    def tiles(refs: Sequence[jax.Ref], p: Array) -> list[Array]:
        return [li * si[:, None] for li, si in zip(levels(refs, p), block_scales(refs, p), strict=True)]

    return PageReader(tuple((i * width, width) for i in range(8)), 2, logits, values, tiles)


def page_reader(pages: KVPages, head_dim: int, dtype: jnp.dtype, split: bool = False) -> PageReader:
    """The reader of a layout; ``split`` reads whole-vector layouts as two halves (keys to decode)."""
    if isinstance(pages, Fp8Pages):
        return _fp8_reader(head_dim, dtype, split)
    if isinstance(pages, Q4Pages):
        return _q4_reader(head_dim, pages.group_size, dtype)
    if isinstance(pages, Q3Pages):
        return _q3_reader(head_dim, pages.group_size, dtype)
    return _native_reader(head_dim, dtype, split)


def kernel_leaves(pages: KVPages) -> list[Array]:
    """The leaves the kernel reads: the data leaf as stored, 2-byte metadata widened to u32 pairs."""
    first, *meta = jax.tree_util.tree_leaves(pages)
    return [first, *(widen_metadata(leaf) for leaf in meta)] if not isinstance(pages, jax.Array) else [first]


@dataclasses.dataclass(frozen=True)
class KeyDecoding:
    """What the kernel must do to stored keys before the query dot (static).

    ``rope``: they are stored before RoPE (an ``inv_freq [D/2]`` ref follows the page leaves);
    ``calibrated``: they are coded with a :class:`KeyCalibration` (refs: this kv head's centre, sink
    and reciprocal scale rows ``[D]``, then the rotation matrix ``[D, D]``).
    """

    rope: bool
    calibrated: bool

    @property
    def num_refs(self) -> int:
        return int(self.rope) + 4 * int(self.calibrated)


def _matmul(a: Array, b: Array) -> Array:
    """``a @ b`` in f32, a [m, k], b [k, n]; a k narrower than a tensor-core dot becomes a broadcast-and-reduce."""
    if a.shape[1] < MIN_DOT:
        return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :], axis=1)
    return dot_nn(a, b)


def _calibration_decoder(
    reader: PageReader, refs: Sequence[jax.Ref], head_dim: int, dtype: jnp.dtype
) -> Callable[[list[Array], Array], list[Array]]:
    """``decode(tiles, positions)``: a page's dequantized key tiles (the reader's pieces) to the two
    decoded halves of the keys. The inverse rotation is one dot per piece and half against the
    matching block of the rotation matrix; then the reciprocal scale and the centre (the sink's at
    position 0). The centre, sink and scale rows load once per program."""
    half = head_dim // 2
    center_ref, sink_ref, inv_scale_ref, rotation_ref = refs
    center, sink, inv_scale = (
        [ref[pl.ds(h * half, half)][None, :] for h in range(2)] for ref in (center_ref, sink_ref, inv_scale_ref)
    )

    def decode(tiles: list[Array], pos: Array) -> list[Array]:
        # The rotation matrix is read at every step (from cache): held across the loop, its D x D
        # values would take the registers the page tiles need.
        blocks = [
            [rotation_ref[pl.ds(start, width), pl.ds(h * half, half)].astype(dtype) for h in range(2)]
            for start, width in reader.pieces
        ]
        first = (pos == 0)[:, None]
        rotated = [
            functools.reduce(jnp.add, [_matmul(t.astype(dtype), blk[h]) for t, blk in zip(tiles, blocks, strict=True)])
            for h in range(2)
        ]
        return [r * inv_scale[h] + jnp.where(first, sink[h], center[h]) for h, r in enumerate(rotated)]

    return decode


def _decoded_key_logits(
    q_ref: jax.Ref, reader: PageReader, k_refs: Sequence[jax.Ref], coding_refs: Sequence[jax.Ref], decoding: KeyDecoding, dtype: jnp.dtype
) -> Callable[[Array, Array], Array]:
    """``logits(page, start)`` for coded or pre-RoPE keys of a page whose first token sits at
    ``start``: dequantize the page to f32 tiles, decode them (into the two halves of the head
    vector), rotate each pair of matching half-tiles to its positions, then the query dots.

    The angle of offset ``i`` is ``(start + i) * f``: its cosine and sine come from the page's start
    angle (``width`` of each per page) and a per-program table of the offsets' (by angle addition),
    not from ``page_size * width`` transcendental calls per page.
    """
    d = q_ref.shape[1]
    page_size = k_refs[0].shape[1]
    freq = coding_refs[0] if decoding.rope else None
    decode = _calibration_decoder(reader, coding_refs[int(decoding.rope) :], d, dtype) if decoding.calibrated else None
    pieces = _halves(d) if decoding.calibrated else reader.pieces
    q_pieces = [q_ref[:, pl.ds(start, width)] for start, width in pieces]
    freqs = [] if freq is None else [freq[pl.ds(start, width)] for start, width in pieces[: len(pieces) // 2]]
    offsets = [rope_cos_sin(jnp.arange(page_size), f) for f in freqs]

    def logits(page: Array, start: Array) -> Array:
        tiles = reader.tiles(k_refs, page)
        if decode is not None:
            tiles = decode(tiles, start + jnp.arange(page_size))
        if freqs:
            n = len(tiles) // 2
            pairs = []
            for j in range(n):
                cos_start, sin_start = rope_cos_sin(start, freqs[j])
                cos_off, sin_off = offsets[j]
                cos = cos_off * cos_start[None, :] - sin_off * sin_start[None, :]
                sin = sin_off * cos_start[None, :] + cos_off * sin_start[None, :]
                pairs.append(rotate_halves(tiles[j], tiles[j + n], cos, sin))
            tiles = [low for low, _ in pairs] + [high for _, high in pairs]
        return functools.reduce(jnp.add, [dot_nt(qi, ki.astype(dtype)) for qi, ki in zip(q_pieces, tiles, strict=True)])

    return logits


def _kernel(
    q_ref: jax.Ref,
    qpos_ref: jax.Ref,
    *refs: jax.Ref,
    k_reader: PageReader,
    v_reader: PageReader,
    decoding: KeyDecoding | None,
    page_size: int,
    pages_per_split: int,
    splits: int,
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> None:
    k_refs, refs = refs[: k_reader.num_refs], refs[k_reader.num_refs :]
    v_refs, refs = refs[: v_reader.num_refs], refs[v_reader.num_refs :]
    num_coding = 0 if decoding is None else decoding.num_refs
    coding_refs, refs = refs[:num_coding], refs[num_coding:]
    tables_ref, logical_ref, lo_ref, hi_ref, o_ref, lse_ref = refs
    split_start = (pl.program_id(2) % splits) * pages_per_split
    start = jnp.maximum(lo_ref[0], split_start)
    end = jnp.minimum(hi_ref[0], split_start + pages_per_split)
    qpos = qpos_ref[...][:, None]
    rows = q_ref.shape[0]
    key_logits: Callable[[Array, Array], Array]
    if decoding is None:
        q_pieces = [q_ref[:, pl.ds(dim, width)] for dim, width in k_reader.pieces]
        prepared = k_reader.prepare(q_pieces)
        key_logits = lambda page, first: k_reader.logits(k_refs, page, q_pieces, prepared)  # noqa: E731
    else:
        key_logits = _decoded_key_logits(q_ref, k_reader, k_refs, coding_refs, decoding, q_ref.dtype)

    def step(slot: Array, carry: tuple[Array, Array, list[Array]]) -> tuple[Array, Array, list[Array]]:
        m, l, acc = carry
        page = tables_ref[slot]
        first = logical_ref[slot] * page_size
        pos = first + jnp.arange(page_size)
        s = key_logits(page, first)
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


def _coding_inputs(
    key_rope: Array | None, key_calibration: KeyCalibration | None, head_dim: int
) -> tuple[list[Array], list[pl.BlockSpec]]:
    """The arrays (and block specs) :class:`KeyDecoding` refs stand for, in its order."""
    inputs: list[Array] = []
    specs: list[pl.BlockSpec] = []
    if key_rope is not None:
        inputs.append(key_rope)
        specs.append(pl.BlockSpec((head_dim // 2,), lambda b, h, s: (0,)))
    if key_calibration is not None:
        c = key_calibration
        inputs += [c.center.astype(jnp.float32), c.sink.astype(jnp.float32), 1.0 / c.scale.astype(jnp.float32)]
        specs += [pl.BlockSpec((None, head_dim), lambda b, h, s: (h, 0))] * 3
        inputs.append(hadamard_matrix(head_dim))
        specs.append(pl.BlockSpec((head_dim, head_dim), lambda b, h, s: (0, 0)))
    return inputs, specs


def _leaf_spec(leaf: Array) -> pl.BlockSpec:
    """The whole of one kv head's pages; the kernel indexes pages itself."""
    trailing = leaf.ndim - 1
    return pl.BlockSpec((None, *leaf.shape[1:]), lambda b, h, s: (h,) + (0,) * trailing)


def supports(k_pages: KVPages) -> bool:
    """Pages the kernel can tile: the page is the key tile of its dots."""
    page_size = leading_shape(k_pages)[2]
    return page_size >= MIN_DOT and page_size & (page_size - 1) == 0


def _launch(num_queries: int, group: int) -> tuple[int, int]:
    """``(block_t, rows)``: one token's query group for decode, else up to 64 rows of tokens x group."""
    block_t = 1 if num_queries == 1 else min(next_pow2(num_queries), max(1, prev_pow2(64 // group)))
    return block_t, max(MIN_DOT, next_pow2(block_t * group))


def prev_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


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
    key_rope: Float[Array, " half"] | None = None,
    key_calibration: KeyCalibration | None = None,
    interpret: bool = False,
    num_splits: int | None = None,
    num_warps: int = 4,
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

    k_leaves = kernel_leaves(k_pages)
    v_leaves = kernel_leaves(v_pages)
    decoding = None
    if key_rope is not None or key_calibration is not None:
        decoding = KeyDecoding(rope=key_rope is not None, calibrated=key_calibration is not None)
    coding_inputs, coding_specs = _coding_inputs(key_rope, key_calibration, d)
    kernel = functools.partial(
        _kernel,
        # RoPE without calibration rotates the reader's own pieces: whole-vector layouts read as halves.
        k_reader=page_reader(k_pages, d, q.dtype, split=decoding is not None and not decoding.calibrated),
        v_reader=page_reader(v_pages, d, q.dtype),
        decoding=decoding,
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
            pl.BlockSpec((None, None, None, rows, d), lambda b, h, i: (b, h, i // splits, 0, 0)),
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
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="zgen_paged_attention",
    )(q_tiles, q_pos, *k_leaves, *v_leaves, *coding_inputs, tables, logical, lo[..., None], hi[..., None])
    return ungroup_queries(merge_partials(out, lse), t, h, block_t).astype(q.dtype)
