"""Attention in plain jax.numpy: the full [T, S] logits, masked, softmaxed."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.pallas.common import is_query, masked_softmax_attention, query_positions, visible


def flash_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kvh d"],
    v: Float[Array, "b s kvh d"],
    lengths: Int[Array, " b"],
    *,
    q_positions: Int[Array, "b t"] | None = None,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    scale: float,
) -> Float[Array, "b t h d"]:
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4)  # [B, KVH, G, T, D]
    kt, vt = k.transpose(0, 2, 1, 3)[:, :, None], v.transpose(0, 2, 1, 3)[:, :, None]
    q_pos = query_positions(q_positions, b, t)[:, :, None]  # [B, T, 1]
    k_pos = jnp.arange(s)[None, None, :]
    length = lengths[:, None, None]
    mask = visible(q_pos, k_pos, length, causal=causal, window=sliding_window) & is_query(q_pos, length)
    out = masked_softmax_attention(qg, kt, vt, mask[:, None, None], scale=scale, cap=soft_cap)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
