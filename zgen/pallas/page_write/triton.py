"""``store_tokens`` as a Pallas kernel on the Triton backend: one program per (token, kv head) copies
that head's slab of the token (a power of two elements) into its slot of the pool, which is the
kernel's output buffer too (aliased: the pool is updated in place, the other slots are untouched)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Int, Shaped


def _kernel(slots_ref: jax.Ref, tokens_ref: jax.Ref, pool_ref: jax.Ref, out_ref: jax.Ref) -> None:
    del pool_ref  # the same buffer as out_ref
    token, head = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[token]

    @pl.when(slot >= 0)
    def _() -> None:
        out_ref[head, slot, :] = tokens_ref[token, head, :]


@functools.partial(jax.jit, static_argnames=("interpret",))
def store_tokens(
    pool: Shaped[Array, "kvh pages page_size *rest"],
    tokens: Shaped[Array, "b t kvh *rest"],
    page: Int[Array, "b t"],
    offset: Int[Array, "b t"],
    *,
    interpret: bool = False,
) -> Shaped[Array, "kvh pages page_size *rest"]:
    kvh, pages, page_size = pool.shape[:3]
    slab = math.prod(pool.shape[3:])
    # Float8 goes through its bits (a uint8 view), which Triton stores like any byte.
    storage = jnp.uint8 if jnp.issubdtype(pool.dtype, jnp.floating) and pool.dtype.itemsize == 1 else pool.dtype
    flat_pool = jax.lax.bitcast_convert_type(pool, storage).reshape(kvh, pages * page_size, slab)
    flat_tokens = jax.lax.bitcast_convert_type(tokens.astype(pool.dtype), storage).reshape(-1, kvh, slab)
    inside = (page >= 0) & (page < pages)
    slots = jnp.where(inside, page * page_size + offset, -1).reshape(-1).astype(jnp.int32)
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, h: (0,) * x.ndim)  # noqa: E731 - programs index slots themselves
    stored = pl.pallas_call(
        _kernel,
        grid=(flat_tokens.shape[0], kvh),
        in_specs=[whole(slots), whole(flat_tokens), whole(flat_pool)],
        out_specs=whole(flat_pool),
        out_shape=jax.ShapeDtypeStruct(flat_pool.shape, storage),
        input_output_aliases={2: 0},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="zgen_store_tokens",
    )(slots, flat_tokens, flat_pool)
    return jax.lax.bitcast_convert_type(stored.reshape(pool.shape), pool.dtype)
