"""The residual add + RMS norm fused into the projection that reads the norm (the kernel interpreted
on CPU, compiled on GPUs) against the graph's own XLA form: the residual stream to the last bit, the
projection within what one rounding of the norm and the summation order can move it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zgen import numerics
from zgen.errors import ConfigError
from zgen.pallas.norm_linear import add_rms_norm_linear
from zgen.pallas.norm_linear.api import reference

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
Case = tuple[jax.Array, jax.Array | None, jax.Array, float, jax.Array, int]


@st.composite
def norm_linear_cases(draw: st.DrawFn) -> Case:
    """A decode step's rows (1 to 4, as ``[B, 1, E]`` or ``[1, B, E]``), input widths that are
    and are not a power of two (SmolLM2's 576, SmolLM2-360M's 960), a residual add or a plain norm
    (a model's first layer), and output blocks of 8 to 64 columns."""
    rows = draw(st.integers(1, 4))
    size = draw(st.sampled_from([16, 48, 64, 576, 960]))
    block_n = draw(st.sampled_from([8, 16, 64]))
    out = block_n * draw(st.integers(1, 3))
    shape = (rows, 1, size) if draw(st.booleans()) else (1, rows, size)
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = jnp.asarray(rng.standard_normal(shape) * draw(st.sampled_from([1.0, 30.0])), dtype)
    delta = jnp.asarray(rng.standard_normal(shape), dtype) if draw(st.booleans()) else None
    norm_weight = jnp.asarray(rng.standard_normal(size), dtype)
    weight = jnp.asarray(rng.standard_normal((out, size)) * size**-0.5, dtype)
    return x, delta, norm_weight, draw(st.sampled_from([1e-5, 1e-6])), weight, block_n


def test_triton_matches_the_graphs_norm_and_projection() -> None:
    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(norm_linear_cases())
    def check(case: Case) -> None:
        x, delta, norm_weight, eps, weight, block_n = case
        total, projected = jax.jit(
            lambda x, d, n, w: add_rms_norm_linear(x, d, n, eps, w, implementation="triton", block_n=block_n)
        )(x, delta, norm_weight, weight)
        want_total, want = reference(x, delta, norm_weight, eps, weight)
        if delta is None:
            assert total is None
        else:
            assert total is not None and want_total is not None
            np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(want_total, np.float32))
        # The norm may round the other way (its sum of squares is added in another order) and the
        # products are summed in another order: bounded by a rounding of every term and of the result.
        normed = numerics.rms_norm(x if want_total is None else want_total, norm_weight, eps)
        magnitude = np.abs(np.asarray(normed, np.float32)) @ np.abs(np.asarray(weight, np.float32)).T
        ulp = 2.0**-7 if x.dtype == jnp.bfloat16 else 2.0**-20
        got, wanted = np.asarray(projected, np.float32), np.asarray(want, np.float32)
        assert got.shape == wanted.shape
        assert np.all(np.abs(got - wanted) <= ulp * (magnitude + np.abs(wanted)))

    check()


@pytest.mark.parametrize("residual", [True, False], ids=["add", "plain-norm"])
def test_the_kernels_gradient_is_the_graphs(residual: bool) -> None:
    """Training through the graph (an EAGLE head) differentiates the kernel: with :func:`reference`'s gradient."""
    rng = np.random.default_rng(4)
    x, delta = (jnp.asarray(rng.standard_normal((2, 1, 64)), jnp.float32) for _ in range(2))
    norm_weight, weight = jnp.asarray(rng.standard_normal(64), jnp.float32), jnp.asarray(rng.standard_normal((16, 64)) / 8, jnp.float32)

    def grads(implementation: str) -> tuple[jax.Array, ...]:
        def loss(x: jax.Array, delta: jax.Array, norm_weight: jax.Array, weight: jax.Array) -> jax.Array:
            total, projected = add_rms_norm_linear(x, delta if residual else None, norm_weight, 1e-5, weight, implementation=implementation)
            return jnp.sum(projected**2) + (jnp.sum(total * x) if total is not None else 0.0)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, delta, norm_weight, weight)

    for got, want in zip(grads("triton"), grads("xla"), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_shapes_the_kernel_does_not_take_are_refused_or_left_to_xla() -> None:
    x = jnp.zeros((5, 1, 64), jnp.float32)
    weight = jnp.zeros((32, 64), jnp.float32)
    with pytest.raises(ConfigError, match="at most 4 rows"):
        add_rms_norm_linear(x, x, jnp.ones(64), 1e-5, weight, implementation="triton")
    with pytest.raises(ConfigError, match="at most 4 rows of at most 1024 values"):
        wide = jnp.zeros((1, 1, 2048), jnp.float32)
        add_rms_norm_linear(wide, wide, jnp.ones(2048), 1e-5, jnp.zeros((32, 2048)), implementation="triton")
    with pytest.raises(ConfigError, match="divisible by its block"):
        add_rms_norm_linear(x[:1], x[:1], jnp.ones(64), 1e-5, jnp.zeros((12, 64)), implementation="triton")
    total, projected = add_rms_norm_linear(x, x, jnp.ones(64), 1e-5, weight)  # None: XLA here
    assert total is not None and total.shape == x.shape and projected.shape == (5, 1, 32)


def test_mismatched_operands_are_refused() -> None:
    x = jnp.zeros((1, 1, 64), jnp.float32)
    with pytest.raises(ConfigError, match="one shape and dtype"):
        add_rms_norm_linear(x, x.astype(jnp.bfloat16), jnp.ones(64), 1e-5, jnp.zeros((16, 64)))
    with pytest.raises(ConfigError, match=r"a weight \[out, 64\]"):
        add_rms_norm_linear(x, x, jnp.ones(64), 1e-5, jnp.zeros((16, 32)))
    with pytest.raises(ConfigError, match="unknown add_rms_norm_linear implementation"):
        add_rms_norm_linear(x, x, jnp.ones(64), 1e-5, jnp.zeros((16, 64)), implementation="cuda")
