"""Tile helpers for kernels written against the Pallas Triton backend (also run by the CPU interpreter)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from zgen.numerics import matmul_precision

# Triton's tensor-core dot needs every dimension to be at least 16.
MIN_DOT = 16


def prev_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def dot_nt(a: Array, b: Array) -> Array:
    """``a @ b.T`` in f32; a [m, k], b [n, k]. Narrow k falls back to a broadcast-and-reduce."""
    if a.shape[1] < MIN_DOT:
        return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :], axis=-1)
    return jnp.dot(a, b.T, preferred_element_type=jnp.float32, precision=matmul_precision(a.dtype))


def dot_nn(a: Array, b: Array) -> Array:
    """``a @ b`` in f32; a [m, k], b [k, n]. Narrow n falls back to a broadcast-and-reduce."""
    if b.shape[1] < MIN_DOT:
        return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :], axis=1)
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=matmul_precision(a.dtype))
