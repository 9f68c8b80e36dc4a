"""One set of expectations, run through both front ends of the runtime: the Generator and contexts.

Every scenario builds its request once — prompt ids, a ``SamplingConfig``, optionally extra stop rules
— and runs it through a :class:`_FrontEnd`: ``Generator.generate`` / ``batch_generate``, or a
``Context`` filled with the prompt and ``generate_result`` / concurrent ``generate_result_async``.
Both must give the same tokens, text, log-probs and finish reason, and both must match the independent
reference where one exists (HF transformers on CPU, float32; numpy penalties over the model's logits).
The model is a two-layer random Llama with SmolLM2's tokenizer (real text, quick to compile); the real
SmolLM2 runs where its behaviour matters (ending its answer with EOS) and in tests/test_parity_smollm2.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from tests.hf_reference import hf_teacher_forced
from zgen import Context, Engine, EngineConfig, GenerationResult, Generator, Request, Sampler, SamplingConfig, stop
from zgen.cache.factory import CacheOption, cache_kind, kv_dtype, paged_kv, prefix_cache, tiered_kv
from zgen.contexts import gather
from zgen.errors import ConfigError
from zgen.model import Model
from zgen.runtime.stop import StopCondition

PROMPTS = ["The capital of France is", "Write a list of fruits:\n1.", "def add(a, b):"]


@dataclass
class _FrontEnd:
    """One way of running requests: a name, one request, a batch of requests."""

    name: str
    run: Callable[[list[int], SamplingConfig, StopCondition | None], GenerationResult]
    run_batch: Callable[[list[tuple[list[int], SamplingConfig]]], list[GenerationResult]]


def _generator(model: Model, *options: CacheOption) -> _FrontEnd:
    gen = Generator(model, *options, sync_interval=4)
    return _FrontEnd(
        "generator",
        lambda ids, sampling, extra: gen.batch_generate([Request(ids, sampling, extra)])[0],
        lambda batch: gen.batch_generate([Request(ids, sampling) for ids, sampling in batch]),
    )


def _contexts(model: Model, *options: CacheOption) -> _FrontEnd:
    engine = Engine(model, *options, config=EngineConfig(steps_per_sync=4))

    def context(ids: list[int]) -> Context:
        ctx = Context(engine)
        ctx.fill_tokens(ids)
        return ctx

    def run(ids: list[int], sampling: SamplingConfig, extra: StopCondition | None) -> GenerationResult:
        own = StopCondition.from_sampling(sampling, model.eos_token_ids)
        with context(ids) as ctx:
            return ctx.generate_result(sampling, own | extra if extra else None)

    def run_batch(batch: list[tuple[list[int], SamplingConfig]]) -> list[GenerationResult]:
        contexts = [context(ids) for ids, _ in batch]
        results = gather(*(c.generate_result_async(s) for c, (_, s) in zip(contexts, batch, strict=True)))
        for c in contexts:
            c.release()
        return results

    return _FrontEnd("context", run, run_batch)


@pytest.fixture(scope="module")
def front_ends(small_chat: Model) -> list[_FrontEnd]:
    return [_generator(small_chat), _contexts(small_chat)]


@pytest.fixture(scope="module")
def ids(small_chat: Model) -> list[list[int]]:
    gen = Generator(small_chat)
    return [gen.encode_prompt(p) for p in PROMPTS]


def _same(results: Sequence[GenerationResult]) -> GenerationResult:
    """All front ends gave the same result (log-probs within float32 noise of a different batch)."""
    first = results[0]
    for other in results[1:]:
        assert other.token_ids == first.token_ids
        assert other.text == first.text
        assert other.finish_reason == first.finish_reason
        np.testing.assert_allclose(other.logprobs, first.logprobs, atol=1e-4)
    return first


def test_greedy_and_logprobs_equal_hf(front_ends: list[_FrontEnd], ids: list[list[int]], small_chat_checkpoint: tuple[Any, Any]) -> None:
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    result = _same([f.run(ids[0], sampling, None) for f in front_ends])
    ref_tokens, ref_logprobs = hf_teacher_forced(small_chat_checkpoint[1], ids[0], result.token_ids)
    assert result.token_ids == ref_tokens and len(result.token_ids) == 12
    np.testing.assert_allclose(result.logprobs, ref_logprobs, atol=1e-3)
    assert result.finish_reason == "length" and result.usage.completion_tokens == 12


def _penalized_greedy_picks(generator: Generator, prompt: list[int], sampling: SamplingConfig, drawn: list[int]) -> list[int]:
    """What greedy decoding with the penalties applied in numpy to the model's logits (vLLM's
    semantics) picks after each prefix of ``drawn``: the logits of every prefix from one causal pass."""
    logits = generator.logits(prompt + drawn[:-1])[len(prompt) - 1 :].astype(np.float64)
    picks: list[int] = []
    for step, row in enumerate(logits):
        tokens = drawn[:step]
        seen = set(prompt) | set(tokens)
        counts = np.bincount(np.asarray(tokens, np.int64), minlength=row.shape[0]).astype(np.float64)
        for t in seen:
            p = sampling.repetition_penalty
            row[t] = row[t] / p if row[t] > 0 else row[t] * p
        row -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0)
        picks.append(int(np.argmax(row)))
    return picks


def test_penalties_work_through_every_front_end(front_ends: list[_FrontEnd], ids: list[list[int]], small_chat: Model) -> None:
    sampling = SamplingConfig(
        temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, max_new_tokens=10, ignore_eos=True
    )
    result = _same([f.run(ids[1], sampling, None) for f in front_ends])
    assert result.token_ids == _penalized_greedy_picks(Generator(small_chat), ids[1], sampling, result.token_ids)
    plain = front_ends[0].run(ids[1], SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True), None)
    assert plain.token_ids != result.token_ids  # the penalties changed something to check


def test_seeded_sampling_is_the_same_everywhere(front_ends: list[_FrontEnd], ids: list[list[int]]) -> None:
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=12, ignore_eos=True)
    result = _same([f.run(ids[0], sampling, None) for f in front_ends])
    other = front_ends[1].run(ids[0], SamplingConfig(temperature=0.8, top_p=0.9, seed=8, max_new_tokens=12, ignore_eos=True), None)
    assert other.token_ids != result.token_ids
    named = front_ends[0].run(ids[0], Sampler.top_p(0.8, 0.9, seed=7, max_new_tokens=12, ignore_eos=True), None)
    assert named.token_ids == result.token_ids  # Sampler names configs; it is not a second vocabulary


def test_stop_strings_and_sequences_end_the_text_the_same_way(front_ends: list[_FrontEnd], ids: list[list[int]], small_chat: Model) -> None:
    free = front_ends[0].run(ids[1], SamplingConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True), None)
    cut = free.text.index("\n", 2) if "\n" in free.text[2:] else len(free.text) // 2
    target = free.text[cut : cut + 2]
    by_string = _same([f.run(ids[1], SamplingConfig(temperature=0.0, max_new_tokens=20, stop=(target,), ignore_eos=True), None) for f in front_ends])
    assert by_string.finish_reason == "stop" and by_string.text == free.text[: free.text.index(target)]
    sequence = free.token_ids[4:6]
    by_tokens = _same([f.run(ids[1], SamplingConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True), stop.ends_with(sequence)) for f in front_ends])
    assert by_tokens.token_ids == free.token_ids[:6] and by_tokens.finish_reason == "stop"
    assert by_tokens.text == small_chat.tokenizer.decode(free.token_ids[:4], skip_special_tokens=True)
    by_text = _same([f.run(ids[1], SamplingConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True), stop.ends_with_text(target)) for f in front_ends])
    assert by_text.text == by_string.text and by_text.token_ids == by_string.token_ids


def test_eos_stops_and_is_left_out_of_the_text(smollm2: Model) -> None:
    chat = Generator(smollm2).encode_prompt([{"role": "user", "content": "Say hi."}])
    front_ends = [_generator(smollm2), _contexts(smollm2)]
    result = _same([f.run(chat, SamplingConfig(temperature=0.0, max_new_tokens=40), None) for f in front_ends])
    assert result.finish_reason == "stop" and result.token_ids[-1] in smollm2.eos_token_ids
    assert "<|im_end|>" not in result.text


def test_a_batch_of_mixed_configs_equals_each_request_alone(front_ends: list[_FrontEnd], ids: list[list[int]]) -> None:
    batch = [
        (ids[0], SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)),
        (ids[1], SamplingConfig(temperature=1.0, top_k=20, seed=3, max_new_tokens=9, ignore_eos=True)),
        (ids[2], SamplingConfig(temperature=0.0, repetition_penalty=1.2, max_new_tokens=7, ignore_eos=True)),
    ]
    together = [front.run_batch(batch) for front in front_ends]
    alone = [front_ends[0].run(p, s, None) for p, s in batch]
    for i in range(len(batch)):
        _same([alone[i], *(results[i] for results in together)])


def test_more_requests_than_rows_finish_with_rows_reused(small_chat: Model, ids: list[list[int]]) -> None:
    """Continuous batching: 5 requests on 2 rows; short ones free their row for the next at once."""
    gen = Generator(small_chat, max_batch_size=2)
    configs = [SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (3, 12, 4, 5, 2)]
    prompts = [ids[i % 3] for i in range(5)]
    together = gen.batch_generate([Request(p, c) for p, c in zip(prompts, configs, strict=True)])
    alone = [Generator(small_chat).generate(p, c) for p, c in zip(prompts, configs, strict=True)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert gen.engine.kv.pages is False and gen.engine.stats.rows < 5 * 12  # rows were not held to the longest


SYSTEM = " ".join(f"Rule {i}: answer briefly and only about metals." for i in range(1, 9))


@pytest.mark.parametrize("front", ["generator", "context"])
def test_a_shared_prefix_is_served_from_the_prefix_cache(small_chat: Model, front: str) -> None:
    make = _generator if front == "generator" else _contexts
    runner = make(small_chat, paged_kv(64), prefix_cache(512))
    tokenizer = small_chat.tokenizer
    first = tokenizer.encode(SYSTEM + " Is gold soft?")
    second = tokenizer.encode(SYSTEM + " Does iron rust?")
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    cold = runner.run(first, sampling, None)
    warm = runner.run(second, sampling, None)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert cold.usage.cached_prompt_tokens == 0
    assert shared - 16 < warm.usage.cached_prompt_tokens <= shared  # whole pages of the shared prefix
    assert warm.token_ids == Generator(small_chat).generate(second, sampling).token_ids


GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
LOSSLESS = {
    "tensor": (cache_kind("tensor"),),
    "flat": (cache_kind("flat"),),
    "paged": (paged_kv(64), kv_dtype("fp32")),
    "tiered": (tiered_kv(max_memory_mb=64),),
}


@pytest.mark.parametrize("kind", list(LOSSLESS))
def test_every_cache_kind_each_front_end_accepts(small_chat: Model, ids: list[list[int]], kind: str) -> None:
    want = Generator(small_chat).generate(ids[2], GREEDY).token_ids
    assert _generator(small_chat, *LOSSLESS[kind]).run(ids[2], GREEDY, None).token_ids == want
    if kind in ("paged", "tiered"):
        assert _contexts(small_chat, *LOSSLESS[kind]).run(ids[2], GREEDY, None).token_ids == want
    else:
        with pytest.raises(ConfigError, match="contexts need a paged KV cache"):
            _contexts(small_chat, *LOSSLESS[kind]).run(ids[2], GREEDY, None)


# fp8 pages end to end: tests/contexts/test_engine_pool.py and the conformance suite (a small model).
@pytest.mark.parametrize("options", [(cache_kind("compressed"),), (kv_dtype("q4"),)], ids=["compressed", "q4"])
def test_lossy_caches_generate_through_the_generator(small_chat: Model, ids: list[list[int]], options: tuple[CacheOption, ...]) -> None:
    result = _generator(small_chat, *options).run(ids[0], GREEDY, None)
    assert len(result.token_ids) == 8 and result.text
