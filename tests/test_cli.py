"""The zgen command line: generation on the real SmolLM2, and flags, progress, defaults, info and caches
on tiny models."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hf_reference import save_random_checkpoint, small_configs
from tiny_gguf import write_tiny_gguf
from zgen.cli import app, recommended_sampling

runner = CliRunner()


@pytest.fixture(autouse=True)
def private_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cache in a temporary directory; progress off unless a test turns it on; wide lines."""
    monkeypatch.setenv("ZGEN_CACHE_DIR", str(tmp_path / "weights"))
    monkeypatch.setenv("ZGEN_XLA_CACHE_DIR", str(tmp_path / "xla"))
    monkeypatch.setenv("ZGEN_STORE_DIR", str(tmp_path / "contexts"))
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-hf")
    save_random_checkpoint(small_configs()["llama_tied"], directory)
    return directory


# -- SmolLM2 ------------------------------------------------------------------------------------------


@pytest.fixture
def smollm2_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real model's converted weights from the usual cache (converting them per test costs ~10 s)."""
    monkeypatch.delenv("ZGEN_CACHE_DIR")


@pytest.mark.usefixtures("smollm2_cache")
def test_generate_json_is_greedy_and_complete() -> None:
    args = ["generate", "--prompt", "The capital of France is", "--temperature", "0", "--max-new-tokens", "6", "--ignore-eos", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) >= {"text", "token_ids", "prompt_token_ids", "logprobs", "usage", "timings"}
    assert len(out["token_ids"]) == out["usage"]["completion_tokens"] == 6
    assert out["usage"]["prompt_tokens"] == len(out["prompt_token_ids"])
    assert all(lp <= 0 for lp in out["logprobs"])
    timings = out["timings"]
    assert set(timings) == {"load_s", "compile_s", "first_token_s", "decode_s", "total_s", "decode_tokens_per_s"}
    assert 0 < timings["first_token_s"] <= timings["total_s"]


@pytest.mark.usefixtures("smollm2_cache")
def test_generate_streams_text_and_honours_stop() -> None:
    args = ["generate", "-p", "1, 2, 3, 4,", "--temperature", "0", "-n", "20", "--stop", " 7", "--stop", " 9"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == " 5, 6,\n"  # streamed text ends with a newline


@pytest.mark.usefixtures("smollm2_cache")
def test_chat_flag() -> None:
    result = runner.invoke(app, ["generate", "--chat", "-p", "Say hi.", "--temperature", "0", "-n", "12", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"]


def test_chat_loop_streams_replies_until_empty_line(small_chat_checkpoint: tuple[Path, Any]) -> None:
    """On the two-layer chat model (SmolLM2's tokenizer and chat template): the loop, not the replies' words."""
    args = ["chat", "--model", str(small_chat_checkpoint[0]), "--temperature", "0", "--max-new-tokens", "12"]
    result = runner.invoke(app, args, input="Hello!\nAnd again?\n\n")
    assert result.exit_code == 0, result.output
    replies = [line for line in result.stdout.splitlines() if "zgen>" in line]
    assert len(replies) == 2
    assert all(line.split("zgen>", 1)[1].strip() for line in replies)


# -- flags --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["generate", "--kv-cache", "bogus"], "'--kv-cache'"),
        (["generate", "--kv-dtype", "q5"], "'--kv-dtype'"),
        (["generate", "--temperature", "-1"], "'--temperature'"),
        (["generate", "-n", "0"], "'--max-new-tokens'"),
        (["generate", "--top-p", "0"], "'--top-p'"),
        (["generate", "--top-k", "-2"], "'--top-k'"),
        (["generate", "--min-p", "1.5"], "'--min-p'"),
        (["generate", "--repetition-penalty", "0"], "'--repetition-penalty'"),
        (["generate", "--dtype", "float64"], "'--dtype'"),
        (["generate", "--stop", ""], "'--stop'"),
        (["generate", "--prompt", ""], "'--prompt'"),
        (["generate", "--kv-cache", "tensor", "--kv-dtype", "q4"], "'--kv-dtype'"),
        (["generate", "--kv-cache", "compressed", "--prefix-cache"], "'--prefix-cache'"),
        (["generate", "--model", "/no/such/model"], "'--model'"),
        (["generate", "--chat", "true"], "true"),
        (["chat", "--kv-cache", "flat", "--kv-dtype", "fp8"], "'--kv-dtype'"),
        (["chat", "--temperature", "nan"], "'--temperature'"),
        (["eval", "ppl", "--text-file", "/no/such/file.txt"], "'--text-file'"),
        (["eval", "ppl", "--text-file", __file__, "--window", "1"], "'--window'"),
        (["eval", "ppl", "--text-file", __file__, "--window", "16", "--chunk", "32"], "'--chunk'"),
        (["generate", "--weights", "int3"], "'--weights'"),
        (["chat", "--weights", "gguf", "--model", str(Path(__file__).parent)], "'--weights'"),
    ],
)
def test_bad_flags_fail_before_anything_loads(args: list[str], flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_load(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("zgen.cli.load_model", must_not_load)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert flag in result.stderr
    for python_name in ("paged_kv", "tiered_kv", "SamplingConfig", "cache_kind", "Traceback"):
        assert python_name not in result.output


def test_help_names_no_value_for_switches_and_explains_defaults() -> None:
    result = runner.invoke(app, ["generate", "--help"])
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout
    assert "generation_config.json" in result.stdout
    assert "lossy" in result.stdout  # --kv-cache compressed
    assert "slower" in result.stdout  # --kv-dtype on CPU


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"zgen {importlib.metadata.version('zgen')}\n"


# -- sampling defaults --------------------------------------------------------------------------------


def test_recommended_sampling_reads_generation_config(tmp_path: Path) -> None:
    config = tmp_path / "generation_config.json"
    assert recommended_sampling(tmp_path) == {}
    config.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 2}))
    assert recommended_sampling(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    config.write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert recommended_sampling(tmp_path) == {"temperature": 0.0}


def test_a_model_that_recommends_greedy_decodes_greedily_by_default(hf_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "greedy-model"
    model.mkdir()
    for file in hf_dir.iterdir():
        (model / file.name).symlink_to(file)
    (model / "generation_config.json").unlink(missing_ok=True)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 2}))
    args = ["generate", "--model", str(model), "-p", "w3 w4 w5", "-n", "8", "--ignore-eos", "--json"]
    default = json.loads(runner.invoke(app, args).stdout)
    greedy = json.loads(runner.invoke(app, [*args, "--temperature", "0"]).stdout)
    assert default["token_ids"] == greedy["token_ids"]
    sampled = [json.loads(runner.invoke(app, [*args, "--temperature", "5", "--seed", str(s)]).stdout) for s in (1, 2)]
    assert sampled[0]["token_ids"] != sampled[1]["token_ids"]  # the flag overrides the recommendation


# -- progress -----------------------------------------------------------------------------------------


def test_a_first_run_shows_its_phases_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich takes stderr for a terminal
    args = ["generate", "--model", str(model), "-p", "abc", "-n", "4", "--temperature", "0", "--ignore-eos"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    for phase in (f"Model {model}", "Sampling: greedy", "Converted the GGUF weights", "First token"):
        assert phase in first.stderr
    again = runner.invoke(app, args)
    assert "Loaded the converted weights from the cache" in again.stderr
    assert again.stdout == first.stdout


@pytest.mark.parametrize(
    ("terminal", "flags"), [(False, []), (True, ["--quiet"]), (True, ["--json"])], ids=["not-a-terminal", "quiet", "json"]
)
def test_progress_stays_off(terminal: bool, flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    if terminal:
        monkeypatch.setenv("TTY_COMPATIBLE", "1")
    result = runner.invoke(app, ["generate", "--model", str(model), "-p", "abc", "-n", "2", "--temperature", "0", *flags])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert result.stdout


def test_eval_ppl_shows_its_phases(hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 90 + 3}" for i in range(40)))
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    result = runner.invoke(app, ["eval", "ppl", "--model", str(hf_dir), "--text-file", str(text), "--window", "16", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens_scored"] == 15 + 15 + 7  # windows of 16, 16 and 8 tokens
    assert result.stderr == ""  # --json
    shown = runner.invoke(app, ["eval", "ppl", "--model", str(hf_dir), "--text-file", str(text), "--window", "16"])
    assert shown.exit_code == 0, shown.output
    assert "Loaded the weights" in shown.stderr and "Scoring 40 tokens in windows of 16" in shown.stderr


# -- info and caches ----------------------------------------------------------------------------------


def _fill_caches(root: Path) -> dict[str, Path]:
    """A file in each cache, as zgen would leave them."""
    entries = {
        "weights": root / "weights" / "converted" / "tiny-0123456789abcdef.safetensors",
        "xla": root / "xla" / "jit_step-abc-cache",
        "contexts": root / "contexts" / "colors" / "meta.json",
    }
    for path in entries.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
    return entries


def test_info_reports_versions_devices_and_caches(tmp_path: Path) -> None:
    _fill_caches(tmp_path)
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["zgen"] == importlib.metadata.version("zgen")
    assert report["packages"]["jax"] == importlib.metadata.version("jax")
    assert report["devices"]
    assert report["caches"] == {
        "weights": {"path": str(tmp_path / "weights" / "converted"), "bytes": 1000, "entries": 1},
        "xla": {"path": str(tmp_path / "xla"), "bytes": 1000, "entries": 1},
        "contexts": {"path": str(tmp_path / "contexts"), "bytes": 1000, "entries": 1},
    }
    plain = runner.invoke(app, ["info"])
    assert plain.exit_code == 0, plain.output
    assert f"weights: 1.0 kB in 1 entry, {tmp_path / 'weights' / 'converted'}" in plain.stdout


def test_cache_ls_and_clear(tmp_path: Path) -> None:
    entries = _fill_caches(tmp_path)
    listed = runner.invoke(app, ["cache", "ls"])
    assert listed.exit_code == 0, listed.output
    assert "tiny-0123456789abcdef.safetensors" in listed.stdout and "colors" in listed.stdout

    cleared = runner.invoke(app, ["cache", "clear", "--weights"])
    assert cleared.exit_code == 0, cleared.output
    assert "weights: removed 1 entry, 1.0 kB" in cleared.stdout
    assert not entries["weights"].exists() and entries["weights"].parent.is_dir()
    assert entries["xla"].exists() and entries["contexts"].exists()

    everything = runner.invoke(app, ["cache", "clear"])
    assert everything.exit_code == 0, everything.output
    assert not entries["xla"].exists() and not entries["contexts"].parent.exists()
    assert (tmp_path / "xla").is_dir() and (tmp_path / "contexts").is_dir()
