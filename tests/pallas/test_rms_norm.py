"""The fused residual add + RMS norm (the kernel interpreted on CPU, compiled on GPUs) against the
graph's own XLA form: the residual stream to the last bit, the norm within one rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zgen import numerics
from zgen.errors import ConfigError
from zgen.pallas import add_rms_norm

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@st.composite
def norm_cases(draw: st.DrawFn) -> tuple[jax.Array, jax.Array, jax.Array, float]:
    """Rows of any count (a decode step, a prefill chunk) and widths that are and are not a power of
    two (SmolLM2's 576), with large residual streams beside small block outputs."""
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.sampled_from([16, 64, 100, 576])))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = jnp.asarray(rng.standard_normal(shape) * draw(st.sampled_from([1.0, 30.0])), dtype)
    delta = jnp.asarray(rng.standard_normal(shape), dtype)
    weight = jnp.asarray(rng.standard_normal(shape[-1:]), dtype)
    return x, delta, weight, draw(st.sampled_from([1e-5, 1e-6]))


def test_triton_matches_the_graphs_norm() -> None:
    @settings(max_examples=10, deadline=None, derandomize=True)
    @given(norm_cases())
    def check(case: tuple[jax.Array, jax.Array, jax.Array, float]) -> None:
        x, delta, weight, eps = case
        total, normed = jax.jit(lambda *a: add_rms_norm(*a, eps, implementation="triton"))(x, delta, weight)
        want_total, want_normed = numerics.add_rms_norm(x, delta, weight, eps)
        np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(want_total, np.float32))
        # The sum of squares is added in another order: one rounding of the result at most.
        ulp = 2.0**-7 if x.dtype == jnp.bfloat16 else 2.0**-22
        np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32), rtol=ulp, atol=ulp)

    check()


def test_the_kernels_gradient_is_the_graphs() -> None:
    """Training through the graph (an EAGLE head) differentiates the kernel: with the XLA form's gradient."""
    rng = np.random.default_rng(3)
    x, delta = (jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32) for _ in range(2))
    weight, eps = jnp.asarray(rng.standard_normal(64), jnp.float32), 1e-5

    def grads(implementation: str) -> tuple[jax.Array, ...]:
        def loss(*args: jax.Array) -> jax.Array:
            total, normed = add_rms_norm(*args, eps, implementation=implementation)
            return jnp.sum(total * normed[::-1]) + jnp.sum(normed**2)

        return jax.grad(loss, argnums=(0, 1, 2))(x, delta, weight)

    for got, want in zip(grads("triton"), grads("xla"), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_mismatched_operands_are_refused() -> None:
    x = jnp.zeros((1, 2, 8), jnp.float32)
    with pytest.raises(ConfigError, match="one shape and dtype"):
        add_rms_norm(x, x.astype(jnp.bfloat16), jnp.ones(8), 1e-5)
    with pytest.raises(ConfigError, match="weight over their last axis"):
        add_rms_norm(x, x, jnp.ones(4), 1e-5)
    with pytest.raises(ConfigError, match="unknown add_rms_norm implementation"):
        add_rms_norm(x, x, jnp.ones(8), 1e-5, implementation="cuda")
