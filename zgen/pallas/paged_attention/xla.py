"""Paged attention in XLA: a loop over chunks of pages with an online softmax.

Each step gathers one chunk of pages per sequence in the stored layout and dequantizes only that
chunk, so a quantized cache never has a full-precision copy larger than one chunk. Coded keys are
read as the Triton kernel reads them: through the query folded into the coding, plus the centre's
share of each logit (see :class:`KeyCalibration`), so no key is decoded. The loop runs only over chunks that some query can see (up to the
latest query, from the earliest window).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zgen.numerics import matmul_precision
from zgen.pallas.common import RUNNING_MAX_INIT, finish_softmax, platform, soft_cap as apply_soft_cap, softmax_rescale, visible
from zgen.shapes import cdiv
from zgen.pallas.paged_attention.common import query_bounds
from zgen.pallas.paged_attention.layouts import KeyCalibration, KVPages, dequantize_pieces, leading_shape, take_pages
from zgen.rope import rope_cos_sin

DEFAULT_CHUNK_TOKENS = 512
# On CPU a smaller chunk keeps its dequantized K/V and logits in cache, and a short sequence computes
# less of a chunk it only partly fills: one SmolLM2 layer's decode attention over a 40-token q4 cache
# took 0.24 ms in chunks of 512 tokens and 0.1 ms in chunks of 128 (at 600 tokens 2.5 and 0.55 ms).
CPU_CHUNK_TOKENS = 128


def _mean_logits(calibration: KeyCalibration, qg: Float[Array, "b kvh g t d"], chunk_tokens: int) -> Callable[[Array], Array]:
    """``mean(start)``: ``q . rope(shift, pos)`` of each query and the keys of the chunk at positions
    ``start .. start + chunk_tokens - 1``, ``[B, KVH, G, T, chunk_tokens]``. As in the Triton kernel,
    the angle ``(start + i) f`` splits by angle addition: the query-mean products are rotated by the
    chunk's start angle, then dotted with the in-chunk offsets' cosines and sines (one table for the
    whole loop), so a chunk costs ``D / 2`` sines instead of ``chunk_tokens * D / 2``."""
    mean_a, mean_b, sink_gap = calibration.mean_products(qg, head_axis=1)
    exact = matmul_precision(jnp.float32)
    cos_off, sin_off = rope_cos_sin(jnp.arange(chunk_tokens), calibration.inv_freq)  # [chunk, D/2]

    def mean(start: Array) -> Array:
        cos_start, sin_start = rope_cos_sin(start, calibration.inv_freq)
        a = mean_a * cos_start + mean_b * sin_start
        b = mean_b * cos_start - mean_a * sin_start
        out = jnp.einsum("bkgqh,th->bkgqt", a, cos_off, precision=exact)
        out += jnp.einsum("bkgqh,th->bkgqt", b, sin_off, precision=exact)
        first = start + jnp.arange(chunk_tokens) == 0
        return out + jnp.where(first, sink_gap[..., None], 0.0)

    return mean


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
    pages_per_chunk: int | None = None,
) -> Float[Array, "b t h d"]:
    b, t, h, d = q.shape
    kvh, _, page_size = leading_shape(k_pages)
    pps = block_tables.shape[1]
    chunk_target = CPU_CHUNK_TOKENS if platform() == "cpu" else DEFAULT_CHUNK_TOKENS
    chunk = min(pps, pages_per_chunk or max(1, chunk_target // page_size))
    n_chunks = cdiv(pps, chunk)
    # The table gets one chunk more than the loop visits, so the chunk's slice of it depends on the loop
    # counter even when one chunk holds the whole table: otherwise XLA hoists the gather of the pages
    # out of the loop, and XLA:CPU then fuses it with the write of this step's tokens into the same
    # pool; the fused gather reads the pool from before the write and XLA keeps that alive with a copy
    # of the whole pool, per layer and step (q3 and q4 decoded 2-3x slower for it).
    pad = (n_chunks + 1) * chunk - pps
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    valid_pages = jnp.pad(page_mask, ((0, 0), (0, pad)))
    chunk_tokens = chunk * page_size
    # bf16 queries multiply bf16 keys on the MXU / tensor cores; f32 stays f32.
    compute_dtype = q.dtype
    precision = matmul_precision(compute_dtype)
    qg = q.reshape(b, t, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4)  # [B, KVH, G, T, D]
    qpos = q_positions[:, :, None]
    mean_logits = None
    if key_calibration is not None:
        mean_logits = _mean_logits(key_calibration, qg, chunk_tokens)
        qg = key_calibration.fold_into_queries(qg, head_axis=1).astype(compute_dtype)

    q_cols = qg.transpose(1, 0, 4, 2, 3).reshape(kvh, b, d, -1)  # [KVH, B, D, G * T]

    def body(c: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        m, l, acc = carry
        idx = jax.lax.dynamic_slice_in_dim(tables, c * chunk, chunk, axis=1)
        pos = c * chunk_tokens + jnp.arange(chunk_tokens)
        k_pieces = dequantize_pieces(take_pages(k_pages, idx), compute_dtype)
        v_pieces = dequantize_pieces(take_pages(v_pages, idx), compute_dtype)
        # Keys as the dot's left operand in their stored order (XLA:CPU otherwise writes the
        # dequantized keys transposed), the few queries as its right one; a piece of the head dim at a time.
        s, start = jnp.zeros((kvh, b, chunk_tokens, q_cols.shape[-1]), jnp.float32), 0
        for piece in k_pieces:
            width = piece.shape[-1]
            keys = piece.reshape(kvh, b, chunk_tokens, width)
            s += jax.lax.dot_general(
                keys, q_cols[:, :, start:start + width], (((3,), (2,)), ((0, 1), (0, 1))), precision=precision, preferred_element_type=jnp.float32
            )
            start += width
        s = s.reshape(kvh, b, chunk_tokens, h // kvh, t).transpose(1, 0, 3, 4, 2)  # [B, KVH, G, T, chunk]
        if mean_logits is not None:
            s += mean_logits(c * chunk_tokens)
        s = s * scale
        ok = visible(qpos, pos[None, None, :], qpos + 1, causal=True, window=sliding_window)  # [B, T, chunk]
        ok &= jnp.repeat(jax.lax.dynamic_slice_in_dim(valid_pages, c * chunk, chunk, axis=1), page_size, axis=1)[:, None, :]
        s = jnp.where(ok[:, None, None], apply_soft_cap(s, soft_cap), -jnp.inf)
        m, l, p, alpha = softmax_rescale(m, l, s)
        pv = jnp.concatenate([
            jnp.einsum("bkgqt,kbtd->bkgqd", p.astype(compute_dtype), piece.reshape(kvh, b, chunk_tokens, -1), preferred_element_type=jnp.float32, precision=precision)
            for piece in v_pieces
        ], axis=-1)
        return m, l, acc * alpha[..., None] + pv

    first, last = query_bounds(q_positions.reshape(-1))
    hi = (last + chunk_tokens) // chunk_tokens
    lo = jnp.zeros((), hi.dtype)
    if sliding_window is not None:
        lo = jnp.maximum(first + 1 - sliding_window, 0) // chunk_tokens
    shape = (b, kvh, h // kvh, t)
    init = (
        jnp.full(shape, RUNNING_MAX_INIT, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, d), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(lo, jnp.minimum(hi, n_chunks), body, init)
    out, _ = finish_softmax(acc, m, l)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
