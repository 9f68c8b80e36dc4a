"""``zgen generate`` with a speculator: the same tokens as without, the figures in --json, and flag
mistakes refused before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hf_reference import save_random_checkpoint, small_configs
from zgen.cli import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def private_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZGEN_CACHE_DIR", str(tmp_path / "weights"))
    monkeypatch.setenv("ZGEN_XLA_CACHE_DIR", str(tmp_path / "xla"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-hf")
    save_random_checkpoint(small_configs()["llama_tied"], directory)
    return directory


def test_speculators_give_the_plain_tokens_and_report_figures(hf_dir: Path) -> None:
    args = ["generate", "--model", str(hf_dir), "-p", "w3 w4 w5 w3 w4 w5 w3", "-n", "16", "--ignore-eos", "--temperature", "0", "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    assert plain["speculative"] is None
    for flags in (["--prompt-lookup"], ["--draft-model", str(hf_dir), "--num-draft-tokens", "3"], ["--early-exit", "1"]):
        result = runner.invoke(app, [*args, *flags])
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["token_ids"] == plain["token_ids"], flags
        figures = out["speculative"]
        assert set(figures) == {"draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_per_step"}
        assert 0 <= figures["accepted_tokens"] <= figures["draft_tokens"] and 0.0 <= figures["acceptance_rate"] <= 1.0


def test_draft_trees_from_the_command_line_give_the_plain_tokens(hf_dir: Path, tmp_path: Path) -> None:
    args = ["generate", "--model", str(hf_dir), "-p", "w3 w4 w5 w3 w4 w5 w3", "-n", "16", "--ignore-eos", "--temperature", "0", "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    for flags in (["--early-exit", "1", "--draft-tree", "2x4"], ["--draft-model", str(hf_dir), "--num-draft-tokens", "3", "--draft-tree", "3X6"]):
        result = runner.invoke(app, [*args, *flags])
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["token_ids"] == plain["token_ids"], flags
        assert out["speculative"]["draft_tokens"] > 0
    # The batch job takes the same flag.
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({
        "custom_id": "a", "method": "POST", "url": "/v1/completions",
        "body": {"model": "m", "prompt": "w3 w4 w5 w3 w4 w5 w3", "max_tokens": 16, "temperature": 0},
    }) + "\n")
    batch = ["batch", "--model", str(hf_dir), "--input", str(source), "--quiet"]
    outputs = {}
    for name, flags in (("plain", []), ("tree", ["--early-exit", "1", "--draft-tree", "2x4"])):
        result = runner.invoke(app, [*batch, "--output", str(tmp_path / f"{name}.jsonl"), *flags])
        assert result.exit_code == 0, result.output
        outputs[name] = json.loads((tmp_path / f"{name}.jsonl").read_text())["response"]["body"]["choices"][0]["text"]
    assert outputs["tree"] == outputs["plain"]
    refused = runner.invoke(app, [*batch, "--output", str(tmp_path / "bad.jsonl"), "--jacobi", "--draft-tree", "2x4"])
    assert refused.exit_code == 2 and "'--draft-tree'" in refused.stderr and not (tmp_path / "bad.jsonl").exists()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["generate", "--prompt-lookup", "--early-exit", "2"], "'--prompt-lookup'"),
        (["generate", "--num-draft-tokens", "4"], "'--num-draft-tokens'"),
        (["generate", "--prompt-lookup", "--num-draft-tokens", "0"], "'--num-draft-tokens'"),
        (["generate", "--prompt-lookup", "--num-draft-tokens", "33"], "'--num-draft-tokens'"),
        (["generate", "--early-exit", "0"], "'--early-exit'"),
        (["generate", "--prompt-lookup", "--kv-cache", "compressed"], "'--kv-cache'"),
        (["generate", "--draft-model", "/no/such/model"], "'--draft-model'"),
        (["generate", "--draft-tree", "4x16"], "'--draft-tree'"),
        (["generate", "--prompt-lookup", "--draft-tree", "4x16"], "'--draft-tree'"),
        (["generate", "--early-exit", "2", "--draft-tree", "4by16"], "'--draft-tree'"),
        (["generate", "--early-exit", "2", "--draft-tree", "0x16"], "'--draft-tree'"),
    ],
)
def test_bad_speculative_flags_fail_before_anything_loads(args: list[str], flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_load(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("zgen.cli.load_model", must_not_load)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert flag in result.stderr


def test_help_names_the_speculators() -> None:
    out = runner.invoke(app, ["generate", "--help"]).stdout
    for flag in ("--prompt-lookup", "--draft-model", "--early-exit", "--num-draft-tokens", "--draft-tree"):
        assert flag in out
