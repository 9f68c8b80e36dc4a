"""Snapshots survive crashes, concurrent writers and damage: the name always opens as a complete
snapshot (the old one or the new one) or is refused with a SnapshotError, never as garbage."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import pytest

from zgen import Context, Engine
from zgen.cache.factory import paged_kv
from zgen.contexts import snapshot
from zgen.errors import SnapshotError

# Two versions the tests save under one name: 40 tokens (3 pages of 16) and 20 tokens (2 pages).
OLD, NEW = list(range(3, 43)), list(range(50, 70))


@pytest.fixture(autouse=True)
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ZGEN_STORE_DIR", str(tmp_path / "store"))
    return tmp_path / "store"


def filled(engine: Engine, tokens: list[int]) -> Context:
    ctx = Context(engine)
    ctx.fill_tokens(tokens)
    ctx.flush()  # K/V in pages for all but the last token
    return ctx


def opened_tokens(engine: Engine, name: str) -> list[int]:
    with Context.open(engine, name) as ctx:
        return ctx.token_ids


def entries(directory: Path) -> list[str]:
    """What a snapshot directory holds, versions shown as ``v-*``."""
    return sorted("v-*" if p.name.startswith("v-") else p.name for p in directory.iterdir())


def current_meta(directory: Path) -> Path:
    return directory / (directory / "CURRENT").read_text() / "meta.json"


# ------------------------------------------------------------------------------------------------
# Crashes


_SAVER = """
import sys
from zgen import Context, Engine, load_model
from zgen.cache.factory import paged_kv
engine = Engine(load_model(sys.argv[1], dtype="float32"), paged_kv(1))
contexts = []
for tokens in ({old}, {new}):
    ctx = Context(engine)
    ctx.fill_tokens(tokens)
    ctx.flush()
    contexts.append(ctx)
contexts[0].save("story")
print("saved", flush=True)
while True:  # killed somewhere in here
    contexts[1].save("story")
    contexts[0].save("story")
"""


def test_a_save_killed_at_random_points_leaves_the_old_or_the_new_snapshot(tiny_engine: Engine, store: Path) -> None:
    source = tiny_engine.model.source
    assert source is not None
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    env = {**os.environ, "ZGEN_STORE_DIR": str(store), "PYTHONPATH": str(Path(__file__).parents[2])}
    for attempt in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVER.format(old=OLD, new=NEW), str(source)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "saved", f"the saver died before saving (seed {seed})"
        time.sleep(rng.uniform(0.0, 0.5))  # a few saves of ~0.1 s: anywhere in one of them
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert opened_tokens(tiny_engine, "story") in (OLD, NEW), f"attempt {attempt}, seed {seed}"
        # The open found no one holding the lock, so it removed what the killed save left.
        assert entries(store / "story") == [".lock", "CURRENT", "v-*"], f"attempt {attempt}, seed {seed}"


def test_a_failing_save_keeps_the_old_snapshot_and_cleans_up(tiny_engine: Engine, store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    filled(tiny_engine, OLD).save("story")
    write = snapshot._write_version  # pyright: ignore[reportPrivateUsage]

    def full_disk(path: Path, *args: Any) -> None:
        write(path, *args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot, "_write_version", full_disk)
    with pytest.raises(SnapshotError, match="No space left.*older snapshot of that name is unchanged"):
        filled(tiny_engine, NEW).save("story")
    assert entries(store / "story") == [".lock", "CURRENT", "v-*"]
    assert opened_tokens(tiny_engine, "story") == OLD


def test_leftovers_of_interrupted_saves_are_removed_on_open_and_save(tiny_engine: Engine, store: Path) -> None:
    filled(tiny_engine, OLD).save("story")
    directory = store / "story"
    (directory / f"v-{'0' * 32}" / "kv").mkdir(parents=True)  # a version whose save never switched to it
    (directory / f"CURRENT.v-{'1' * 32}").write_text("v-" + "1" * 32)  # a pointer never renamed into place
    assert opened_tokens(tiny_engine, "story") == OLD
    assert entries(directory) == [".lock", "CURRENT", "v-*"]
    (directory / f"v-{'2' * 32}").mkdir()
    filled(tiny_engine, NEW).save("story")
    assert entries(directory) == [".lock", "CURRENT", "v-*"]
    assert opened_tokens(tiny_engine, "story") == NEW


# ------------------------------------------------------------------------------------------------
# Concurrent writers and readers


def test_concurrent_saves_of_one_name_take_turns(tiny_engine: Engine, store: Path) -> None:
    reader_engine = Engine(tiny_engine.model, paged_kv(1))  # opens donate its own pool, never the savers'
    versions = [filled(tiny_engine, OLD), filled(tiny_engine, NEW)]
    versions[0].save("story")
    errors: list[BaseException] = []
    seen: list[list[int]] = []

    def run(work: Any) -> None:
        try:
            for _ in range(4):
                work()
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(lambda c=c: c.save("story"),)) for c in versions]
    threads.append(threading.Thread(target=run, args=(lambda: seen.append(opened_tokens(reader_engine, "story")),)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert all(tokens in (OLD, NEW) for tokens in seen) and len(seen) == 4
    assert opened_tokens(tiny_engine, "story") in (OLD, NEW)
    assert entries(store / "story") == [".lock", "CURRENT", "v-*"]


# ------------------------------------------------------------------------------------------------
# Damage


def _page_file(directory: Path) -> Path:
    files = [p for p in (directory / (directory / "CURRENT").read_text() / "kv").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)  # the page data, not orbax's small metadata files


def test_bit_flips_in_pages_are_refused(tiny_engine: Engine, store: Path) -> None:
    filled(tiny_engine, OLD).save("story")
    pages = _page_file(store / "story")
    original = pages.read_bytes()
    rng = random.Random(0)
    for _ in range(4):
        flipped = bytearray(original)
        bit = rng.randrange(len(flipped) * 8)
        flipped[bit // 8] ^= 1 << bit % 8
        pages.write_bytes(bytes(flipped))
        used = tiny_engine.kv.pool.num_used
        with pytest.raises(SnapshotError, match="damaged"):
            Context.open(tiny_engine, "story")
        assert tiny_engine.kv.pool.num_used == used
    pages.write_bytes(original)
    assert opened_tokens(tiny_engine, "story") == OLD


def test_pages_that_do_not_match_their_checksum_are_refused(tiny_engine: Engine, store: Path) -> None:
    filled(tiny_engine, OLD).save("story")
    path = current_meta(store / "story")
    meta = json.loads(path.read_text())
    meta["pages_sha256"]["v"][1] = hashlib.sha256(b"other pages").hexdigest()
    meta.pop("meta_sha256")
    meta["meta_sha256"] = snapshot._meta_digest(meta)  # pyright: ignore[reportPrivateUsage]
    path.write_text(json.dumps(meta))
    with pytest.raises(SnapshotError, match="V pages of layer 1 do not match their checksum"):
        Context.open(tiny_engine, "story")


_META_DAMAGE: list[tuple[str, Any]] = [
    ("token_ids", None), ("token_ids", "abc"), ("token_ids", [1.5]), ("token_ids", [10**9]), ("masked", [10**6]),
    ("masked", "all"), ("messages", [["user"]]), ("messages", [[1, 2]]), ("awaiting_reply", "no"), ("kv_len", -1),
    ("kv_len", 10**6), ("kv_len", True), ("present", [True]), ("present", None), ("pages_sha256", {"k": []}),
    ("model", 5), ("layout", None), ("adapters", None), ("adapters", [{"name": "a", "source": None, "sha256": "0", "scale": 1}]),
]


@pytest.mark.parametrize(("key", "value"), _META_DAMAGE)
def test_meta_files_with_missing_keys_or_wrong_types_are_refused(tiny_engine: Engine, store: Path, key: str, value: Any) -> None:
    filled(tiny_engine, OLD).save("story")
    path = current_meta(store / "story")
    meta = json.loads(path.read_text())
    meta.pop("meta_sha256")
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    path.write_text(json.dumps(meta))
    with pytest.raises(SnapshotError, match="checksum"):  # as damage would leave it
        Context.open(tiny_engine, "story")
    meta["meta_sha256"] = snapshot._meta_digest(meta)  # as a hand-made (or buggy) writer would leave it  # pyright: ignore[reportPrivateUsage]
    path.write_text(json.dumps(meta))
    used = tiny_engine.kv.pool.num_used
    with pytest.raises(SnapshotError):
        Context.open(tiny_engine, "story")
    assert tiny_engine.kv.pool.num_used == used


def test_a_damaged_pointer_or_an_old_format_is_refused_and_a_save_repairs_it(tiny_engine: Engine, store: Path) -> None:
    filled(tiny_engine, OLD).save("story")
    (store / "story" / "CURRENT").write_text("../../etc")
    with pytest.raises(SnapshotError, match="CURRENT file names no saved version"):
        Context.open(tiny_engine, "story")
    filled(tiny_engine, NEW).save("story")
    assert opened_tokens(tiny_engine, "story") == NEW
    legacy = store / "legacy"
    legacy.mkdir()
    (legacy / "meta.json").write_text(json.dumps({"format": 2}))
    with pytest.raises(SnapshotError, match="older zgen"):
        Context.open(tiny_engine, "legacy")


# ------------------------------------------------------------------------------------------------
# The model fingerprint


def test_the_fingerprint_catches_a_changed_layer(tiny_engine: Engine, store: Path) -> None:
    model = tiny_engine.model
    filled(tiny_engine, OLD).save("story")
    name = "layers.1.down"  # the last layer's MLP output: the first rows of the embedding are untouched
    changed = model.params[name] + 1e-3 * jax.random.normal(jax.random.key(7), model.params[name].shape)
    twin = dataclasses.replace(model, params={**model.params, name: changed}, attachments={})
    same = dataclasses.replace(model, params=dict(model.params), attachments={})
    assert snapshot.model_fingerprint(same) == snapshot.model_fingerprint(model)
    assert snapshot.model_fingerprint(twin) != snapshot.model_fingerprint(model)
    with pytest.raises(SnapshotError, match="different model"):
        Context.open(Engine(twin, paged_kv(1)), "story")
