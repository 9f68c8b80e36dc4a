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

Tiles = tuple[list[Array], Array | None]  # dequantized pieces, optional per-token scale


@dataclasses.dataclass(frozen=True)
class PageReader:
    """How one page of a layout becomes dequantized tiles: ``load(refs, page) -> (pieces, row_scale)``.

    ``pieces[i]`` is a ``[page_size, width_i]`` tile holding dims ``[start_i, start_i + width_i)``;
    ``row_scale`` (or None) multiplies each token's logit (K) or probability (V).
    """

    pieces: tuple[tuple[int, int], ...]
    num_refs: int
    load: Callable[[Sequence[jax.Ref], Array], Tiles]


def _native_reader(head_dim: int, dtype: jnp.dtype) -> PageReader:
    return PageReader(((0, head_dim),), 1, lambda refs, p: ([refs[0][p].astype(dtype)], None))


def _fp8_reader(head_dim: int, dtype: jnp.dtype) -> PageReader:
    def load(refs: Sequence[jax.Ref], p: Array) -> Tiles:
        values, scale = refs
        return [values[p].astype(dtype)], scale[p]

    return PageReader(((0, head_dim),), 2, load)


def _q4_reader(head_dim: int, group: int, dtype: jnp.dtype) -> PageReader:
    half = head_dim // 2
    n = half // group  # groups per half

    def load(refs: Sequence[jax.Ref], p: Array) -> Tiles:
        packed, scale, zero = refs
        lows, highs = [], []
        for j in range(n):
            byte = packed[p, :, pl.ds(j * group, group)].astype(jnp.int32)
            for codes, g, out in ((byte & 0xF, j, lows), (byte >> 4, n + j, highs)):
                out.append((codes.astype(jnp.float32) * scale[p, :, g][:, None] + zero[p, :, g][:, None]).astype(dtype))
        return lows + highs, None

    pieces = tuple((h * half + j * group, group) for h in range(2) for j in range(n))
    return PageReader(pieces, 3, load)


def _q3_reader(head_dim: int, dtype: jnp.dtype) -> PageReader:
    width = head_dim // 8

    def load(refs: Sequence[jax.Ref], p: Array) -> Tiles:
        planes, codebook = refs
        bits = [planes[p, :, b, :].astype(jnp.int32) for b in range(3)]
        cb = [codebook[p, :, c].astype(jnp.float32)[:, None] for c in range(8)]
        tiles = []
        for i in range(8):
            b0, b1, b2 = ((plane >> i) & 1 for plane in bits)
            pair = [jnp.where(b0 == 1, cb[2 * c + 1], cb[2 * c]) for c in range(4)]
            quad = [jnp.where(b1 == 1, pair[2 * c + 1], pair[2 * c]) for c in range(2)]
            tiles.append(jnp.where(b2 == 1, quad[1], quad[0]).astype(dtype))
        return tiles, None

    return PageReader(tuple((i * width, width) for i in range(8)), 2, load)


def page_reader(pages: KVPages, head_dim: int, dtype: jnp.dtype) -> PageReader:
    if isinstance(pages, Fp8Pages):
        return _fp8_reader(head_dim, dtype)
    if isinstance(pages, Q4Pages):
        return _q4_reader(head_dim, pages.group_size, dtype)
    if isinstance(pages, Q3Pages):
        return _q3_reader(head_dim, dtype)
    return _native_reader(head_dim, dtype)


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
    rows = q_ref.shape[0]

    def step(i: Array, carry: tuple[Array, Array, list[Array]]) -> tuple[Array, Array, list[Array]]:
        m, l, acc = carry
        page = tables_ref[first + i]
        k_tiles, k_scale = k_reader.load(k_refs, page)
        s = functools.reduce(jnp.add, [dot_nt(qp, kt) for qp, kt in zip(q_pieces, k_tiles, strict=True)])
        if k_scale is not None:
            s = s * k_scale.astype(jnp.float32)[None, :]
        pos = logical_ref[first + i] * page_size + jnp.arange(page_size)
        ok = visible(length - 1, pos, length, causal=True, window=window)
        s = jnp.where(ok[None, :], apply_soft_cap(s * scale, soft_cap), -jnp.inf)
        m, l, p, alpha = softmax_rescale(m, l, s)
        v_tiles, v_scale = v_reader.load(v_refs, page)
        if v_scale is not None:
            p = p * v_scale.astype(jnp.float32)[None, :]
        p = p.astype(v_tiles[0].dtype)
        acc = [a * alpha[:, None] + dot_nn(p, vt) for a, vt in zip(acc, v_tiles, strict=True)]
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

    k_leaves = jax.tree_util.tree_leaves(k_pages)
    v_leaves = jax.tree_util.tree_leaves(v_pages)
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
