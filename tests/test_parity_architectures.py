"""Llama (with llama3 RoPE scaling), Mistral (sliding window), Qwen2 (biases), Qwen3 (q/k norm):
random small checkpoints built and saved by transformers, compared with transformers on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.hf_reference import hf_greedy, hf_logits, save_random_checkpoint, small_configs
from zgen import Generator, SamplingConfig, load_model
from zgen.model import Model

ARCHS = list(small_configs())
IDS = [1, 17, 42, 5, 88, 3, 60, 61, 9, 33, 70, 12, 45, 90, 4, 27, 8, 15, 64, 31]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Any]:
    directory: Path = tmp_path_factory.mktemp(request.param)
    hf = save_random_checkpoint(small_configs()[request.param], directory)
    return load_model(directory, dtype="float32"), hf


def test_logits_match_transformers(pair: tuple[Model, Any]) -> None:
    model, hf = pair
    ours = Generator(model).logits(IDS)
    ref = hf_logits(hf, IDS)
    assert np.abs(ours - ref).max() <= 1e-4


def test_greedy_matches_transformers(pair: tuple[Model, Any]) -> None:
    model, hf = pair
    result = Generator(model).generate(IDS[:7], SamplingConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    ref_tokens, ref_logprobs = hf_greedy(hf, IDS[:7], 24, eos=[10_000])  # an id that never occurs: no early stop
    assert result.token_ids == ref_tokens
    np.testing.assert_allclose(result.logprobs, ref_logprobs, atol=1e-4)


def test_prefill_then_decode_equals_one_prefill(pair: tuple[Model, Any]) -> None:
    """prefill(N) then k single-token steps gives the logits of one prefill over N + k tokens."""
    import jax.numpy as jnp

    from zgen.cache.tensor import DenseKVState

    from zgen.runtime.runner import runner_for

    model, _ = pair
    c = model.config
    n, k = 12, 6
    runner = runner_for(model)
    cache = DenseKVState.zeros(c.num_layers, 1, 128, c.num_kv_heads, c.head_dim, model.dtype)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    logits, cache = runner.forward(cache, jnp.asarray([IDS[:n]]), positions, positions[:, -1:])
    stepped = [np.asarray(logits[0, 0])]
    for pos in range(n, n + k):
        step_logits, cache = runner.forward(cache, jnp.asarray([[IDS[pos]]]), jnp.asarray([[pos]]), jnp.zeros((1, 1), jnp.int32))
        stepped.append(np.asarray(step_logits[0, 0]))
    full = Generator(model).logits(IDS[: n + k])
    np.testing.assert_allclose(np.stack(stepped), full[n - 1 : n + k], atol=2e-5)
