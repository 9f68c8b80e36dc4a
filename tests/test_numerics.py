"""float32 matmuls ask XLA for HIGHEST precision (GPUs would otherwise run them in TF32); bf16 ones keep DEFAULT."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from zgen.cache.compressed import masked_attention
from zgen.cache.tensor import causal_attention
from zgen.graph.core import linear
from zgen.numerics import matmul_precision
from zgen.pallas.flash_attention.xla import flash_attention

HIGHEST, DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT


def dot_precisions(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """The ``precision`` param of every dot_general in ``fn``'s jaxpr, sub-jaxprs (loops, maps) included."""

    def walk(jaxpr: Any) -> Iterator[Any]:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn.params["precision"]
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple) else (value,):
                    if hasattr(sub, "eqns"):
                        yield from walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        yield from walk(sub.jaxpr)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_matmul_precision() -> None:
    assert matmul_precision(jnp.float32) is HIGHEST
    assert matmul_precision(jnp.float64) is HIGHEST
    assert matmul_precision(jnp.bfloat16, jnp.float32) is HIGHEST
    assert matmul_precision(jnp.bfloat16) is DEFAULT
    assert matmul_precision(jnp.float16, jnp.bfloat16) is DEFAULT
    assert matmul_precision(jnp.int8) is DEFAULT


@pytest.mark.parametrize(("dtype", "expected"), [(jnp.float32, HIGHEST), (jnp.bfloat16, DEFAULT)])
def test_linear_precision(dtype: Any, expected: jax.lax.Precision) -> None:
    x, weight = jnp.ones((2, 3, 16), dtype), jnp.ones((8, 16), dtype)
    assert dot_precisions(linear, x, weight) == [(expected, expected)]


def test_linear_mixed_inputs_take_highest() -> None:
    x, weight = jnp.ones((2, 3, 16), jnp.bfloat16), jnp.ones((8, 16), jnp.float32)
    assert dot_precisions(linear, x, weight) == [(HIGHEST, HIGHEST)]


@pytest.mark.parametrize(("dtype", "expected"), [(jnp.float32, HIGHEST), (jnp.bfloat16, DEFAULT)])
def test_attention_precision(dtype: Any, expected: jax.lax.Precision) -> None:
    b, t, s, h, kvh, d = 1, 3, 5, 4, 2, 8
    q, k, v = jnp.ones((b, t, h, d), dtype), jnp.ones((b, s, kvh, d), dtype), jnp.ones((b, s, kvh, d), dtype)
    positions = jnp.arange(t)[None] + s - t
    both = [(expected, expected)] * 2
    assert dot_precisions(lambda *a: causal_attention(*a, sliding_window=None), q, k, v, positions) == both
    assert dot_precisions(masked_attention, q, k, v, jnp.ones((b, t, s), bool)) == both

    def flash(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        lengths = jnp.full((b,), s)
        return flash_attention(
            q, k, v, lengths, q_positions=positions, causal=True, sliding_window=None, soft_cap=None, scale=d**-0.5
        )

    assert dot_precisions(flash, q, k, v) == both
