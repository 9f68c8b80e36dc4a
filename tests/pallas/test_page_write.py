"""The page write (the kernels interpreted on CPU, compiled on GPUs) against the XLA forms they
replace: every stored byte equal (the coded q4 write within its rounding, see ``write_kv``), the other
slots untouched, out-of-range pages dropped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zgen.cache.formats import kv_format
from zgen.errors import ConfigError
from zgen.pallas import store_tokens
from zgen.pallas.page_write import write_kv
from zgen.pallas.page_write.api import scatter_tokens
from zgen.pallas.paged_attention.layouts import KeyCalibration, Q4Pages, float_pages

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


@st.composite
def layer_writes(draw: st.DrawFn) -> dict[str, object]:
    """A layer's write: pools of one format with old contents, K/V for distinct slots (some dropped), a coding."""
    fmt = kv_format(draw(st.sampled_from(["fp32", "bf16", "fp16", "fp8", "q4"])))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    kvh, pages, page_size = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.sampled_from([4, 16]))
    b, t = draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 9]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    slots = rng.permutation(pages * page_size)[: b * t]
    slots = np.concatenate([slots, np.full(b * t - len(slots), -1)]).reshape(b, t)
    page = np.where((rng.random((b, t)) < 0.25) | (slots < 0), rng.choice([-1, pages], (b, t)), slots // page_size)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    old = fmt.quantize(normal(kvh, pages, page_size, head_dim) * 3)
    coding = None
    if fmt.coded:
        pair_scale = jnp.asarray(np.tile(rng.uniform(0.5, 2.0, (kvh, head_dim // 2)), 2), jnp.float32)
        inv_freq = jnp.asarray(10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim), jnp.float32)
        coding = KeyCalibration(center=normal(kvh, head_dim), sink=normal(kvh, head_dim) * 4, scale=pair_scale, inv_freq=inv_freq)
    return {
        "pools": (old, jax.tree_util.tree_map(lambda x: x, old)),
        "k": (normal(b, t, kvh, head_dim) * 3).astype(jnp.bfloat16),
        "v": normal(b, t, kvh, head_dim).astype(jnp.bfloat16),
        "page": jnp.asarray(page, jnp.int32),
        "offset": jnp.asarray(np.maximum(slots, 0) % page_size, jnp.int32),
        "positions": jnp.asarray(rng.integers(0, 3, (b, t)) * rng.integers(0, 500, (b, t)), jnp.int32),  # position 0 (the sink) often
        "quantize": fmt.quantize,
        "coding": coding,
    }


def _assert_same_pages(got: object, want: object) -> None:
    """Bit-equal leaves; coded q4 pages (rotated by dots, not the butterfly) within one code step."""
    if isinstance(want, Q4Pages):
        assert isinstance(got, Q4Pages)
        step = np.repeat(np.asarray(want.scale, np.float32), want.head_dim // want.scale.shape[-1], axis=-1)
        np.testing.assert_array_less(np.abs(np.asarray(got.dequantize(jnp.float32)) - np.asarray(want.dequantize(jnp.float32))), 1.01 * step + 1e-6)
        assert np.mean(np.asarray(got.packed) != np.asarray(want.packed)) <= 0.01
        return
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(as_bits(g), as_bits(w))


def test_write_kv_kernel_matches_the_reference() -> None:
    @settings(max_examples=16, deadline=None, derandomize=True)
    @given(layer_writes())
    def check(case: dict[str, object]) -> None:
        def write(implementation: str) -> tuple[object, object]:
            k_pool, v_pool = case["pools"]  # type: ignore[misc]
            return write_kv(
                k_pool, v_pool, case["k"], case["v"], case["page"], case["offset"], case["positions"],  # type: ignore[arg-type]
                quantize=case["quantize"], key_coding=case["coding"], implementation=implementation,  # type: ignore[arg-type]
            )

        want, got = write("reference"), jax.jit(lambda: write("triton"))()
        for g, w in zip(got, want, strict=True):
            _assert_same_pages(float_pages(g), float_pages(w))

    check()


def test_write_kv_refuses_what_its_kernel_cannot_store() -> None:
    fmt = kv_format("q3")
    pool = fmt.empty((1, 2, 4), 64)
    tokens = jnp.zeros((1, 1, 1, 64), jnp.bfloat16)
    zeros = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ConfigError, match="fp8 and q4 pages, not Q3Pages"):
        write_kv(pool, pool, tokens, tokens, zeros, zeros, zeros, quantize=fmt.quantize, implementation="triton")
    plain = jnp.zeros((1, 2, 4, 48), jnp.bfloat16)
    odd = jnp.zeros((1, 1, 1, 48), jnp.bfloat16)
    with pytest.raises(ConfigError, match="power-of-two head_dim, got 48"):
        write_kv(plain, plain, odd, odd, zeros, zeros, zeros, quantize=lambda x: x, implementation="triton")


def test_write_kv_refuses_mismatched_operands() -> None:
    fmt = kv_format("bf16")
    pool = fmt.empty((2, 3, 4), 8)
    zeros = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ConfigError, match="the pools' 2 kv heads"):
        three_heads = jnp.zeros((1, 2, 3, 8), jnp.bfloat16)
        write_kv(pool, pool, three_heads, three_heads, zeros, zeros, zeros, quantize=fmt.quantize)
    with pytest.raises(ConfigError, match="page/offset/positions"):
        tokens = jnp.zeros((1, 2, 2, 8), jnp.bfloat16)
        write_kv(pool, pool, tokens, tokens, zeros, zeros, jnp.zeros((2, 1), jnp.int32), quantize=fmt.quantize)


@pytest.mark.parametrize("fmt_name", ["fp8", "q4"])
def test_write_kv_kernel_codes_each_token_alone(fmt_name: str) -> None:
    """A token's stored bytes do not depend on the tokens written beside it (a cache must not depend
    on how its tokens were batched: verification passes, chunks and decode steps write the same)."""
    fmt = kv_format(fmt_name)
    rng = np.random.default_rng(7)
    kvh, d, t = 2, 64, 9
    pool = fmt.empty((kvh, 2, 16), d)
    k = jnp.asarray(rng.standard_normal((1, t, kvh, d)) * 3, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, t, kvh, d)), jnp.bfloat16)
    positions = jnp.arange(t, dtype=jnp.int32)[None] * 37
    page, offset = positions * 0 + 1, jnp.arange(t, dtype=jnp.int32)[None] + 3
    coding = KeyCalibration(
        center=jnp.asarray(rng.standard_normal((kvh, d)), jnp.float32),
        sink=jnp.zeros((kvh, d), jnp.float32),
        scale=jnp.ones((kvh, d), jnp.float32),
        inv_freq=jnp.asarray(10000.0 ** (-np.arange(d // 2) * 2 / d), jnp.float32),
    ) if fmt.coded else None
    write = jax.jit(lambda kp, vp, k, v, page, offset, pos: write_kv(
        kp, vp, k, v, page, offset, pos, quantize=fmt.quantize, key_coding=coding, implementation="triton"
    ))
    together = write(pool, pool, k, v, page, offset, positions)
    alone = (pool, pool)
    for i in range(t):
        cut = slice(i, i + 1)
        alone = write(*alone, k[:, cut], v[:, cut], page[:, cut], offset[:, cut], positions[:, cut])
    for got, want in zip(jax.tree_util.tree_leaves(alone), jax.tree_util.tree_leaves(together), strict=True):
        np.testing.assert_array_equal(as_bits(got), as_bits(want))
