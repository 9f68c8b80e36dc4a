"""``add_rms_norm`` as a Pallas kernel on the Triton backend: one program per row (token), the whole
row in registers, both results stored from them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from zgen.shapes import next_pow2


def _kernel(
    x_ref: jax.Ref, delta_ref: jax.Ref, weight_ref: jax.Ref, total_ref: jax.Ref, normed_ref: jax.Ref, *, size: int, eps: float
) -> None:
    # A row is padded to a power of two (Triton's tile sizes): the lanes past ``size`` load zeros
    # and store nothing.
    inside = jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 1) < size
    x = pltriton.load(x_ref.at[...], mask=inside, other=0.0).astype(jnp.float32)
    delta = pltriton.load(delta_ref.at[...], mask=inside, other=0.0).astype(jnp.float32)
    weight = pltriton.load(weight_ref.at[...], mask=inside, other=0.0).astype(jnp.float32)
    total = (x + delta).astype(total_ref.dtype)  # the residual stream, rounded as XLA's add rounds it
    total32 = total.astype(jnp.float32)
    mean_square = jnp.sum(total32 * total32, axis=1, keepdims=True) / size
    normed = (total32 * jax.lax.rsqrt(mean_square + eps)).astype(normed_ref.dtype)
    pltriton.store(total_ref.at[...], total, mask=inside)
    pltriton.store(normed_ref.at[...], (normed.astype(jnp.float32) * weight).astype(normed_ref.dtype), mask=inside)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(
    x: Float[Array, "*rows size"], delta: Float[Array, "*rows size"], weight: Float[Array, " size"], eps: float, *, interpret: bool = False
) -> tuple[Float[Array, "*rows size"], Float[Array, "*rows size"]]:
    size = x.shape[-1]
    rows = x.reshape(-1, size)
    width = next_pow2(size)
    row_spec = pl.BlockSpec((1, width), lambda i: (i, 0))
    total, normed = pl.pallas_call(
        functools.partial(_kernel, size=size, eps=eps),
        grid=(rows.shape[0],),
        in_specs=[row_spec, row_spec, pl.BlockSpec((1, width), lambda i: (0, 0))],
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct(rows.shape, x.dtype)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=min(max(width // 256, 1), 8), num_stages=1),
        interpret=interpret,
        name="zgen_add_rms_norm",
    )(rows, delta.reshape(-1, size), weight.reshape(1, size))
    return total.reshape(x.shape), normed.reshape(x.shape)
