"""Rotary position embedding (rotate-half RoPE): the model's rotation and the paged kernels' own."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rope_cos_sin(
    positions: Int[Array, "*lead"], inv_freq: Float[Array, " half"]
) -> tuple[Float[Array, "*lead half"], Float[Array, "*lead half"]]:
    """Cosines and sines of the rotary angles ``position * inv_freq``, in float32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def rotate_halves(
    x1: Float[Array, "*lead half"], x2: Float[Array, "*lead half"], cos: Float[Array, "*lead half"], sin: Float[Array, "*lead half"]
) -> tuple[Float[Array, "*lead half"], Float[Array, "*lead half"]]:
    """Rotate-half RoPE on the two halves of head vectors (dim ``d`` pairs with dim ``d + D/2``).

    Kernels call it on matching tiles of the halves, so they never shuffle lanes across a tile.
    """
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def apply_rope(x: Float[Array, "*lead d"], positions: Int[Array, "*lead"], inv_freq: Float[Array, " half"]) -> Float[Array, "*lead d"]:
    """Rotate-half RoPE of head vectors ``x`` at ``positions`` (broadcast against ``x``'s leading
    dims), computed in float32 and returned in ``x``'s dtype."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate(rotate_halves(x1, x2, cos, sin), axis=-1).astype(x.dtype)


def rotary(x: Float[Array, "B T heads D"], positions: Int[Array, "B T"], inv_freq: Float[Array, " half"]) -> Float[Array, "B T heads D"]:
    """Rotate-half RoPE of every head at its token's position (the paged kernels' rotation, too)."""
    return apply_rope(x, positions[:, :, None], inv_freq)
