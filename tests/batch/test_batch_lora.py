"""LoRA modules in batch jobs: requests pick an adapter by ``model`` or ``lora`` and run beside base
requests, each giving what it gives alone; bad names become error records; adapters that do not fit
are refused before the job; resuming needs the same modules; the summary reads the engine's metrics."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from batch_helpers import by_id, chat_line, completion_line, read_records, save_random_adapter, save_tiny_chat_model, words
from zgen import Generator, SamplingConfig, load_adapter, load_model
from zgen.batch import run
from zgen.batch.adapters import modules_file
from zgen.cli import app
from zgen.errors import AdapterError, ConfigError, InputError
from zgen.lora import random_adapter
from zgen.model import Model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = words(5, 9, 14, 20, 27, 33, 41)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch-lora")
    base = save_tiny_chat_model(root / "base")
    return {
        "base": base,
        "a": save_random_adapter(base, root / "a", 1, r=4, lora_alpha=16, target_modules=TARGETS),
        "b": save_random_adapter(base, root / "b", 2, r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def model(dirs: dict[str, Path]) -> Model:
    return load_model(dirs["base"])


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def line(custom_id: str, url: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def greedy(n: int) -> SamplingConfig:
    return SamplingConfig(temperature=0.0, max_new_tokens=n)


def test_mixed_adapters_equal_each_request_alone(model: Model, dirs: dict[str, Path], tmp_path: Path) -> None:
    b = load_adapter(dirs["b"])
    lines = [
        completion_line("base", PROMPT, max_tokens=8, temperature=0),  # "model": "tiny", the base name
        completion_line("a-by-model", PROMPT, max_tokens=8, temperature=0, model="A"),
        completion_line("b-by-lora", PROMPT, max_tokens=8, temperature=0, lora="B"),  # model "tiny" + lora
        line("a-by-lora", "/v1/completions", prompt=[7, 8, 9, 10], max_tokens=6, temperature=0, lora="A"),  # no model
        chat_line("b-chat", words(11, 12, 13), max_tokens=5, temperature=0, model="B", logprobs=True, top_logprobs=2),
        line("base-no-model", "/v1/completions", prompt=[7, 8, 9, 10], max_tokens=6, temperature=0),
        completion_line("unknown-model", PROMPT, model="C"),
        completion_line("unknown-lora", PROMPT, lora="C"),
        completion_line("two-names", PROMPT, model="A", lora="B"),
        completion_line("bad-lora", PROMPT, lora=5),
    ]
    summary = run(
        model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl",
        model_name="tiny", lora_modules={"A": dirs["a"], "B": (b, 0.7)}, max_batch_size=8, progress=False,
        summary=tmp_path / "summary.json",
    )
    records = by_id(read_records(tmp_path / "out.jsonl"))
    errors = {key: (r["error"]["code"], r["error"]["param"]) for key, r in records.items() if r["error"]}
    assert errors == {
        "unknown-model": ("model_not_found", "model"), "unknown-lora": ("model_not_found", "lora"),
        "two-names": ("invalid_parameter", "lora"), "bad-lora": ("invalid_parameter", "lora"),
    }
    a = load_adapter(dirs["a"])
    generator = Generator(model)
    expected = {
        "base": (PROMPT, 8, None, "tiny"), "a-by-model": (PROMPT, 8, a, "A"), "b-by-lora": (PROMPT, 8, (b, 0.7), "B"),
        "a-by-lora": ([7, 8, 9, 10], 6, a, "A"), "base-no-model": ([7, 8, 9, 10], 6, None, "tiny"),
    }
    texts: dict[str, str] = {}
    for key, (prompt, n, adapter, name) in expected.items():
        body = records[key]["response"]["body"]
        alone = generator.generate(prompt, greedy(n), adapter=adapter)
        texts[key] = body["choices"][0]["text"]
        assert (texts[key], body["usage"]["completion_tokens"], body["model"]) == (alone.text, len(alone.token_ids), name), key
    assert len({texts["base"], texts["a-by-model"], texts["b-by-lora"]}) == 3  # each adapter really changes the tokens
    chat = records["b-chat"]["response"]["body"]
    alone = generator.chat([{"role": "user", "content": words(11, 12, 13)}], greedy(5), adapter=(b, 0.7))
    assert chat["model"] == "B" and chat["choices"][0]["message"]["content"] == alone.text
    scored = [entry["logprob"] for entry in chat["choices"][0]["logprobs"]["content"]]  # the scoring pass has the adapter too
    assert scored == pytest.approx(alone.logprobs, abs=1e-4)

    ok = [r["response"]["body"] for r in records.values() if r["error"] is None]
    assert (summary.succeeded, summary.failed, summary.generations) == (6, 4, 6)
    assert summary.completion_tokens == sum(body["usage"]["completion_tokens"] for body in ok)
    assert summary.prompt_tokens == sum(body["usage"]["prompt_tokens"] for body in ok)
    assert summary.output_tokens_per_s > 0
    for percentiles in (summary.time_to_first_token_s, summary.inter_token_latency_s):
        assert percentiles is not None and 0 < percentiles.p50 <= percentiles.p90 <= percentiles.p99
    assert "time to first token p50" in summary.describe() and "inter-token latency p50" in summary.describe()
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["completion_tokens"] == summary.completion_tokens
    assert set(written["time_to_first_token_s"]) == {"p50", "p90", "p99"}


def test_without_modules_a_lora_field_is_an_error_and_model_is_ignored(model: Model, tmp_path: Path) -> None:
    lines = [completion_line("any-model", PROMPT, max_tokens=3, model="gpt-4o-mini"), completion_line("lora", PROMPT, lora="A")]
    summary = run(model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", progress=False)
    records = by_id(read_records(tmp_path / "out.jsonl"))
    assert records["any-model"]["response"]["body"]["model"] == "gpt-4o-mini"
    assert records["lora"]["error"]["code"] == "invalid_parameter" and "registers no LoRA modules" in records["lora"]["error"]["message"]
    assert (summary.succeeded, summary.failed) == (1, 1)
    assert not modules_file(tmp_path / "out.jsonl").exists()


def test_adapters_that_do_not_fit_are_refused_before_the_job(model: Model, dirs: dict[str, Path], tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", [completion_line("r", PROMPT, model="X")])
    deeper = random_adapter(replace(model.config, num_layers=model.config.num_layers + 1), 2)
    with pytest.raises(AdapterError, match="model has 2 layers"):
        run(model, source, tmp_path / "out.jsonl", lora_modules={"X": deeper}, progress=False)
    with pytest.raises(ConfigError, match="base model's name"):
        run(model, source, tmp_path / "out.jsonl", model_name="tiny", lora_modules={"tiny": dirs["a"]}, progress=False)
    with pytest.raises(AdapterError, match="scale"):
        run(model, source, tmp_path / "out.jsonl", lora_modules={"X": (dirs["a"], float("nan"))}, progress=False)
    assert not (tmp_path / "out.jsonl").exists()


def test_resuming_needs_the_same_modules(model: Model, dirs: dict[str, Path], tmp_path: Path) -> None:
    lines = [completion_line(f"r{i}", words(5 + i, 6 + i), max_tokens=3, temperature=0, model="A" if i % 2 else "tiny") for i in range(4)]
    write_lines(tmp_path / "first.jsonl", lines[:2])
    every = write_lines(tmp_path / "all.jsonl", lines)
    out = tmp_path / "out.jsonl"
    run(model, tmp_path / "first.jsonl", out, model_name="tiny", lora_modules={"A": dirs["a"]}, progress=False)
    before = out.read_text()
    for other in ({"A": dirs["b"]}, {"A": (dirs["a"], 0.5)}, {"A": dirs["a"], "B": dirs["b"]}, None):
        with pytest.raises(InputError, match="resume with the same modules"):
            run(model, every, out, model_name="tiny", lora_modules=other, progress=False)
    assert out.read_text() == before
    moved = shutil.copytree(dirs["a"], tmp_path / "moved-a")  # the same weights elsewhere: the same module
    resumed = run(model, every, out, model_name="tiny", lora_modules={"A": moved}, progress=False)
    assert (resumed.skipped, resumed.written, resumed.succeeded) == (2, 2, 4)
    records = by_id(read_records(out))
    assert [records[f"r{i}"]["response"]["body"]["model"] for i in range(4)] == ["tiny", "A", "tiny", "A"]
    run(model, every, tmp_path / "plain.jsonl", progress=False)
    with pytest.raises(InputError, match="LoRA modules none"):  # an output started without modules stays so
        run(model, every, tmp_path / "plain.jsonl", lora_modules={"A": dirs["a"]}, progress=False)


def _misfit_adapter(source: Path, out: Path) -> Path:
    """A copy of a PEFT adapter whose config and tensors name one layer more than the model has."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(out / "adapter_model.safetensors")
    extra = {key.replace("layers.0.", "layers.9."): value for key, value in tensors.items() if "layers.0." in key}
    save_file({**tensors, **extra}, out / "adapter_model.safetensors")
    return out


def test_cli_lora_modules(dirs: dict[str, Path], tmp_path: Path) -> None:
    base = str(dirs["base"])
    source = write_lines(tmp_path / "in.jsonl", [
        line("base", "/v1/completions", prompt=PROMPT, max_tokens=4, temperature=0),
        line("a", "/v1/completions", prompt=PROMPT, max_tokens=4, temperature=0, model="A"),
        line("b", "/v1/completions", prompt=PROMPT, max_tokens=4, temperature=0, model=base, lora="B"),
    ])
    args = ["batch", "--model", base, "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--quiet"]

    def invoke(*more: str) -> Any:
        return CliRunner().invoke(app, [*args, *more], env={"COLUMNS": "1000"})  # usage errors unwrapped

    for flags, message in [
        (["--lora-modules", "A"], "NAME=PATH[:SCALE]"),
        (["--lora-modules", f"A={dirs['a']}", "--lora-modules", f"A={dirs['b']}"], "given twice"),
        (["--lora-modules", f"A={tmp_path / 'missing'}"], "not a PEFT LoRA adapter"),
        (["--lora-modules", f"{base}={dirs['a']}"], "base model's name"),
        (["--lora-modules", f"A={dirs['a']}", "--ray"], "leave out --ray"),
        (["--lora-modules", f"A={_misfit_adapter(dirs['a'], tmp_path / 'misfit')}"], "trained for another base model"),
    ]:
        result = invoke(*flags)
        assert result.exit_code == 2 and message in result.output, (flags, result.output)
        assert not (tmp_path / "out.jsonl").exists()
    result = invoke("--lora-modules", f"A={dirs['a']}", "--lora-modules", f"B={dirs['b']}:0.5", "--summary", str(tmp_path / "s.json"))
    assert result.exit_code == 0, result.output
    records = by_id(read_records(tmp_path / "out.jsonl"))
    assert [records[k]["response"]["body"]["model"] for k in ("base", "a", "b")] == [base, "A", "B"]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["completion_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records.values())
    assert summary["time_to_first_token_s"]["p50"] > 0
    generator = Generator(load_model(dirs["base"]))
    alone = generator.generate(PROMPT, greedy(4), adapter=(load_adapter(dirs["b"]), 0.5))
    assert records["b"]["response"]["body"]["choices"][0]["text"] == alone.text
