"""Generator behaviour on the real SmolLM2: batching, streaming, seeds, stop conditions, sessions."""

from __future__ import annotations

import pytest

from zgen import Generator, Request, SamplingConfig
from zgen.model import Model

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def gen(smollm2: Model) -> Generator:
    return Generator(smollm2)


def test_batch_equals_single(gen: Generator) -> None:
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time in a small village far away, there"]
    singles = [gen.generate(p, GREEDY) for p in prompts]
    batched = gen.batch_generate([Request(p, GREEDY) for p in prompts])
    for one, many in zip(singles, batched, strict=True):
        assert one.token_ids == many.token_ids
        assert one.text == many.text
        assert one.logprobs == pytest.approx(many.logprobs, abs=1e-4)


def test_stream_equals_generate(gen: Generator) -> None:
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=40)
    prompt = [{"role": "user", "content": "Write a haiku about autumn."}]
    pieces = list(gen.generate_stream(prompt, sampling))
    assert len(pieces) > 1
    assert "".join(pieces) == gen.generate(prompt, sampling).text


def test_same_seed_same_output_alone_or_batched(gen: Generator) -> None:
    sampling = SamplingConfig(temperature=1.0, top_k=50, seed=1234, max_new_tokens=20)
    first = gen.generate("My favourite food is", sampling)
    second = gen.generate("My favourite food is", sampling)
    other = SamplingConfig(temperature=0.7, seed=99, max_new_tokens=30)
    batched = gen.batch_generate([Request("Hello there,", other), Request("My favourite food is", sampling)])
    assert first.token_ids == second.token_ids == batched[1].token_ids
    different = gen.generate("My favourite food is", SamplingConfig(temperature=1.0, top_k=50, seed=4321, max_new_tokens=20))
    assert different.token_ids != first.token_ids


def test_max_new_tokens_and_usage(gen: Generator) -> None:
    result = gen.generate("Count: one, two,", SamplingConfig(temperature=0.0, max_new_tokens=5, ignore_eos=True))
    assert len(result.token_ids) == 5
    assert result.finish_reason == "length"
    assert result.usage.completion_tokens == 5
    assert result.usage.prompt_tokens == len(result.prompt_token_ids)


def test_stop_token_ends_generation(gen: Generator, smollm2: Model) -> None:
    chat = [{"role": "user", "content": "Say hi."}]
    result = gen.generate(chat, SamplingConfig(temperature=0.0, max_new_tokens=200))
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in smollm2.eos_token_ids
    assert "<|im_end|>" not in result.text


def test_stop_string_spanning_tokens(gen: Generator, smollm2: Model) -> None:
    free = gen.generate("1, 2, 3, 4, 5, 6, 7, 8,", SamplingConfig(temperature=0.0, max_new_tokens=30, ignore_eos=True))
    # Pick a stop string that straddles a token boundary of the free-running output.
    pieces = [smollm2.tokenizer.decode([t]) for t in free.token_ids]
    boundary = len(pieces[0]) + len(pieces[1])
    stop = free.text[boundary - 2 : boundary + 2]
    assert len(stop) == 4
    stopped = gen.generate(
        "1, 2, 3, 4, 5, 6, 7, 8,", SamplingConfig(temperature=0.0, max_new_tokens=30, stop=(stop,), ignore_eos=True)
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert free.token_ids[: len(stopped.token_ids)] == stopped.token_ids


def test_session_reuses_prefix_and_matches_fresh_generation(gen: Generator) -> None:
    session = gen.new_session()
    turn1 = [{"role": "user", "content": "What is 2 + 2?"}]
    first = session.generate(turn1, GREEDY)
    turn2 = [*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And 3 + 3?"}]
    second = session.generate(turn2, GREEDY)
    fresh = gen.generate(turn2, GREEDY)
    assert second.token_ids == fresh.token_ids
