"""The converted-GGUF weight cache: keyed by content, one entry per model file name, with progress."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from tiny_gguf import default_metadata, tiny_tensors, write_tiny_gguf
from zgen.loading.builtin import builtin_model_path
from zgen.loading.gguf_file import header_extent
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


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_the_header_walk_finds_where_gguf_reads_the_tensor_data(tmp_path: Path, alignment: int | None) -> None:
    """The content key is computed without gguf's reader: the header walk's data offset is the reader's,
    whatever the file's alignment."""

    def metadata(writer: gguf.GGUFWriter) -> None:
        default_metadata(writer)
        if alignment is not None:
            writer.add_custom_alignment(alignment)

    for path in [write_tiny_gguf(tmp_path / "tiny.gguf", metadata)] + ([builtin_model_path("smollm2")] if alignment is None else []):
        assert header_extent(path) == gguf.GGUFReader(path).data_offset


def test_an_entry_carries_the_config_and_tokenizer_so_a_hit_never_parses_the_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit reads the model's config and tokenizer from the entry's metadata, equal to the file's own,
    without gguf's reader. An entry described by other code (an older zgen) or damaged metadata is
    described again from the file, keeping its converted weights."""
    cache, path = tmp_path / "cache", _gguf(tmp_path / "a" / "tiny.gguf")
    first = load_model(path, cache_dir=cache)
    [entry] = (cache / "converted").iterdir()

    def unread(*_: object, **__: object) -> None:
        raise AssertionError("a cache hit parsed the GGUF")

    with monkeypatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", unread)
        hit = load_model(path, cache_dir=cache)
    assert hit.load_timings.source == "converted-cache" and hit.config == first.config
    assert hit.tokenizer.backend.to_str() == first.tokenizer.backend.to_str()
    assert (hit.tokenizer.bos_id, hit.tokenizer.eos_ids, hit.tokenizer.chat_template, hit.tokenizer.add_bos) == (
        first.tokenizer.bos_id, first.tokenizer.eos_ids, first.tokenizer.chat_template, first.tokenizer.add_bos,
    )
    text = "a b 12 c"
    assert hit.tokenizer.encode(text) == first.tokenizer.encode(text)

    described, weights = _metadata(entry), load_file(entry)
    for metadata in ({}, {**described, "zgen.config": "{not json"}):
        save_file(weights, entry, metadata=metadata)
        again = load_model(path, cache_dir=cache)  # its weights from the entry, its description from the file
        assert again.load_timings.source == "converted-cache" and again.config == first.config
        assert _metadata(entry) == described


def _metadata(entry: Path) -> dict[str, str]:
    with safe_open(str(entry), framework="np") as handle:
        return dict(handle.metadata() or {})
