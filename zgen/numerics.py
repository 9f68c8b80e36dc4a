"""Numeric conventions every layer shares: matmul precision by input dtype, and the RMS norm (what
the graph computes and what the fused kernels must reproduce)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float


def matmul_precision(*dtypes: DTypeLike) -> jax.lax.Precision:
    """HIGHEST when any input is float32 or wider, so f32 does not silently drop to TF32 on GPUs."""
    wide = any(jnp.issubdtype(d, jnp.floating) and jnp.dtype(d).itemsize >= 4 for d in dtypes)
    return jax.lax.Precision.HIGHEST if wide else jax.lax.Precision.DEFAULT


def rms_norm(x: Float[Array, "*rows size"], weight: Float[Array, " size"], eps: float) -> Float[Array, "*rows size"]:
    # Normalize in float32 whatever the activation dtype, round, then scale by the weight, as HF does.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed.astype(x.dtype) * weight).astype(x.dtype)


def add_rms_norm(
    x: Float[Array, "*rows size"], delta: Float[Array, "*rows size"], weight: Float[Array, " size"], eps: float
) -> tuple[Float[Array, "*rows size"], Float[Array, "*rows size"]]:
    """The residual stream after a block (``x + delta``, in the activation dtype) and its RMS norm."""
    total = x + delta
    return total, rms_norm(total, weight, eps)
