"""Tile helpers for kernels written against the Pallas Triton backend (also run by the CPU interpreter)."""

from __future__ import annotations

import jax
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


# bf16 128.0: with a nibble ``c`` or'ed into the low mantissa bits it reads 128 + c (the unit in the last
# place of 128 is 1), exact, so bit operations on the raw byte replace an int->float convert.
_BF16_128 = 0x4300


def nibble_tiles(byte: Array, dtype: jnp.dtype) -> tuple[Array, Array]:
    """The low and high nibbles of a byte tile as ``128 + c``, exact in ``dtype`` (bf16 or wider)."""
    wide = byte.astype(jnp.uint16)
    as_bf16 = lambda bits: jax.lax.bitcast_convert_type(bits | _BF16_128, jnp.bfloat16).astype(dtype)  # noqa: E731
    return as_bf16(wide & 0xF), as_bf16(wide >> 4)


def widen_metadata(leaf: Array) -> Array:
    """Bitcast a 2-byte metadata leaf ``[..., n]`` (n even) to u32 pairs ``[..., n/2]`` (free in XLA).

    A column of 2-byte values is a strided 2-byte load that Triton neither vectorizes nor pipelines
    (every loop step of the paged Q4 kernel waited for such loads); a u32 column goes through cp.async.
    """
    if leaf.dtype.itemsize != 2 or leaf.shape[-1] % 2:
        return leaf
    return jax.lax.bitcast_convert_type(leaf.reshape(*leaf.shape[:-1], leaf.shape[-1] // 2, 2), jnp.uint32)


def metadata_column(ref: jax.Ref, index: Array | int, dtype: jnp.dtype) -> Array:
    """Column ``index`` (traced or static) of a ``[rows, n]`` metadata block as f32: ``dtype`` is the leaf's own
    (a 2-byte leaf arrives widened by :func:`widen_metadata`, two columns per u32 word)."""
    if ref.dtype != jnp.uint32 or jnp.dtype(dtype).itemsize != 2:
        return ref[:, index].astype(jnp.float32)
    word = ref[:, index >> 1]
    bits = (word >> ((index & 1) * 16)) & 0xFFFF  # shifts, not a select or a division: a traced index lowers too
    if jnp.dtype(dtype) == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(bits << 16, jnp.float32)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype).astype(jnp.float32)
