"""Generator behaviour that contexts have no twin of: streams and sessions on the real SmolLM2; rows
freed by abandoned streams and threads sharing a generator on the two-layer chat model (the engine's
bookkeeping, not the text). (What both front ends share is checked through both in
tests/test_scenarios.py.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from zgen import Generator, Request, SamplingConfig
from zgen.cache.factory import paged_kv
from zgen.model import Model

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def gen(smollm2: Model) -> Generator:
    return Generator(smollm2)


def test_stream_equals_generate(gen: Generator) -> None:
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=40)
    prompt = [{"role": "user", "content": "Write a haiku about autumn."}]
    pieces = list(gen.generate_stream(prompt, sampling))
    assert len(pieces) > 1
    assert "".join(pieces) == gen.generate(prompt, sampling).text


def test_max_new_tokens_and_usage(gen: Generator) -> None:
    result = gen.generate("Count: one, two,", SamplingConfig(temperature=0.0, max_new_tokens=5, ignore_eos=True))
    assert len(result.token_ids) == 5
    assert result.finish_reason == "length"
    assert result.usage.completion_tokens == 5
    assert result.usage.prompt_tokens == len(result.prompt_token_ids)


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


def test_session_keeps_its_kv_between_turns(smollm2: Model) -> None:
    # Chat turns of the real model; every cache kind's sessions: tests/test_streaming.py (a small model).
    gen = Generator(smollm2)
    session = gen.new_session()
    turn1 = [{"role": "user", "content": "What is 2 + 2?"}]
    first = session.generate(turn1, GREEDY)
    turn2 = [*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And 3 + 3?"}]
    second = session.generate(turn2, GREEDY)
    assert second.usage.cached_prompt_tokens >= len(first.prompt_token_ids)  # the first turn is not prefilled again
    assert second.token_ids == gen.generate(turn2, GREEDY).token_ids
    session.reset()


def test_an_abandoned_stream_frees_its_row(small_chat: Model) -> None:
    gen = Generator(small_chat, max_batch_size=1)
    stream = gen.generate_stream("Once upon a time", SamplingConfig(temperature=0.0, max_new_tokens=64, ignore_eos=True))
    assert next(stream)
    stream.close()  # the one row goes back at once, not at garbage collection
    assert len(gen.generate("Hi", SamplingConfig(temperature=0.0, max_new_tokens=3, ignore_eos=True)).token_ids) == 3


def test_threads_share_one_generator(small_chat: Model) -> None:
    gen = Generator(small_chat, paged_kv(64), max_batch_size=4)
    prompts = ["Red", "Green", "Blue", "Yellow"]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    alone = [gen.generate(p, sampling).token_ids for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda p: gen.generate(p, sampling).token_ids, prompts))
    assert threaded == alone


def test_a_full_batch_with_requests_waiting_decodes_each_answer_in_one_loop(tiny_llama: Model) -> None:
    """One row, three requests: each answer is one prefill step and one decode loop (the loop returns
    when its row finishes, so the next request loses nothing), with the tokens of each request alone."""
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    prompts = ["w5 w9 w12", "w7 w8", "w20 w21 w22 w23"]
    alone = [Generator(tiny_llama).generate(p, sampling).token_ids for p in prompts]
    generator = Generator(tiny_llama, max_batch_size=1)
    results = generator.batch_generate([Request(p, sampling) for p in prompts])
    assert [r.token_ids for r in results] == alone
    assert generator.engine.stats.steps == 2 * len(prompts)  # 10 when a waiting request cut the loops at 16 draws


def test_requests_held_for_a_refill_group_do_not_cut_the_running_loop(tiny_llama: Model) -> None:
    """Four rows, refills two at a time: once the short answer frees a row, the two waiting requests
    wait for a second one, and the three long answers decode to their end in one loop (the loop returns
    when a row finishes, which is when the group can be admitted), with each request's tokens alone."""
    short = SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    long = SamplingConfig(temperature=0.0, max_new_tokens=56, ignore_eos=True)
    prompts = ["w5 w9 w12", "w7 w8", "w20 w21 w22 w23", "w3 w4", "w30 w31", "w40"]
    requests = [Request(prompts[0], short)] + [Request(p, long) for p in prompts[1:]]
    alone = [Generator(tiny_llama).generate(r.prompt, r.sampling).token_ids for r in requests]
    generator = Generator(tiny_llama, max_batch_size=4, refill_rows=2)
    results = generator.batch_generate(requests)
    assert [r.token_ids for r in results] == alone
    assert generator.engine.stats.steps == 5  # 7 when the held-back requests cut the loop at 16 draws
