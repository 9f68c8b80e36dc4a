"""Tile helpers for kernels written against the Pallas Triton backend (also run by the CPU interpreter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Bool, Float, Int

from zgen.numerics import matmul_precision
from zgen.pallas.common import RUNNING_MAX_INIT, base2_logits
from zgen.rope import rope_cos_sin

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


def rope_table(
    positions: Int[Array, " b"], inv_freq: Float[Array, " half"] | None, head_dim: int
) -> Float[Array, "b 2 d"]:
    """Each row's rotation at its position as full-width cosines and signed sines ``[b, 2, D]``
    (rotate-half: lane ``i`` pairs with lane ``i + D/2``), what :func:`load_rotated` takes; the
    identity without ``inv_freq``."""
    b = positions.shape[0]
    if inv_freq is None:
        cos, sin = jnp.ones((b, head_dim // 2), jnp.float32), jnp.zeros((b, head_dim // 2), jnp.float32)
    else:
        cos, sin = rope_cos_sin(positions, inv_freq)
    return jnp.stack([jnp.concatenate([cos, cos], -1), jnp.concatenate([-sin, sin], -1)], axis=1)


def load_rotated(heads_ref: jax.Ref, head_rows: Array, rope_ref: jax.Ref, mask: Array | None = None) -> Array:
    """Rows ``head_rows`` of a ``[heads, D]`` block after RoPE (a row of :func:`rope_table` in
    ``rope_ref`` ``[2, D]``), in f32 like :func:`zgen.rope.apply_rope`, then rounded to the heads'
    dtype; the partner lanes come from a second, permuted load. ``mask``: rows to load (others 0)."""
    d = heads_ref.shape[-1]
    lanes = jnp.arange(d)[None, :]
    cos, sin = rope_ref[0, :][None, :], rope_ref[1, :][None, :]
    masked = {} if mask is None else {"mask": mask, "other": 0.0}
    x = pltriton.load(heads_ref.at[head_rows[:, None], lanes], **masked).astype(jnp.float32)
    partner = pltriton.load(heads_ref.at[head_rows[:, None], (lanes + d // 2) % d], **masked)
    return (x * cos + partner.astype(jnp.float32) * sin).astype(heads_ref.dtype)


def own_key_carry(
    q: Float[Array, "rows d"], k_new: Float[Array, "1 d"], v_new: Float[Array, "1 d"], first: Bool[Array, " rows"],
    *, scale: float, soft_cap: float | None,
) -> tuple[Float[Array, " rows"], Float[Array, " rows"], Float[Array, "rows d"]]:
    """The online softmax's starting carry ``(max, sum, acc)`` of an appending decode step (the max in
    base-2 units, :func:`~zgen.pallas.common.base2_logits`): rows in ``first`` start from the token's
    own key (always visible to itself, held in registers, so no program waits for its write), the
    others from nothing."""
    own = base2_logits(jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32), axis=-1), scale, soft_cap)
    rows = q.shape[0]
    return (
        jnp.where(first, own, RUNNING_MAX_INIT),
        jnp.where(first, 1.0, 0.0),
        jnp.where(first[:, None], jnp.broadcast_to(v_new.astype(jnp.float32), (rows, q.shape[1])), 0.0),
    )
