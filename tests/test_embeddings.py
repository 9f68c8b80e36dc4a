"""Embeddings: pooled last hidden states equal HF transformers' (after the final norm, same pooling
over the attention mask) in float32, batched or one at a time; the CLI's ``zgen embed``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tests.hf_reference import SMALL, save_random_checkpoint
from zgen import embed, load_model
from zgen.errors import ConfigError, InputError
from zgen.model import Model

TEXTS = [[1, 17, 42, 5, 88], [1, *range(3, 40)], [1], [1, 60, 61, 9, 33, 70, 12, 45, 90, 4, 27]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Any, Path]:
    directory = tmp_path_factory.mktemp("embed")
    hf = save_random_checkpoint(transformers.LlamaConfig(**SMALL, tie_word_embeddings=True), directory)
    return load_model(directory, dtype="float32"), hf, directory


def hf_embeddings(hf: Any, texts: list[list[int]], pooling: str, normalize: bool) -> np.ndarray:
    width = max(map(len, texts))
    ids = torch.tensor([t + [0] * (width - len(t)) for t in texts])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts])
    with torch.no_grad():
        hidden = hf.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    lengths = mask.sum(1)
    m = mask[..., None].bool()
    if pooling == "mean":
        pooled = (hidden * m).sum(1) / lengths[:, None]
    elif pooling == "max":
        pooled = hidden.masked_fill(~m, -torch.inf).max(1).values
    elif pooling == "last":
        pooled = hidden[torch.arange(len(texts)), lengths - 1]
    else:
        pooled = hidden[:, 0]
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
    return pooled.numpy()


@pytest.mark.parametrize("pooling", ["mean", "last", "cls", "max"])
@pytest.mark.parametrize("normalize", [True, False])
def test_matches_transformers(pair: tuple[Model, Any, Path], pooling: str, normalize: bool) -> None:
    model, hf, _ = pair
    ours = embed(model, TEXTS, pooling=pooling, normalize=normalize, batch_size=2)  # type: ignore[arg-type]
    ref = hf_embeddings(hf, TEXTS, pooling, normalize)
    assert ours.shape == (len(TEXTS), SMALL["hidden_size"]) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    one = embed(model, TEXTS[3], pooling=pooling, normalize=normalize)  # type: ignore[arg-type]
    np.testing.assert_allclose(one, ours[3], atol=1e-5)


def test_text_and_errors(pair: tuple[Model, Any, Path]) -> None:
    model, _, _ = pair
    batch = embed(model, ["w17 w42 w5", "w9"])
    np.testing.assert_allclose(embed(model, "w9"), batch[1], atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    with pytest.raises(ConfigError, match="pooling"):
        embed(model, "w9", pooling="sum")  # type: ignore[arg-type]
    with pytest.raises(InputError):
        embed(model, [])
    with pytest.raises(InputError):
        embed(model, [[1, 500]])
    with pytest.raises(InputError):
        embed(model, [[1] * 300])


def test_cli_embed(pair: tuple[Model, Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from zgen.cli import app

    model, _, directory = pair
    monkeypatch.setenv("ZGEN_XLA_CACHE_DIR", str(tmp_path / "xla"))
    texts = ["w17 w42 w5", "w9 w10", "w3"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"id": f"t{i}", "text": t}) for i, t in enumerate(texts)) + "\n")
    expected = embed(model, texts, pooling="last")
    for source in ("in.txt", "in.jsonl"):
        output = tmp_path / f"{source}.out.jsonl"
        args = ["embed", "-m", str(directory), "--pooling", "last", "--input", str(tmp_path / source), "--output", str(output)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in output.read_text().splitlines()]
        np.testing.assert_allclose([r["embedding"] for r in rows], expected, atol=1e-5)
        assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["id"] for r in rows] == ["t0", "t1", "t2"]
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    bad = CliRunner().invoke(app, ["embed", "-m", str(directory), "--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "o")])
    assert bad.exit_code == 2 and "text" in bad.output and not (tmp_path / "o").exists()
