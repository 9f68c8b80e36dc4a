from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from pallas_cases import FlashCase, assert_close, flash_cases

from zgen.pallas import flash_attention
from zgen.pallas.flash_attention import triton, xla

IMPLEMENTATIONS = {"xla": 10, "triton": 5}


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_matches_reference(implementation: str) -> None:
    @settings(max_examples=IMPLEMENTATIONS[implementation], deadline=None, derandomize=True)
    @given(flash_cases())
    def check(case: FlashCase) -> None:
        assert_close(case.run(implementation), case.run("reference"), case.dtype)

    check()


SMALL_BLOCKS = {"xla": (xla.flash_attention, {}), "triton": (triton.flash_attention, {"interpret": True})}


@pytest.mark.parametrize("implementation", sorted(SMALL_BLOCKS))
def test_small_blocks_match_reference(implementation: str) -> None:
    """Several query and key blocks, so the block loop bounds (causal, window, lengths) are exercised."""

    @settings(max_examples=6, deadline=None, derandomize=True)
    @given(flash_cases(max_len=70))
    def check(case: FlashCase) -> None:
        b, _, h, d = case.q.shape
        lengths = case.lengths if case.lengths is not None else jnp.full((b,), case.k.shape[1], jnp.int32)
        impl, extra = SMALL_BLOCKS[implementation]
        fn = functools.partial(
            impl, causal=case.causal, sliding_window=case.sliding_window,
            soft_cap=case.soft_cap, scale=d**-0.5, block_q=16, block_k=32, **extra,
        )
        assert_close(jax.jit(fn)(case.q, case.k, case.v, lengths), case.run("reference"), case.dtype)

    check()


def test_reference_is_causal_softmax_attention() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 9, 2, 64)), jnp.float32) for _ in range(3))
    out = flash_attention(q, k, v, implementation="reference")
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    logits = jnp.where(jnp.tril(jnp.ones((9, 9), bool)), logits, -jnp.inf)
    expected = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_padded_queries_are_zero() -> None:
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 12, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 12, 2, 64)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([12, 5], jnp.int32)
    for impl in ("reference", "xla", "triton"):
        out = flash_attention(q, k, v, lengths=lengths, implementation=impl)
        assert np.all(np.asarray(out[1, 5:]) == 0)
        # The valid prefix does not depend on what sits in the padding.
        out2 = flash_attention(q, k.at[1, 5:].set(1e3), v.at[1, 5:].set(1e3), lengths=lengths, implementation=impl)
        np.testing.assert_allclose(out2[1, :5], out[1, :5], atol=1e-5)


def test_mosaic_gpu_covers_only_plain_causal_float16() -> None:
    """jax's Hopper kernel (GPU-only; checked by benchmarks/kernels.py --check-only) is picked only where it fits.

    Its shared-memory tiles are float16 whatever the inputs, so bf16 must go to Triton.
    """
    from zgen.pallas.flash_attention import mosaic_gpu

    q = jnp.zeros((1, 8, 4, 128), jnp.float16)
    k = jnp.zeros((1, 8, 2, 128), jnp.float16)
    assert mosaic_gpu.supports(q, k, causal=True, sliding_window=None, soft_cap=None)
    assert not mosaic_gpu.supports(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), causal=True, sliding_window=None, soft_cap=None)
    assert not mosaic_gpu.supports(q, k, causal=False, sliding_window=None, soft_cap=None)
    assert not mosaic_gpu.supports(q, k, causal=True, sliding_window=4, soft_cap=None)
    assert not mosaic_gpu.supports(q.astype(jnp.float32), k, causal=True, sliding_window=None, soft_cap=None)
    assert not mosaic_gpu.supports(q[..., :32], k[..., :32], causal=True, sliding_window=None, soft_cap=None)
