"""The converted-GGUF weight cache: keyed by content, one entry per model file name, with progress."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from tiny_gguf import tiny_tensors, write_tiny_gguf
from zgen.model import load_model


def _gguf(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True)
    return write_tiny_gguf(path, tensors=tiny_tensors(seed))


def test_the_cache_is_keyed_by_content_and_replaces_stale_entries(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    converted = cache / "converted"
    unrelated = converted / "other-model-0123456789abcdef.safetensors"
    unrelated.parent.mkdir(parents=True)
    unrelated.write_bytes(b"another model's entry")

    reports: list[tuple[int, int]] = []
    first = load_model(_gguf(tmp_path / "a" / "tiny.gguf"), cache_dir=cache, progress=lambda *r: reports.append(r))
    assert first.load_timings.source == "gguf"
    done = [d for d, _ in reports]
    assert done == sorted(done) and done[0] == 0 and reports[-1][0] == reports[-1][1] > 0
    entry = set(converted.iterdir()) - {unrelated}
    assert len(entry) == 1

    # The same bytes elsewhere with another modification time (a reinstall, a copy) find the entry.
    copy = tmp_path / "b" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "a" / "tiny.gguf", copy)
    os.utime(copy, (1_000_000, 1_000_000))
    reports.clear()
    again = load_model(copy, cache_dir=cache, progress=lambda *r: reports.append(r))
    assert again.load_timings.source == "converted-cache"
    assert reports == []  # nothing to convert
    assert set(converted.iterdir()) == entry | {unrelated}

    # Other weights under the same file name replace the entry rather than pile up beside it.
    changed = load_model(_gguf(tmp_path / "c" / "tiny.gguf", seed=1), cache_dir=cache)
    assert changed.load_timings.source == "gguf"
    replaced = set(converted.iterdir()) - {unrelated}
    assert len(replaced) == 1 and replaced != entry
    assert unrelated.exists()
    assert not np.allclose(np.asarray(changed.params["embed"]), np.asarray(first.params["embed"]))
