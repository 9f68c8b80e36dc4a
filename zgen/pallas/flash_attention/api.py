"""``flash_attention``: causal, grouped-query attention over a right-padded ragged batch, queries anywhere in it."""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.errors import ConfigError
from zgen.pallas.common import Implementation, check_implementation, hopper, interpret_pallas, platform, resolve_scale
from zgen.rope import apply_rope


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


def default_implementation(
    q: Array, k: Array, *, causal: bool, window: int | None, cap: float | None, q_positions: Array | None = None
) -> Implementation:
    """GPU: the Mosaic GPU (Hopper) kernel where it covers the call, else the Triton kernel; elsewhere XLA."""
    if platform() != "gpu":
        return "xla"
    from zgen.pallas.flash_attention import mosaic_gpu

    covered = mosaic_gpu.supports(q, k, causal=causal, sliding_window=window, soft_cap=cap, q_positions=q_positions)
    return "mosaic_gpu" if covered and hopper() else "triton"


def flash_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kvh d"],
    v: Float[Array, "b s kvh d"],
    *,
    causal: bool = True,
    lengths: Int[Array, " b"] | None = None,
    q_positions: Int[Array, "b t"] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> Float[Array, "b t h d"]:
    """Attention of queries at positions ``p`` over keys at positions ``j`` (key slot ``j`` of ``k``/``v``).

    By default query ``i`` sits at position ``i`` (prefill self-attention). With ``q_positions`` the
    queries may sit anywhere in the key buffer, e.g. a prefill chunk after a cached prefix or one decode
    step (``T == 1``) of a KV cache: the Triton backend then runs a split-K decode kernel when
    ``T * H / KVH`` is small.

    Args:
      q: ``[B, T, H, D]``; query head ``h`` reads kv head ``h // (H // KVH)``.
      k, v: ``[B, S, KVH, D]``.
      causal: key ``j`` is visible to the query at position ``p`` only if ``j <= p``.
      lengths: ``[B]`` valid keys per row (right padding); keys at or past it are invisible. Default: ``S``.
      q_positions: ``[B, T]`` position of each query (default ``arange(T)`` in every row). Queries at a
        negative position or at or past the row's length are padding: their outputs are zero.
      sliding_window: keep only keys with ``p - j < sliding_window``.
      soft_cap: optional ``cap * tanh(logits / cap)`` after scaling.
      scale: logit scale, default ``D ** -0.5``.
      implementation: None (best for the platform), "reference", "xla", "triton" or "mosaic_gpu"
        (Hopper: causal bf16/f16 self-attention, head_dim 64 or 128, without window, cap or ``q_positions``).
    """
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B, S, KVH, D] matching q {q.shape}")
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    if q_positions is not None and q_positions.shape != (b, t):
        raise ValueError(f"q_positions {q_positions.shape} must be [B, T] = {(b, t)}")
    impl = (
        default_implementation(q, k, causal=causal, window=sliding_window, cap=soft_cap, q_positions=q_positions)
        if implementation is None
        else check_implementation(implementation)
    )
    lengths = jnp.full((b,), s, jnp.int32) if lengths is None else jnp.minimum(lengths.astype(jnp.int32), s)
    return _backend(impl)(
        q,
        k,
        v,
        lengths,
        q_positions=q_positions,
        causal=causal,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        scale=resolve_scale(d, scale),
    )


def append_and_attend(
    q: Float[Array, "b 1 h d"],
    k_new: Float[Array, "b 1 kvh d"],
    v_new: Float[Array, "b 1 kvh d"],
    k_cache: Float[Array, "b s kvh d"],
    v_cache: Float[Array, "b s kvh d"],
    positions: Int[Array, "b 1"],
    *,
    inv_freq: Float[Array, " half"] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[Float[Array, "b 1 h d"], Float[Array, "b s kvh d"], Float[Array, "b s kvh d"]]:
    """One decode step over a contiguous cache: rotate ``q`` and ``k_new`` (rotate-half RoPE with
    ``inv_freq`` at each row's position; no rotation without it), store each row's key/value in slot
    ``positions`` (a negative position stores nothing) and attend causally over slots ``0..position``.

    Returns the attention output and the updated buffers. On the GPU (``implementation`` None or
    "triton") one Triton kernel does it all, updating the buffers in place, where RoPE, a write and
    :func:`flash_attention` cost six more launches per layer; "reference" is exactly those steps.
    """
    b, t, _, d = q.shape
    if t != 1 or k_new.shape != (b, 1, k_cache.shape[2], d) or v_new.shape != k_new.shape or k_cache.shape != v_cache.shape:
        raise ValueError(f"append_and_attend takes one token per row: q {q.shape}, k/v {k_new.shape}, caches {k_cache.shape}")
    impl = ("triton" if platform() == "gpu" else "reference") if implementation is None else check_implementation(implementation)
    if impl == "triton":
        from zgen.pallas.flash_attention import triton

        return triton.append_decode_attention(
            q, k_new, v_new, k_cache, v_cache, positions, inv_freq=inv_freq, sliding_window=sliding_window,
            soft_cap=soft_cap, scale=resolve_scale(d, scale), interpret=interpret_pallas(),
        )
    if inv_freq is not None:
        q, k_new = (apply_rope(x, positions[:, :, None], inv_freq) for x in (q, k_new))
    slots = jnp.where(positions >= 0, positions, k_cache.shape[1])  # -1 → past the end: dropped
    rows = jnp.arange(b)[:, None]
    k_cache = k_cache.at[rows, slots].set(k_new.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, slots].set(v_new.astype(v_cache.dtype), mode="drop")
    out = flash_attention(
        q, k_cache, v_cache, q_positions=positions, sliding_window=sliding_window, soft_cap=soft_cap, scale=scale,
        implementation=impl,
    )
    return out, k_cache, v_cache
