"""Beam search on engine forks: the same beams and scores as HF transformers' beam search (float32, a
tiny random Llama), with and without EOS reached, several beam counts, length penalties and
early-stopping modes; the CLI's --num-beams and --early-stopping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tests.hf_reference import SMALL, save_random_checkpoint
from zgen import Engine, EngineConfig, Generator, SamplingConfig, load_model
from zgen.cache.factory import paged_kv
from zgen.cache.formats import bytes_per_token_per_layer
from zgen.errors import ConfigError
from zgen.model import Model
from zgen.runtime.beam import beam_search

PROMPT = [1, 17, 42, 5, 88, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Any, Path]:
    directory = tmp_path_factory.mktemp("beam")
    hf = save_random_checkpoint(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False), directory)
    return load_model(directory, dtype="float32"), hf, directory


def hf_beams(hf: Any, prompt: list[int], n: int, new: int, eos: list[int], lp: float, es: bool | str) -> list[tuple[list[int], float]]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), num_beams=n,
            num_return_sequences=n, do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=eos[0],
            length_penalty=lp, early_stopping=es, output_scores=True, return_dict_in_generate=True,
        )
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    return [
        (out.sequences[i, len(prompt) : len(prompt) + lengths[i]].tolist(), float(out.sequences_scores[i]))
        for i in range(n)
    ]


def assert_same(ours: list[Any], ref: list[tuple[list[int], float]]) -> None:
    assert [b.token_ids for b in ours] == [tokens for tokens, _ in ref]
    np.testing.assert_allclose([b.score for b in ours], [score for _, score in ref], atol=1e-4)


def test_one_beam_is_greedy(pair: tuple[Model, Any, Path]) -> None:
    model, _, _ = pair
    generator = Generator(model)
    (beam,) = generator.beam_search(PROMPT, 1, length_penalty=0.5, max_new_tokens=8)
    greedy = generator.generate(PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    assert beam.token_ids == greedy.token_ids
    assert beam.score == pytest.approx(sum(greedy.logprobs) / 8**0.5, abs=1e-4)


@pytest.mark.parametrize(("num_beams", "length_penalty"), [(3, 1.0), (4, 0.6), (5, -0.5)])
def test_without_eos_matches_transformers(pair: tuple[Model, Any, Path], num_beams: int, length_penalty: float) -> None:
    model, hf, _ = pair
    ours = Generator(model).beam_search(PROMPT, num_beams, length_penalty=length_penalty, max_new_tokens=8)
    assert_same(ours, hf_beams(hf, PROMPT, num_beams, 8, [10_000], length_penalty, False))
    assert all(b.finish_reason == "length" and len(b.token_ids) == 8 for b in ours)


@pytest.mark.parametrize(
    ("num_beams", "length_penalty", "early_stopping"), [(2, 1.0, False), (4, 0.0, True), (4, 0.5, "never"), (3, 1.0, "never")]
)
def test_with_eos_matches_transformers(
    pair: tuple[Model, Any, Path], num_beams: int, length_penalty: float, early_stopping: bool | str
) -> None:
    model, hf, _ = pair
    # End-of-sequence ids the beams really reach: tokens HF's own search produces early.
    free = hf_beams(hf, PROMPT, num_beams, 6, [10_000], length_penalty, False)
    eos = sorted({free[0][0][2], free[-1][0][1]})
    ref = hf_beams(hf, PROMPT, num_beams, 10, eos, length_penalty, early_stopping)
    assert any(tokens[-1] in eos for tokens, _ in ref)  # some beam really finished on an EOS
    ours = beam_search(
        Engine(model), PROMPT, num_beams=num_beams, max_new_tokens=10, eos_token_ids=eos,
        length_penalty=length_penalty, early_stopping=early_stopping,
    )
    assert_same(ours, ref)
    assert {b.finish_reason for b in ours if b.token_ids[-1] in eos} <= {"stop"}


def test_beams_share_pages_and_leave_nothing_behind(pair: tuple[Model, Any, Path]) -> None:
    model, _, _ = pair
    # 16 pages of 16 tokens: the 96-token prompt takes 6, so 4 beams fit only if they share them.
    page_bytes = 16 * model.config.num_layers * bytes_per_token_per_layer("fp32", model.config.num_kv_heads, model.config.head_dim)
    engine = Engine(model, paged_kv(16 * page_bytes / 2**20), config=EngineConfig(on_pool_exhausted="error"))
    pool = getattr(engine.kv, "pool")
    assert pool.num_blocks == 16
    beams = beam_search(engine, PROMPT * 16, num_beams=4, max_new_tokens=6, eos_token_ids=[])
    assert beams == beam_search(Engine(model), PROMPT * 16, num_beams=4, max_new_tokens=6, eos_token_ids=[])
    assert len(beams) == 4 and pool.num_used == 0  # every fork was released
    generator = Generator(model)
    with pytest.raises(ConfigError, match="num_beams"):
        generator.beam_search(PROMPT, 0)
    with pytest.raises(ConfigError, match="early_stopping"):
        generator.beam_search(PROMPT, 2, early_stopping="sometimes")  # type: ignore[arg-type]


def test_cli_num_beams(pair: tuple[Model, Any, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from zgen.cli import app

    model, _, directory = pair
    monkeypatch.setenv("ZGEN_XLA_CACHE_DIR", str(tmp_path / "xla"))
    args = ["generate", "-m", str(directory), "-p", "w17 w42 w5", "-n", "6", "--num-beams", "3", "--length-penalty", "0.7", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    beams = json.loads(result.stdout)["beams"]
    expected = Generator(model).beam_search("w17 w42 w5", 3, length_penalty=0.7, max_new_tokens=6)
    assert [b["token_ids"] for b in beams] == [b.token_ids for b in expected]
    np.testing.assert_allclose([b["score"] for b in beams], [b.score for b in expected], atol=1e-5)
    assert all(isinstance(b["text"], str) for b in beams)
    text = CliRunner().invoke(app, args[:-1])
    assert text.exit_code == 0 and text.stdout.strip() == expected[0].text.strip()


def test_cli_early_stopping_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from zgen.cli import app

    # Token 47 is one the beams of this seed reach after two tokens: with it as EOS the three modes differ.
    directory = tmp_path / "eos47"
    save_random_checkpoint(transformers.LlamaConfig(**{**SMALL, "eos_token_id": 47}, tie_word_embeddings=False), directory)
    model = load_model(directory, dtype="float32")
    monkeypatch.setenv("ZGEN_XLA_CACHE_DIR", str(tmp_path / "xla"))
    base = ["generate", "-m", str(directory), "-p", "w17 w42 w5", "-n", "8", "--num-beams", "3", "--json"]
    outputs = {}
    for flag, setting in (("true", True), ("never", "never"), ("false", False)):
        result = CliRunner().invoke(app, [*base, "--early-stopping", flag])
        assert result.exit_code == 0, result.output
        beams = json.loads(result.stdout)["beams"]
        expected = Generator(model).beam_search("w17 w42 w5", 3, early_stopping=setting, max_new_tokens=8)
        assert [b["token_ids"] for b in beams] == [b.token_ids for b in expected]
        np.testing.assert_allclose([b["score"] for b in beams], [b.score for b in expected], atol=1e-5)
        outputs[flag] = [b["token_ids"] for b in beams]
    assert outputs["true"] != outputs["never"]  # the flag really reached the search
    default = CliRunner().invoke(app, base)
    assert default.exit_code == 0 and [b["token_ids"] for b in json.loads(default.stdout)["beams"]] == outputs["false"]

    def must_not_load(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("zgen.cli.load_model", must_not_load)
    for flags, message in (
        (["--early-stopping", "sometimes", "--num-beams", "3"], "'sometimes' is not one of true, false, never"),
        (["--early-stopping", "never"], "--early-stopping applies to beam search; add --num-beams N with N > 1"),
    ):
        refused = CliRunner().invoke(app, ["generate", "-m", str(directory), "-p", "w17", *flags])
        assert refused.exit_code == 2, refused.output
        assert message in " ".join(refused.stderr.replace("│", " ").split())
    helped = " ".join(CliRunner().invoke(app, ["generate", "--help"]).output.replace("│", " ").split())
    assert "never once it cannot at the longest length it could reach" in helped
