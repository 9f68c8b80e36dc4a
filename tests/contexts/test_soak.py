"""Soak: many contexts driven at random — fills, batched generations with random samplers and stops,
forks, masks, saves and reopens, and injected faults — on a tight pool (preemption), each checked
after every round against its fault-free twin on a roomy engine, driven one call at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from zgen import Context, Engine, EngineConfig, Sampler, SamplingConfig, stop
from zgen.cache.factory import paged_kv
from zgen.contexts import gather
from zgen.runtime.stop import StopCondition

PAGE = 16


def _engine(tiny_engine: Engine, pages: int) -> Engine:
    c = tiny_engine.model.config
    page_mb = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * PAGE / 2**20
    return Engine(tiny_engine.model, paged_kv(pages * page_mb), config=EngineConfig(on_pool_exhausted="wait", steps_per_sync=4))


def _sampler(rng: np.random.Generator) -> SamplingConfig:
    return [
        Sampler.greedy(),
        Sampler.top_k(0.9, 8),
        Sampler.top_p(0.8, 0.9, repetition_penalty=1.2),
        Sampler.min_p(1.0, 0.1, presence_penalty=0.5),
    ][int(rng.integers(4))]


def _stop(rng: np.random.Generator) -> StopCondition:
    limit = stop.max_len(int(rng.integers(1, 9)))
    return limit | stop.ends_with(int(rng.integers(3, 90))) if rng.random() < 0.5 else limit


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_contexts_under_random_load_equal_their_fault_free_twins(tiny_engine: Engine, seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZGEN_STORE_DIR", str(tmp_path))
    rng = np.random.default_rng(seed)
    tight, roomy = _engine(tiny_engine, 14), _engine(tiny_engine, 256)
    pairs: list[tuple[Context, Context]] = []

    def new_pair(context_seed: int) -> None:
        prompt = rng.integers(3, 90, int(rng.integers(4, 30))).tolist()
        a, b = Context(tight, seed=context_seed), Context(roomy, seed=context_seed)
        a.fill_tokens(prompt)
        b.fill_tokens(prompt)
        pairs.append((a, b))

    def broken(ids: np.ndarray, probs: np.ndarray) -> int:
        raise RuntimeError("injected fault")

    for i in range(4):
        new_pair(i)
    for step in range(10):
        action = rng.random()
        if action < 0.5:  # a batched round of generations; some calls carry a faulty sampler
            chosen = sorted(rng.choice(len(pairs), size=min(len(pairs), 3), replace=False).tolist())
            plans = [(_sampler(rng), _stop(rng), rng.random() < 0.25) for _ in chosen]
            calls = [pairs[i][0].generate_result_async(Sampler.custom(broken) if fault else s, c) for i, (s, c, fault) in zip(chosen, plans, strict=True)]
            outcomes = gather(*calls, return_exceptions=True)
            for i, (sampling, condition, fault), outcome in zip(chosen, plans, outcomes, strict=True):
                if fault:
                    assert isinstance(outcome, RuntimeError)  # the twin does nothing: they must stay equal
                else:
                    assert not isinstance(outcome, BaseException), outcome
                    assert outcome.token_ids == pairs[i][1].generate_result(sampling, condition).token_ids
        elif action < 0.65:  # fork one
            a, b = pairs[int(rng.integers(len(pairs)))]
            fork_seed = 100 + step
            pairs.append((a.fork(seed=fork_seed), b.fork(seed=fork_seed)))
        elif action < 0.8:  # mask a range of one
            a, b = pairs[int(rng.integers(len(pairs)))]
            start = int(rng.integers(a.num_tokens))
            end = int(rng.integers(start, a.num_tokens + 1))
            a.mask_token_range(start, end)
            b.mask_token_range(start, end)
        elif action < 0.9:  # save one and carry on from the reopened snapshot
            k = int(rng.integers(len(pairs)))
            a, b = pairs[k]
            a.save(f"soak{step}")
            a.release()
            pairs[k] = (Context.open(tight, f"soak{step}", seed=a.seed), b)
        else:
            new_pair(200 + step)
        for a, b in pairs:
            assert a.token_ids == b.token_ids and np.array_equal(a.masked_flags, b.masked_flags)
    for a, b in pairs:
        a.release()
        b.release()
    assert tight.kv.pool.num_free == tight.kv.pool.num_blocks  # type: ignore[attr-defined]
