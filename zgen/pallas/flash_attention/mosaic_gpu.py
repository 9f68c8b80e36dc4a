"""Prefill on Hopper: jax's bundled Mosaic GPU FlashAttention-3 kernel, for the cases it covers.

That kernel is warp-specialized (TMA producer + two WGMMA consumer warpgroups) and runs near the
tensor-core roofline, but it knows only full-length causal or non-causal attention without logit
scaling, windows or caps. Causal prefill over a right-padded batch still fits: a valid query never sees
a key past its own position, so padding keys only reach padding queries, whose rows we zero. Other
cases go to the Triton kernel (``supports`` decides).

float16 only: the bundled kernel allocates its shared-memory tiles as float16 whatever the input dtype,
so bf16 inputs fail to lower on the GPU (jax 0.10.2 and 0.11.2: "Expected dtypes to match but src had
type bfloat16 and dst had type float16"). Casting bf16 to f16 would silently overflow past 65504, so bf16
calls go to the Triton kernel instead.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.errors import ConfigError
from zgen.pallas.common import is_query

# Queries go in tiles of 2 x block_q (two consumer warpgroups); keys in tiles of block_kv.
BLOCK_Q, BLOCK_KV, STEPS = 64, 128, 2
PAD_MULTIPLE = 128  # lcm(2 * BLOCK_Q, BLOCK_KV)


def supports(
    q: Array,
    k: Array,
    *,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    q_positions: Array | None = None,
) -> bool:
    """Only self-attention from slot 0: queries at other positions (``q_positions``) go to Triton."""
    return (
        causal
        and q_positions is None
        and sliding_window is None
        and soft_cap is None
        and q.shape[1] == k.shape[1]
        and q.shape[-1] % 64 == 0
        and jnp.dtype(q.dtype) == jnp.dtype(jnp.float16)
        and jnp.dtype(k.dtype) == jnp.dtype(jnp.float16)
    )


def flash_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kvh d"],
    v: Float[Array, "b s kvh d"],
    lengths: Int[Array, " b"],
    *,
    q_positions: None = None,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    scale: float,
    block_q: int = BLOCK_Q,
    block_kv: int = BLOCK_KV,
    max_concurrent_steps: int = STEPS,
) -> Float[Array, "b t h d"]:
    if not supports(q, k, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap, q_positions=q_positions):
        raise ConfigError(
            "implementation='mosaic_gpu' prefill covers causal float16 self-attention without window, soft cap "
            "or q_positions; "
            "pass implementation=None to let zgen choose"
        )
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    t = q.shape[1]
    pad = ((0, 0), (0, -t % PAD_MULTIPLE), (0, 0), (0, 0))
    config = attention_mgpu.TuningConfig(
        block_q=block_q, block_kv=block_kv, max_concurrent_steps=max_concurrent_steps, causal=True
    )
    # The kernel applies no logit scale: fold it into the queries.
    scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)
    out: Array = attention_mgpu.attention(jnp.pad(scaled, pad), jnp.pad(k, pad), jnp.pad(v, pad), config)  # type: ignore[assignment]
    out = out[:, :t]
    real = is_query(jnp.arange(t)[None, :], lengths[:, None])
    return jnp.where(real[:, :, None, None], out, 0).astype(q.dtype)
