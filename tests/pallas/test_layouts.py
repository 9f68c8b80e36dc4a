from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.pallas.paged_attention.layouts import (
    Q3_LEVELS,
    Fp8Pages,
    Q3Pages,
    Q4Pages,
    bytes_per_token,
    dequantize,
    quantize,
    quantize_q4,
    take_pages,
)


def _normal(*shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize(("fmt", "rms", "nbytes"), [("bf16", 0.003, 256), ("fp8", 0.04, 132), ("q4", 0.1, 72), ("q3", 0.2, 64)])
def test_round_trip_error_and_size(fmt: str, rms: float, nbytes: int) -> None:
    x = _normal(2, 3, 16, 128)
    pages = quantize(x, fmt)  # type: ignore[arg-type]
    err = float(jnp.sqrt(jnp.mean((dequantize(pages, jnp.float32) - x) ** 2)))
    assert err < rms
    assert bytes_per_token(pages) == nbytes


def test_q4_split_half_nibbles() -> None:
    x = jnp.tile(jnp.arange(64, dtype=jnp.float32) % 16, (1, 1, 1, 1))  # codes equal the values
    pages = quantize_q4(x, group_size=32)
    assert isinstance(pages, Q4Pages)
    packed = np.asarray(pages.packed)[0, 0, 0]
    codes = np.asarray(jnp.round((x[0, 0, 0] - pages.zero[0, 0, 0].repeat(32)) / pages.scale[0, 0, 0].repeat(32)))
    np.testing.assert_array_equal(packed & 0xF, codes[:32])
    np.testing.assert_array_equal(packed >> 4, codes[32:])


def test_q3_bit_planes_hold_contiguous_dim_blocks() -> None:
    x = _normal(1, 1, 2, 64)
    pages = quantize(x, "q3")
    assert isinstance(pages, Q3Pages)
    codes = np.asarray(pages.codes())[0, 0, 0]
    planes = np.asarray(pages.planes)[0, 0, 0]  # [3, 8]
    for dim in range(64):
        block, j = divmod(dim, 8)
        code = sum(((int(planes[b, j]) >> block) & 1) << b for b in range(3))
        assert code == codes[dim]
    scales = np.repeat(np.asarray(pages.scale, np.float32)[0, 0, 0], pages.group_size)
    np.testing.assert_allclose(dequantize(pages, jnp.float32)[0, 0, 0], np.asarray(Q3_LEVELS, np.float32)[codes] * scales)


def test_fp8_scale_per_token_and_zero_tokens() -> None:
    x = _normal(1, 1, 4, 64).at[0, 0, 1].set(0.0)
    pages = quantize(x, "fp8")
    assert isinstance(pages, Fp8Pages) and pages.scale.shape == (1, 1, 4)
    np.testing.assert_array_equal(dequantize(pages, jnp.float32)[0, 0, 1], 0.0)


def test_layouts_are_pytrees_that_gather_by_page() -> None:
    x = _normal(2, 5, 16, 64)
    for fmt in ("fp8", "q4", "q3"):
        pages = quantize(x, fmt)  # type: ignore[arg-type]
        idx = jnp.asarray([[4, 0], [2, 2]])
        gathered = take_pages(pages, idx)
        assert type(gathered) is type(pages)
        np.testing.assert_array_equal(dequantize(gathered, jnp.float32), dequantize(pages, jnp.float32)[:, idx])
        leaves = jax.tree_util.tree_leaves(jax.jit(lambda p: p)(pages))
        assert len(leaves) == len(jax.tree_util.tree_leaves(pages))


def test_q4_rejects_groups_straddling_halves() -> None:
    with pytest.raises(ValueError):
        quantize_q4(_normal(1, 1, 1, 64), group_size=64)
