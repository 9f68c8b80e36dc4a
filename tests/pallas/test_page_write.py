"""The page write (the kernel interpreted on CPU, compiled on GPUs) against the scatter it replaces:
every stored byte equal, the other slots untouched, out-of-range pages dropped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zgen.errors import ConfigError
from zgen.pallas import store_tokens
from zgen.pallas.page_write.api import scatter_tokens

# The leaves page layouts store: activations, fp8 codes, q4 nibbles / q3 planes, CPU bit containers.
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "u8": jnp.uint8, "u16": jnp.uint16}


def as_bits(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


@st.composite
def write_cases(draw: st.DrawFn) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A pool, tokens for distinct slots, and pages some of which are out of range (padding rows)."""
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    kvh, pages, page_size = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.sampled_from([1, 4, 16]))
    rest = draw(st.sampled_from([(1,), (4,), (16,), (2, 8)]))  # Triton tiles: powers of two
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    slots = rng.permutation(pages * page_size)[: b * t]
    slots = np.concatenate([slots, np.full(b * t - len(slots), -1)]).reshape(b, t)
    page, offset = slots // page_size, np.maximum(slots, 0) % page_size
    dropped = rng.random((b, t)) < 0.3
    page = np.where(dropped | (slots < 0), rng.choice([-1, pages, pages + 3], (b, t)), page)

    def values(shape: tuple[int, ...]) -> jax.Array:
        if jnp.issubdtype(dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 200, shape), dtype)
        return jnp.asarray(rng.standard_normal(shape) * 8, jnp.float32).astype(dtype)

    pool = values((kvh, pages, page_size, *rest))
    return pool, values((b, t, kvh, *rest)), jnp.asarray(page, jnp.int32), jnp.asarray(offset, jnp.int32)


def test_triton_matches_the_scatter() -> None:
    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(write_cases())
    def check(case: tuple[jax.Array, jax.Array, jax.Array, jax.Array]) -> None:
        pool, tokens, page, offset = case
        want = scatter_tokens(pool, tokens, page, offset)
        got = jax.jit(lambda *a: store_tokens(*a, implementation="triton"))(pool, tokens, page, offset)
        assert got.dtype == pool.dtype and got.shape == pool.shape
        np.testing.assert_array_equal(as_bits(got), as_bits(want))

    check()


def test_out_of_range_pages_write_nothing() -> None:
    pool = jnp.arange(2 * 3 * 2 * 4, dtype=jnp.float32).reshape(2, 3, 2, 4)
    tokens = -jnp.ones((1, 3, 2, 4), jnp.float32)
    page, offset = jnp.asarray([[-1, 3, 1]], jnp.int32), jnp.asarray([[0, 1, 1]], jnp.int32)
    for implementation in ("xla", "triton"):
        got = np.asarray(store_tokens(pool, tokens, page, offset, implementation=implementation))
        want = np.asarray(pool).copy()
        want[:, 1, 1] = -1  # the one token in range
        np.testing.assert_array_equal(got, want)


def test_mismatched_operands_are_refused() -> None:
    pool = jnp.zeros((2, 3, 4, 8), jnp.bfloat16)
    page = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ConfigError, match="matching the pool"):
        store_tokens(pool, jnp.zeros((1, 2, 2, 16), jnp.bfloat16), page, page)
    with pytest.raises(ConfigError, match="page/offset"):
        store_tokens(pool, jnp.zeros((1, 2, 2, 8), jnp.bfloat16), page, jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ConfigError, match="power-of-two number of elements"):
        store_tokens(jnp.zeros((2, 3, 4, 3, 4), jnp.uint8), jnp.zeros((1, 2, 2, 3, 4), jnp.uint8), page, page, implementation="triton")
    with pytest.raises(ConfigError, match="unknown store_tokens implementation"):
        store_tokens(pool, jnp.zeros((1, 2, 2, 8), jnp.bfloat16), page, page, implementation="cuda")  # type: ignore[arg-type]
