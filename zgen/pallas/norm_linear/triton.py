"""``add_rms_norm_linear`` as a Pallas kernel on the Triton backend, for a decode step's few rows of
a model whose rows are at most :data:`MAX_WIDTH` wide (SmolLM2's 576).

Grid: one program per block of ``block_n`` output columns. Each program loads its whole ``[block_n,
K]`` slice of the weight in one go (issued first: every byte in flight at once; a first form that
looped over chunks waited for each chunk in turn, four times slower), then per row the residual sum
and its RMS norm from the whole row (a few KB, from L2 for all but the first program), and the
row's products with the slice on the CUDA cores (a tensor-core dot would pad one row to 16). The
norm never goes through memory and the projection has no launch of its own. The first program also
stores the residual sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from zgen.shapes import next_pow2

# Rows the kernel takes (one product tile each).
MAX_ROWS = 4
# The widest row: a program holds its weight slice, padded to a power of two, in registers.
MAX_WIDTH = 1024


def _kernel(
    x_ref: jax.Ref,
    delta_ref: jax.Ref | None,
    norm_ref: jax.Ref,
    weight_ref: jax.Ref,
    total_ref: jax.Ref | None,
    out_ref: jax.Ref,
    *,
    size: int,
    eps: float,
) -> None:
    # Rows are padded to a power of two (Triton's tile sizes): lanes past ``size`` load zeros and
    # store nothing.
    inside = jax.lax.broadcasted_iota(jnp.int32, (1, norm_ref.shape[1]), 1) < size
    weight = pltriton.load(weight_ref.at[...], mask=inside, other=0.0).astype(jnp.float32)  # [block_n, width]
    norm_weight = pltriton.load(norm_ref.at[...], mask=inside, other=0.0).astype(jnp.float32)
    dtype = x_ref.dtype
    for row in range(x_ref.shape[0]):
        at = (pl.ds(row, 1), slice(None))
        total = pltriton.load(x_ref.at[at], mask=inside, other=0.0).astype(jnp.float32)
        if delta_ref is not None:
            delta = pltriton.load(delta_ref.at[at], mask=inside, other=0.0).astype(jnp.float32)
            total = (total + delta).astype(dtype).astype(jnp.float32)  # rounded as XLA's add rounds it
        if total_ref is not None:
            pltriton.store(total_ref.at[at], total.astype(dtype), mask=inside & (pl.program_id(0) == 0))
        inv_rms = jax.lax.rsqrt(jnp.sum(total * total) / size + eps)
        normed = (total * inv_rms).astype(dtype).astype(jnp.float32) * norm_weight
        normed = normed.astype(dtype).astype(jnp.float32)  # [1, width], as the graph's norm rounds it
        out_ref[at] = jnp.sum(weight * normed, axis=1)[None, :].astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "block_n", "num_warps", "interpret"))
def add_rms_norm_linear(
    x: Float[Array, "rows size"],
    delta: Float[Array, "rows size"] | None,
    norm_weight: Float[Array, " size"],
    eps: float,
    weight: Float[Array, "out size"],
    *,
    block_n: int,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[Float[Array, "rows size"] | None, Float[Array, "rows out"]]:
    rows, size = x.shape
    out_size = weight.shape[0]
    width = next_pow2(size)
    row_spec = pl.BlockSpec((rows, width), lambda j: (0, 0))
    activations = [x] if delta is None else [x, delta]
    projected = jax.ShapeDtypeStruct((rows, out_size), jnp.result_type(x.dtype, weight.dtype))
    out_shapes = [projected] if delta is None else [jax.ShapeDtypeStruct(x.shape, x.dtype), projected]
    out_spec = pl.BlockSpec((rows, block_n), lambda j: (0, j))

    def kernel(*refs: jax.Ref) -> None:
        if delta is None:
            x_ref, norm_ref, weight_ref, out_ref = refs
            _kernel(x_ref, None, norm_ref, weight_ref, None, out_ref, size=size, eps=eps)
        else:
            _kernel(*refs, size=size, eps=eps)

    results = pl.pallas_call(
        kernel,
        grid=(out_size // block_n,),
        in_specs=[
            *[row_spec] * len(activations),
            pl.BlockSpec((1, width), lambda j: (0, 0)),
            pl.BlockSpec((block_n, width), lambda j: (j, 0)),
        ],
        out_specs=[out_spec] if delta is None else [row_spec, out_spec],
        out_shape=out_shapes,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="zgen_add_rms_norm_linear",
    )(*activations, norm_weight.reshape(1, size), weight)
    if delta is None:
        return None, results[0]
    return results[0], results[1]
