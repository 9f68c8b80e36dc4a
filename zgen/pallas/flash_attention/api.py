"""``flash_attention``: causal, grouped-query prefill attention over a right-padded ragged batch."""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.errors import ConfigError
from zgen.pallas.common import Implementation, check_implementation, interpret_pallas, platform, resolve_scale


def _backend(implementation: Implementation) -> Callable[..., Any]:
    if implementation == "reference":
        from zgen.pallas.flash_attention import reference

        return reference.flash_attention
    if implementation == "xla":
        from zgen.pallas.flash_attention import xla

        return xla.flash_attention
    if implementation == "triton":
        from zgen.pallas.flash_attention import triton

        return lambda *a, **kw: triton.flash_attention(*a, **kw, interpret=interpret_pallas())
    if implementation == "mosaic_gpu":
        from zgen.pallas.flash_attention import mosaic_gpu

        return mosaic_gpu.flash_attention
    raise ConfigError(
        f"unknown flash_attention implementation {implementation!r}; choose reference, xla, triton, mosaic_gpu or None"
    )


def default_implementation(q: Array, k: Array, *, causal: bool, window: int | None, cap: float | None) -> Implementation:
    """GPU: jax's Mosaic GPU kernel where it covers the call, else our Triton kernel; elsewhere XLA."""
    if platform() != "gpu":
        return "xla"
    from zgen.pallas.flash_attention import mosaic_gpu

    return "mosaic_gpu" if mosaic_gpu.supports(q, k, causal=causal, sliding_window=window, soft_cap=cap) else "triton"


def flash_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kvh d"],
    v: Float[Array, "b s kvh d"],
    *,
    causal: bool = True,
    lengths: Int[Array, " b"] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> Float[Array, "b t h d"]:
    """Self-attention for prefill; query ``i`` and key ``j`` sit at positions ``i`` and ``j``.

    Args:
      q: ``[B, T, H, D]``; query head ``h`` reads kv head ``h // (H // KVH)``.
      k, v: ``[B, S, KVH, D]``.
      causal: key ``j`` is visible to query ``i`` only if ``j <= i``.
      lengths: ``[B]`` valid tokens per row (right padding); keys at or past it are invisible and the
        outputs of queries at or past it are zero. Default: all of ``S``.
      sliding_window: keep only keys with ``i - j < sliding_window``.
      soft_cap: optional ``cap * tanh(logits / cap)`` after scaling.
      scale: logit scale, default ``D ** -0.5``.
      implementation: None (best for the platform), "reference", "xla", "triton" or "mosaic_gpu"
        (jax's bundled Hopper kernel; causal float16 without window or cap).
    """
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B, S, KVH, D] matching q {q.shape}")
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    impl = (
        default_implementation(q, k, causal=causal, window=sliding_window, cap=soft_cap)
        if implementation is None
        else check_implementation(implementation)
    )
    lengths = jnp.full((b,), s, jnp.int32) if lengths is None else jnp.minimum(lengths.astype(jnp.int32), s)
    return _backend(impl)(
        q,
        k,
        v,
        lengths,
        causal=causal,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        scale=resolve_scale(d, scale),
    )
