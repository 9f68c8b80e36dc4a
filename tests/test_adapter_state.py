"""LoRA adapters that stay with state: a session's adapter mix across turns (its KV kept while the mix is
unchanged, recomputed after a change) and a context's adapter stack in its snapshot."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import transformers

from tests.hf_reference import SMALL, save_random_checkpoint
from tests.test_lora import ALL_TARGETS, _make_adapter  # pyright: ignore[reportPrivateUsage]
from zgen import Context, Engine, Generator, SamplingConfig, load_adapter, load_model
from zgen.cache.factory import CacheOption, paged_kv
from zgen.contexts import drop_export, import_kv_pages, snapshot
from zgen.errors import AdapterError, SnapshotError
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



# ------------------------------------------------------------------------------------------------
# Adapter stacks in context snapshots


def _fingerprint_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def stacked(setup: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A context with two adapters pushed (loaded from copies the test may change), a reply generated
    under them, saved as "stacked"."""
    monkeypatch.setenv("ZGEN_STORE_DIR", str(tmp_path / "store"))
    for name in ("a", "b"):
        shutil.copytree(setup["root"] / name, tmp_path / name)
    a, b = load_adapter(tmp_path / "a"), load_adapter(tmp_path / "b")
    engine = Engine(setup["model"])
    ctx = Context(engine)
    ctx.fill_tokens(TURN1)
    ctx.push_adapter(a, 0.5)
    ctx.push_adapter(b)
    ctx.generate_result(GREEDY)
    ctx.fill_tokens([6, 7])
    ctx.save("stacked")
    return {"engine": engine, "ctx": ctx, "a": a, "b": b, "dir": tmp_path, "store": tmp_path / "store" / "stacked"}


def test_a_snapshot_restores_its_adapter_stack(stacked: dict[str, Any]) -> None:
    engine, ctx, a, b = stacked["engine"], stacked["ctx"], stacked["a"], stacked["b"]
    reloaded = Context.open(engine, "stacked")  # from the directories the adapters were loaded from
    assert [(x.name, scale) for x, scale in reloaded.adapters] == [("a", 0.5), ("b", 1.0)]
    given = Context.open(engine, "stacked", adapters=[b, a])  # the caller's own objects, matched by weights
    assert [(x, scale) for x, scale in given.adapters] == [(a, 0.5), (b, 1.0)]
    ctx.export_kv_pages("stacked")  # the in-memory form carries the stack too
    imported = Context.from_imported_state(engine, import_kv_pages(engine, "stacked"))
    assert imported.adapters == ctx.adapters == ((a, 0.5), (b, 1.0))
    drop_export(engine, "stacked")
    expected = ctx.generate_result(GREEDY).token_ids  # the context that was never saved
    assert reloaded.generate_result(GREEDY).token_ids == expected
    assert given.generate_result(GREEDY).token_ids == expected
    plain = Context.open(engine, "stacked")
    plain.pop_adapter()
    plain.pop_adapter()
    assert plain.generate_result(GREEDY).token_ids != expected  # the restored stack is what made them equal


def test_a_missing_or_different_adapter_is_refused_and_changes_nothing(setup: dict[str, Any], stacked: dict[str, Any]) -> None:
    engine, a, b, root = stacked["engine"], stacked["a"], stacked["b"], stacked["dir"]
    files = _fingerprint_files(stacked["store"])
    used = engine.kv.pool.num_used
    impostor = load_adapter(setup["root"] / "a", name="b")  # another adapter under b's name

    def refused(match: str, **kwargs: Any) -> None:
        with pytest.raises(SnapshotError, match=match) as caught:
            Context.open(engine, "stacked", **kwargs)
        assert "adapters=[zgen.load_adapter(DIR)]" in str(caught.value)  # says how to fix it
        assert _fingerprint_files(stacked["store"]) == files and engine.kv.pool.num_used == used

    refused(r"adapter 'b' \(scale 1\).*given as 'b' has other weights", adapters=[impostor])
    shutil.rmtree(root / "b")
    shutil.copytree(setup["root"] / "a", root / "b")  # b's directory now holds another adapter
    refused(r"adapter 'b'.*the files there now hold other weights")
    shutil.rmtree(root / "b")
    refused(r"adapter 'b'.*cannot be loaded now")
    # Given the adapter, the snapshot opens as before.
    assert Context.open(engine, "stacked", adapters=[b]).adapters[1] == (b, 1.0)

    ctx = Context(engine)
    ctx.fill_tokens(TURN1)
    ctx.push_adapter(random_adapter(engine.model.config, 2, seed=3))
    ctx.save("in-memory")
    with pytest.raises(SnapshotError, match="not loaded from a directory"):
        Context.open(engine, "in-memory")


def test_a_snapshot_of_format_3_opens_with_no_stack(stacked: dict[str, Any]) -> None:
    engine, store = stacked["engine"], stacked["store"]
    path = store / (store / "CURRENT").read_text() / "meta.json"
    meta = json.loads(path.read_text())
    assert meta["format"] == 4 and [r["name"] for r in meta["adapters"]] == ["a", "b"]
    meta.pop("meta_sha256")
    del meta["adapters"]
    meta["format"] = 3
    meta["meta_sha256"] = snapshot._meta_digest(meta)  # pyright: ignore[reportPrivateUsage]
    path.write_text(json.dumps(meta))
    opened = Context.open(engine, "stacked")
    assert opened.adapters == () and opened.token_ids == stacked["ctx"].token_ids
    meta.pop("meta_sha256")
    meta["format"] = 4  # format 4 must say which adapters it ran with
    meta["meta_sha256"] = snapshot._meta_digest(meta)  # pyright: ignore[reportPrivateUsage]
    path.write_text(json.dumps(meta))
    with pytest.raises(SnapshotError, match="'adapters' should be a list"):
        Context.open(engine, "stacked")
