"""Paged attention in plain jax.numpy: dequantize every page, gather, (decode coded keys,) mask, softmax."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zgen.pallas.common import masked_softmax_attention, visible
from zgen.pallas.paged_attention.layouts import KeyCalibration, KVPages, dequantize, leading_shape


def _dense(pages: KVPages, block_tables: Array) -> Array:
    """[B, KVH, pages_per_seq * page_size, D] in f32 (table entries are clipped, masked later)."""
    full = dequantize(pages, jnp.float32)  # [KVH, P, page, D]
    gathered = jnp.take(full, block_tables, axis=1, mode="clip")  # [KVH, B, pps, page, D]
    kvh, b, pps, page, d = gathered.shape
    return gathered.transpose(1, 0, 2, 3, 4).reshape(b, kvh, pps * page, d)


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
) -> Float[Array, "b t h d"]:
    b, t, h, d = q.shape
    kvh, _, page_size = leading_shape(k_pages)
    k, v = _dense(k_pages, block_tables), _dense(v_pages, block_tables)
    pos = jnp.arange(k.shape[2])
    if key_calibration is not None:
        k = key_calibration.decode(k, pos, head_axis=1)
    qpos = q_positions[:, :, None]
    mask = visible(qpos, pos[None, None, :], qpos + 1, causal=True, window=sliding_window)  # [B, T, S]
    mask &= jnp.repeat(page_mask, page_size, axis=1)[:, None, :]
    qg = q.reshape(b, t, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4)  # [B, KVH, G, T, D]
    out = masked_softmax_attention(qg, k[:, :, None], v[:, :, None], mask[:, None, None], scale=scale, cap=soft_cap)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
