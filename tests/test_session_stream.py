"""Session.generate_stream (what ``zgen chat`` prints with): the same reply and the same kept KV as
Session.generate, and an abandoned stream leaves the session usable."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_reference import save_random_checkpoint, small_configs
from zgen import Generator, SamplingConfig, load_model
from zgen.cache.factory import CacheOption, paged_kv
from zgen.model import Model

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    directory: Path = tmp_path_factory.mktemp("tiny-hf")
    save_random_checkpoint(small_configs()["llama_tied"], directory)
    return load_model(directory)


@pytest.mark.parametrize("options", [(), (paged_kv(4),)], ids=["tensor", "paged"])
def test_streamed_turns_equal_generated_turns(tiny: Model, options: tuple[CacheOption, ...]) -> None:
    gen = Generator(tiny, *options)
    streamed, generated = gen.new_session(), gen.new_session()
    turn1 = "w3 w4 w5"
    pieces = list(streamed.generate_stream(turn1, GREEDY))
    first = generated.generate(turn1, GREEDY)
    assert len(pieces) > 1
    assert "".join(pieces) == first.text
    assert streamed.token_ids == generated.token_ids == first.prompt_token_ids + first.token_ids

    turn2 = [*first.prompt_token_ids, *first.token_ids, 6, 7]
    second = generated.generate(turn2, GREEDY)
    assert second.usage.cached_prompt_tokens >= len(first.prompt_token_ids)  # the first turn's KV was kept
    assert "".join(streamed.generate_stream(turn2, GREEDY)) == second.text
    assert streamed.token_ids == generated.token_ids


def test_an_abandoned_stream_drops_the_reply_and_frees_the_session(tiny: Model) -> None:
    gen = Generator(tiny)
    session = gen.new_session()
    stream = session.generate_stream("w3 w4 w5", SamplingConfig(temperature=0.0, max_new_tokens=32, ignore_eos=True))
    assert next(stream)
    stream.close()
    assert session.token_ids == tiny.tokenizer.encode("w3 w4 w5")  # the prompt stays, the partial reply does not
    again = session.generate("w3 w4 w5", GREEDY)  # the session is free again and answers as a fresh one would
    assert again.token_ids == gen.new_session().generate("w3 w4 w5", GREEDY).token_ids
