"""The zgen command line, on the real SmolLM2."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from zgen.cli import app

runner = CliRunner()


def test_generate_json_is_greedy_and_complete() -> None:
    args = ["generate", "--prompt", "The capital of France is", "--temperature", "0", "--max-new-tokens", "6", "--ignore-eos", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) >= {"text", "token_ids", "prompt_token_ids", "logprobs", "usage", "timings"}
    assert len(out["token_ids"]) == out["usage"]["completion_tokens"] == 6
    assert out["usage"]["prompt_tokens"] == len(out["prompt_token_ids"])
    assert all(lp <= 0 for lp in out["logprobs"])
    again = json.loads(runner.invoke(app, args).stdout)
    assert again["token_ids"] == out["token_ids"]


def test_generate_streams_text_and_honours_stop() -> None:
    args = ["generate", "-p", "1, 2, 3, 4,", "--temperature", "0", "-n", "20", "--stop", " 7"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "5, 6,"


def test_chat_flag_and_bad_model() -> None:
    result = runner.invoke(app, ["generate", "--chat", "-p", "Say hi.", "--temperature", "0", "-n", "12", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"]
    bad = runner.invoke(app, ["generate", "--model", "/no/such/model", "-p", "x"])
    assert bad.exit_code == 2
    assert "ModelNotFoundError" in bad.stderr


def test_chat_loop_reads_until_empty_line() -> None:
    result = runner.invoke(app, ["chat", "--temperature", "0", "--max-new-tokens", "12"], input="Hello!\n\n")
    assert result.exit_code == 0, result.output
    assert "zgen>" in result.stdout
