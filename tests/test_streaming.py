"""Streams: per_token=True delivers each token as it is drawn through every front end (Generator,
batch_generate_stream, Session, Context), the pieces join to the non-streamed text, and sessions keep
their KV between turns on every cache kind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hf_reference import save_random_checkpoint, small_configs
from zgen import Context, Engine, Generator, Request, SamplingConfig, load_model
from zgen.cache.factory import CacheOption, cache_kind, compressed_kv, paged_kv
from zgen.model import Model


def greedy(n: int) -> SamplingConfig:
    return SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    directory: Path = tmp_path_factory.mktemp("tiny-hf")
    save_random_checkpoint(small_configs()["llama_tied"], directory)
    return load_model(directory)


def forward_passes_per_piece(pieces: Iterator[str], engine: Engine) -> tuple[list[str], list[int]]:
    """The pieces, and how many forward passes the engine ran before each arrived."""
    out, passes = [], []
    before = engine.stats.forward_passes
    for piece in pieces:
        out.append(piece)
        passes.append(engine.stats.forward_passes - before)
        before = engine.stats.forward_passes
    return out, passes


def test_per_token_streams_deliver_each_token_as_it_is_drawn(tiny: Model) -> None:
    gen = Generator(tiny, sync_interval=8)
    expected = gen.generate("w3 w4 w5", greedy(12))
    pieces, passes = forward_passes_per_piece(gen.generate_stream("w3 w4 w5", greedy(12), per_token=True), gen.engine)
    assert "".join(pieces) == expected.text
    assert len(pieces) == len(expected.token_ids) == 12  # one word per token in this vocabulary
    assert passes == [1] * 12  # each token reached the caller before the next was computed
    batched = list(gen.generate_stream("w3 w4 w5", greedy(12)))
    assert "".join(batched) == expected.text and len(batched) < 12  # by default, every sync_interval tokens


def test_batch_generate_stream_interleaves_one_stream_per_request(tiny: Model) -> None:
    gen = Generator(tiny, max_batch_size=4)
    requests = [Request("w3 w4", greedy(6)), Request("w5 w6 w7", greedy(3)), Request([3, 9, 4], greedy(9))]
    expected = [r.text for r in gen.batch_generate(requests)]
    events = list(gen.batch_generate_stream(requests, per_token=True))
    texts = ["".join(piece for i, piece in events if i == n) for n in range(3)]
    assert texts == expected
    assert [i for i, _ in events[:3]] == [0, 1, 2]  # the first tokens of all three before any second one
    assert sum(1 for i, _ in events if i == 2) == 9

    unbatched = list(gen.batch_generate_stream(requests))  # by sync interval: the same text
    assert ["".join(p for i, p in unbatched if i == n) for n in range(3)] == expected
    stream = gen.batch_generate_stream(requests, per_token=True)
    next(stream)
    stream.close()  # closing early frees every row
    assert gen.metrics().requests_running == 0


def test_context_generate_stream(tiny: Model) -> None:
    engine = Engine(tiny, paged_kv(4))
    ctx = Context(engine)
    ctx.fill("w3 w4 w5")
    twin = ctx.fork()
    expected = twin.generate_result(greedy(7))
    pieces, passes = forward_passes_per_piece(ctx.generate_stream(greedy(7), per_token=True), engine)
    assert "".join(pieces) == expected.text and passes == [1] * 7
    assert ctx.token_ids == twin.token_ids  # the reply joined the context as generate's does
    partial = ctx.generate_stream(greedy(20), per_token=True)
    next(partial)
    partial.close()
    assert ctx.token_ids == twin.token_ids  # an abandoned stream leaves the context as it was


@pytest.mark.parametrize(
    "options", [(cache_kind("tensor"),), (paged_kv(4),), (compressed_kv(),)], ids=["tensor", "paged", "compressed"]
)
def test_sessions_keep_their_kv_between_turns(tiny: Model, options: tuple[CacheOption, ...]) -> None:
    gen = Generator(tiny, *options)
    session = gen.new_session()
    turn1 = [3, 4, 5, 6, 7]
    first = "".join(session.generate_stream(turn1, greedy(4), per_token=True))
    history = session.token_ids
    assert history[: len(turn1)] == turn1 and len(history) == len(turn1) + 4
    turn2 = [*history, 8, 9]
    second = session.generate(turn2, greedy(4))
    assert second.usage.cached_prompt_tokens >= len(history) - 1  # the first turn was not computed again
    assert first == gen.generate(turn1, greedy(4)).text
    assert second.token_ids == gen.generate(turn2, greedy(4)).token_ids  # as a fresh request of the whole turn
