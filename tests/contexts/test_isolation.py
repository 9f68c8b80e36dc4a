"""One request's fault stays its own, and an oversubscribed pool still makes progress (tiny random model)."""

from __future__ import annotations

import numpy as np
import pytest

from zgen import Context, Engine, EngineConfig, Sampler, stop
from zgen.cache.factory import paged_kv
from zgen.contexts import gather
from zgen.errors import PoolExhaustedError, TokenIdError

UNTIL = stop.max_len(6)


def _prompts(n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(n)
    return [rng.integers(3, 90, length).tolist() for _ in range(n)]


def _engine(tiny_engine: Engine, pages: int, policy: str = "error") -> Engine:
    """An engine on the tiny model with a pool of ``pages`` pages of 16 tokens."""
    c = tiny_engine.model.config
    page_mb = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 16 / 2**20
    return Engine(tiny_engine.model, paged_kv(pages * page_mb), config=EngineConfig(on_pool_exhausted=policy))  # type: ignore[arg-type]


def _alone(engine: Engine, prompt: list[int], seed: int) -> list[int]:
    with Context(engine, seed=seed) as ctx:
        ctx.fill_tokens(prompt)
        return ctx.generate_result(Sampler.top_k(0.9, 8), UNTIL).token_ids


def test_a_faulty_sampler_fails_its_own_context_alone(tiny_engine: Engine) -> None:
    engine = _engine(tiny_engine, 32)
    prompts = _prompts(8, 12)
    contexts = [Context(engine, seed=i) for i in range(8)]
    for ctx, prompt in zip(contexts, prompts, strict=True):
        ctx.fill_tokens(prompt)
    before = [(c.token_ids, c.kv_len) for c in contexts]

    def raises(ids: np.ndarray, probs: np.ndarray) -> int:
        raise RuntimeError("a sampler bug")

    samplers = [Sampler.top_k(0.9, 8)] * 8
    samplers[2] = Sampler.custom(raises)
    samplers[5] = Sampler.custom(lambda ids, probs: -1)  # not a token id
    results = gather(*(c.generate_result_async(s, UNTIL) for c, s in zip(contexts, samplers, strict=True)), return_exceptions=True)
    assert isinstance(results[2], RuntimeError) and isinstance(results[5], TokenIdError)
    for i in (2, 5):
        assert (contexts[i].token_ids, contexts[i].kv_len) == before[i]  # exactly as it was
    expected = [_alone(engine, p, seed=i) for i, p in enumerate(prompts)]
    for i, result in enumerate(results):
        if i not in (2, 5):
            assert not isinstance(result, BaseException) and result.token_ids == expected[i]
    retry = contexts[2].generate_result(Sampler.top_k(0.9, 8), UNTIL)  # the failed context is usable
    assert retry.token_ids == expected[2]
    for ctx in contexts:
        ctx.release()


@pytest.mark.parametrize("policy", ["wait", "error"])
def test_an_oversubscribed_pool_makes_progress_or_fails_cleanly(tiny_engine: Engine, policy: str) -> None:
    """20 contexts of 24 tokens on a 10-page pool (16-token pages), all generating at once: 5 fit. With
    "wait" the rest wait and take the pages of contexts that finished (their K/V is dropped, to be
    recomputed on their next call); with "error" they fail and stay as they were."""
    engine = _engine(tiny_engine, 10, policy)
    prompts = _prompts(20, 24)
    contexts = [Context(engine, seed=i) for i in range(20)]
    for ctx, prompt in zip(contexts, prompts, strict=True):
        ctx.fill_tokens(prompt)
    results = gather(*(ctx.generate_result_async(Sampler.top_k(0.9, 8), UNTIL) for ctx in contexts), return_exceptions=True)
    roomy = _engine(tiny_engine, 64)
    expected = [_alone(roomy, p, seed=i) for i, p in enumerate(prompts)]
    done = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            assert isinstance(result, PoolExhaustedError)
            assert contexts[i].token_ids == prompts[i]  # a failed call leaves its context as it was
        else:
            assert result.token_ids == expected[i]  # preempted and recomputed contexts lose nothing
    if policy == "wait":
        assert len(done) == 20 and engine.stats.preemptions > 0
        # An idle context gave its pages to a waiting one; its next call feeds its tokens again, exactly.
        dropped = next(i for i, ctx in enumerate(contexts) if ctx.kv_len == 0)
        more = contexts[dropped].generate_result(Sampler.top_k(0.9, 8), UNTIL).token_ids
        with Context(roomy, seed=dropped) as twin:
            twin.fill_tokens(prompts[dropped])
            twin.generate_result(Sampler.top_k(0.9, 8), UNTIL)
            assert twin.generate_result(Sampler.top_k(0.9, 8), UNTIL).token_ids == more
    else:
        assert 0 < len(done) < 20
    for ctx in contexts:
        ctx.release()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # type: ignore[attr-defined]


def test_a_running_context_preempted_for_an_earlier_one_recomputes_exactly(tiny_engine: Engine) -> None:
    """Three contexts of 20 tokens fill a 6-page pool and all grow past their second page while
    decoding: the later ones give their pages to the earlier and feed their tokens again after."""
    engine = _engine(tiny_engine, 6, "wait")
    prompts = _prompts(3, 20)
    long = stop.max_len(24)
    contexts = [Context(engine, seed=i) for i in range(3)]
    for ctx, prompt in zip(contexts, prompts, strict=True):
        ctx.fill_tokens(prompt)
    results = gather(*(ctx.generate_result_async(Sampler.top_k(0.9, 8), long) for ctx in contexts))
    roomy = _engine(tiny_engine, 64)
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        with Context(roomy, seed=i) as twin:
            twin.fill_tokens(prompt)
            assert result.token_ids == twin.generate_result(Sampler.top_k(0.9, 8), long).token_ids
    assert engine.stats.preemptions > 0
