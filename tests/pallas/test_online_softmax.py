"""The online softmax the kernels share: in natural or base-2 units, tile by tile, it gives the
softmax of the whole row and its log-sum-exp."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from zgen.pallas.common import RUNNING_MAX_INIT, base2_logits, finish_softmax, softmax_rescale


@pytest.mark.parametrize("base2", [False, True])
@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), tiles=st.integers(1, 4), cap=st.sampled_from([None, 5.0]), masked=st.booleans())
def test_tiles_give_the_row_softmax(base2: bool, seed: int, tiles: int, cap: float | None, masked: bool) -> None:
    rng = np.random.default_rng(seed)
    raw = jnp.asarray(rng.standard_normal((3, 8 * tiles)) * 4, jnp.float32)
    scale = 0.3
    natural = raw * scale if cap is None else cap * jnp.tanh(raw * scale / cap)
    keep = jnp.asarray(rng.random(raw.shape) < 0.7) if masked else jnp.ones(raw.shape, bool)
    keep = keep.at[1].set(False)  # a row that sees no key
    logits = base2_logits(raw, scale, cap) if base2 else natural
    logits = jnp.where(keep, logits, -jnp.inf)
    values = jnp.asarray(rng.standard_normal((8 * tiles, 5)), jnp.float32)
    m, l, acc = jnp.full((3,), RUNNING_MAX_INIT), jnp.zeros((3,)), jnp.zeros((3, 5))
    for t in range(tiles):
        cut = slice(8 * t, 8 * (t + 1))
        m, l, p, alpha = softmax_rescale(m, l, logits[:, cut], base2=base2)
        acc = acc * alpha[:, None] + p @ values[cut]
    out, lse = finish_softmax(acc, m, l, base2=base2)
    shown = jnp.where(keep, natural, -jnp.inf)
    want_lse = jnp.where(keep.any(axis=1), jnp.log(jnp.sum(jnp.where(keep, jnp.exp(natural), 0.0), axis=1)), -jnp.inf)
    probs = jnp.where(keep, jnp.exp(shown - want_lse[:, None]), 0.0)
    np.testing.assert_allclose(out, probs @ values, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out[1]) == 0) and lse[1] == -jnp.inf
