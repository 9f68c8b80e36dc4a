"""LoRA adapters that stay with state: a session's adapter mix across turns (its KV kept while the mix is
unchanged, recomputed after a change) and a context's adapter stack in its snapshot."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import transformers

from tests.hf_reference import SMALL, save_random_checkpoint
from tests.test_lora import ALL_TARGETS, _make_adapter  # pyright: ignore[reportPrivateUsage]
from zgen import Generator, SamplingConfig, load_adapter, load_model
from zgen.cache.factory import CacheOption, paged_kv
from zgen.errors import AdapterError
from zgen.lora import random_adapter

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)
TURN1 = [1, 17, 42, 5, 88]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("adapter-state")
    save_random_checkpoint(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False), root / "base")
    _make_adapter(root / "base", root / "a", 1, r=4, lora_alpha=8, target_modules=ALL_TARGETS)
    _make_adapter(root / "base", root / "b", 2, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])
    return {"root": root, "model": load_model(root / "base", dtype="float32"), "a": load_adapter(root / "a"), "b": load_adapter(root / "b")}


@pytest.mark.parametrize("options", [(), (paged_kv(4),)], ids=["tensor", "paged"])
def test_session_turns_with_an_adapter_equal_one_generation(setup: dict[str, Any], options: tuple[CacheOption, ...]) -> None:
    model, a = setup["model"], setup["a"]
    gen = Generator(model, *options)
    session = gen.new_session(adapter=a)
    first = session.generate(TURN1, GREEDY)
    assert first.token_ids == gen.generate(TURN1, GREEDY, adapter=a).token_ids
    assert first.token_ids != gen.generate(TURN1, GREEDY).token_ids  # the adapter really changes the reply

    conversation = [*TURN1, *first.token_ids, 6, 7]
    second = session.generate(conversation, GREEDY)
    assert second.usage.cached_prompt_tokens >= len(TURN1)  # the first turn's KV was kept
    assert second.token_ids == gen.generate(conversation, GREEDY, adapter=a).token_ids
    conversation = [*conversation, *second.token_ids, 9]
    assert "".join(session.generate_stream(conversation, GREEDY)) == gen.generate(conversation, GREEDY, adapter=a).text


def test_changing_the_mix_recomputes_the_conversation(setup: dict[str, Any]) -> None:
    model, a, b = setup["model"], setup["a"], setup["b"]
    gen = Generator(model)
    session = gen.new_session(adapter=(a, 0.5))
    assert session.adapters == ((a, 0.5),)
    conversation = list(TURN1)
    # Turns: the first; after a push; after a pop; with the model's stack changed; after it is undone.
    expected_mixes: list[Any] = [[(a, 0.5)], [(a, 0.5), b], [(a, 0.5)], [(a, 0.5)], [(a, 0.5)]]
    for turn, mix in enumerate(expected_mixes):
        if turn == 1:
            session.push_adapter(b)
        if turn == 2:
            assert session.pop_adapter() is b
        if turn == 3:
            model.push_adapter(b, 0.25)  # the model's stack is part of the mix too
            mix = [(b, 0.25), *mix]
        try:
            result = session.generate(conversation, GREEDY)
        finally:
            if turn == 3:
                model.pop_adapter()
        assert result.token_ids == Generator(model).generate(conversation, GREEDY, adapter=mix).token_ids
        # Every turn but the first follows a change of mix: K/V of another mix are never reused.
        assert result.usage.cached_prompt_tokens == 0
        conversation = [*conversation, *result.token_ids, 3 + turn]
    result = session.generate(conversation, GREEDY)  # the mix the last turn computed: its KV is kept
    assert result.usage.cached_prompt_tokens > 0
    assert result.token_ids == Generator(model).generate(conversation, GREEDY, adapter=(a, 0.5)).token_ids


def test_session_adapters_are_checked(setup: dict[str, Any]) -> None:
    model = setup["model"]
    gen = Generator(model)
    deeper = random_adapter(replace(model.config, num_layers=model.config.num_layers + 1), 2)
    with pytest.raises(AdapterError, match="another base model"):
        gen.new_session(adapter=deeper)
    with pytest.raises(AdapterError, match="adapter= takes a LoraAdapter"):
        gen.new_session(adapter="a")  # type: ignore[arg-type]
    session = gen.new_session()
    with pytest.raises(AdapterError, match="nothing to pop"):
        session.pop_adapter()
    with pytest.raises(AdapterError, match="finite"):
        session.push_adapter(setup["a"], float("nan"))
    assert session.adapters == ()

