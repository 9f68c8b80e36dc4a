"""MaskedPagedState: the paged kernel path (page masks only) equals the dense masked path, for every
storage format -- coded ones included, whose keys the kernel reads through the coding."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.cache.paged_state import MaskedPagedState, PagedKVState
from zgen.pallas.paged_attention.layouts import KeyCalibration

B, KVH, H, D, PS, CAP = 2, 2, 4, 16, 4, 24


def _rand(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@partial(jax.jit, static_argnums=3)
def _attend(state: MaskedPagedState, q: jax.Array, pos: jax.Array, window: int | None) -> jax.Array:
    return state.attend(0, q, pos, sliding_window=window)


def _calibration() -> KeyCalibration:
    rng = np.random.default_rng(7)
    center, sink = (jnp.asarray(rng.standard_normal((KVH, D)), jnp.float32) for _ in range(2))
    scale = jnp.asarray(rng.uniform(0.5, 2, (KVH, D)), jnp.float32)
    return KeyCalibration(center, sink, scale, jnp.asarray(10_000.0 ** (-np.arange(0, D, 2) / D), jnp.float32))


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8", "q4", "q3"])
@pytest.mark.parametrize("num_queries", [1, 5])
def test_page_masked_kernel_path_equals_the_dense_masked_path(kv_dtype: str, num_queries: int) -> None:
    pages = PagedKVState.contiguous(1, B, CAP, KVH, D, kv_dtype=kv_dtype, page_size=PS, key_calibration=[_calibration()])
    n = 20
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
    pages = jax.jit(lambda s, k, v, p: s.write(0, k, v, p))(pages, _rand(0, B, n, KVH, D), _rand(1, B, n, KVH, D), pos)
    page_mask = jnp.asarray([[True, False, True, True, False, True], [False, True, True, False, True, True]])
    q_pos = pos[:, n - num_queries :]
    q = _rand(2, B, num_queries, H, D)
    kernel = MaskedPagedState(pages, page_mask=page_mask)
    # The same visibility spelled as a token mask forces the dense path.
    dense = MaskedPagedState(pages, page_mask=page_mask, token_mask=jnp.repeat(page_mask, PS, axis=1))
    for window in (None, 7):
        got = _attend(kernel, q, q_pos, window)
        expected = _attend(dense, q, q_pos, window)
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)
