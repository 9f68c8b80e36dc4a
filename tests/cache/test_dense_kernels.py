"""The dense cache's kernel path (zgen.pallas.flash_attention, the GPU default) against its einsum path
(the CPU default), on small random models: same logits for prefill chunks after a prefix, for decode
steps and for whole greedy generations. Triton runs in interpret mode here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_reference import save_random_checkpoint, small_configs
from zgen import Generator, SamplingConfig, load_model
from zgen.cache.factory import dense_attention
from zgen.cache.tensor import DenseAttention, DenseKVState, causal_attention
from zgen.model import Model
from zgen.pallas import flash_attention
from zgen.runtime.runner import runner_for

KERNEL_PATHS = ("xla", "triton")
IDS = [1, 17, 42, 5, 88, 3, 60, 61, 9, 33, 70, 12, 45, 90, 4, 27, 8, 15, 64, 31]


@pytest.fixture(autouse=True)
def _exact_f32_matmuls() -> Iterator[None]:
    """On GPUs XLA may run the einsum path's f32 matmuls in TF32; the tolerances assume real f32."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module", params=["llama", "mistral"])  # mistral: sliding window 8
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    directory: Path = tmp_path_factory.mktemp(request.param)
    save_random_checkpoint(small_configs()[request.param], directory)
    return load_model(directory, dtype="float32")


def _chunked_logits(model: Model, attention: DenseAttention) -> np.ndarray:
    """Two rows at different offsets: a 40-token prefill (the Triton prefill kernel; row 1's tail is
    padding at continuing positions, as the generator pads), a 5-token chunk after it and three
    one-token steps (on the Triton path: the one-kernel step that writes the cache and attends)."""
    c = model.config
    runner = runner_for(model)
    state = DenseKVState.zeros(c.num_layers, 2, 128, c.num_kv_heads, c.head_dim, model.dtype, attention)
    chunks = [(0, 40), (40, 5), (45, 1), (46, 1), (47, 1)]
    starts = np.asarray([0, 3], np.int32)  # row 1 runs three tokens behind row 0
    out = []
    for begin, size in chunks:
        positions = starts[:, None] + begin + np.arange(size, dtype=np.int32)
        tokens = np.asarray(IDS, np.int32)[positions % len(IDS)]
        rows = np.broadcast_to(np.arange(size, dtype=np.int32), (2, size))
        logits, state = runner.forward(state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(rows))
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("attention", KERNEL_PATHS)
def test_kernel_path_logits_match_einsum(model: Model, attention: DenseAttention) -> None:
    expected = _chunked_logits(model, "einsum")
    np.testing.assert_allclose(_chunked_logits(model, attention), expected, atol=2e-5, rtol=2e-5)


def test_greedy_generation_matches_einsum(model: Model) -> None:
    """The generator's own prefill (bucketed) and on-device decode loop (one token per step), on the
    dense rows of the default (tensor) cache."""
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    results = {}
    for attention in ("einsum", "triton"):
        generator = Generator(model, dense_attention(attention))
        assert generator.engine.kv.kind == "tensor"
        results[attention] = generator.generate(IDS[:7], sampling)
    assert results["triton"].token_ids == results["einsum"].token_ids
    np.testing.assert_allclose(results["triton"].logprobs, results["einsum"].logprobs, atol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU default")
def test_auto_on_cpu_is_einsum_for_decode_and_the_blocked_kernel_for_chunks() -> None:
    """CPU decodes through causal_attention (bit-identical) and prefills through the blocked XLA
    kernel, which skips the key blocks no query sees (the same values within float32 rounding)."""
    rng = np.random.default_rng(0)
    state = DenseKVState(
        (jnp.asarray(rng.standard_normal((1, 16, 2, 16)), jnp.float32),),
        (jnp.asarray(rng.standard_normal((1, 16, 2, 16)), jnp.float32),),
    )
    assert state.attention == "auto" and "einsum" in get_args(DenseAttention)
    k, v = state.k[0], state.v[0]
    one = jnp.asarray(rng.standard_normal((1, 1, 4, 16)), jnp.float32)
    at = jnp.asarray([[6]], jnp.int32)
    np.testing.assert_array_equal(state.attend(0, one, at, sliding_window=None), causal_attention(one, k, v, at, sliding_window=None))
    q = jnp.asarray(rng.standard_normal((1, 3, 4, 16)), jnp.float32)
    positions = jnp.asarray([[4, 5, 6]], jnp.int32)
    chunk = state.attend(0, q, positions, sliding_window=None)
    np.testing.assert_array_equal(chunk, flash_attention(q, k, v, q_positions=positions, implementation="xla"))
    np.testing.assert_allclose(chunk, causal_attention(q, k, v, positions, sliding_window=None), atol=1e-5)


@pytest.mark.parametrize("attention", KERNEL_PATHS)
def test_padding_tokens_at_minus_one_touch_nothing(attention: DenseAttention) -> None:
    """A padded row's tokens at position -1 write no slot (not the last one) and attend to nothing."""
    rng = np.random.default_rng(1)
    state = DenseKVState.zeros(1, 2, 16, 2, 16, jnp.float32, attention)
    k, v = (jnp.asarray(rng.standard_normal((2, 3, 2, 16)), jnp.float32) for _ in range(2))
    positions = jnp.asarray([[0, 1, 2], [0, -1, -1]], jnp.int32)
    state = state.write(0, k, v, positions)
    assert np.all(np.asarray(state.k[0][1, 1:]) == 0) and np.all(np.asarray(state.k[0][0, 3:]) == 0)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.float32)
    out = np.asarray(state.attend(0, q, positions, sliding_window=None))
    assert np.all(np.isfinite(out)) and np.all(out[1, 1:] == 0)
    expected = causal_attention(q, state.k[0], state.v[0], positions, sliding_window=None)
    np.testing.assert_allclose(out[0], expected[0], atol=2e-5)
    np.testing.assert_allclose(out[1, 0], expected[1, 0], atol=2e-5)
