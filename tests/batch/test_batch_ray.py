"""zgen on a local Ray instance: ZgenPredictor in Dataset.map_batches, and zgen batch --ray writing the
same resumable output as a local job."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import zgen
from batch_helpers import by_id, chat_line, completion_line, read_records, save_tiny_chat_model, words
from zgen import Generator, SamplingConfig, load_model
from zgen.batch import run
from zgen.speculative import DraftModel, PromptLookup

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'zgen[ray]')")
ray_data = pytest.importorskip("ray.data")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # Workers import zgen from this checkout, as the tests do (they inherit the environment).
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(zgen.__file__).parents[1]), before or ""])
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.mark.usefixtures("local_ray")
def test_predictor_in_map_batches_matches_the_generator(model_dir: Path) -> None:
    from zgen.integrations.ray import ZgenPredictor

    sampling = {"temperature": 0.0, "max_new_tokens": 5}
    prompts = [words(5 + i, 6 + i, 7 + i) for i in range(4)]
    rows: list[dict[str, Any]] = [{"prompt": p} for p in prompts]
    out = ray_data.from_items(rows).map_batches(
        ZgenPredictor, fn_constructor_kwargs={"model": str(model_dir), "sampling": sampling}, concurrency=1, batch_size=2
    ).take_all()
    chats = ray_data.from_items([{"messages": [{"role": "user", "content": p}]} for p in prompts[:2]]).map_batches(
        ZgenPredictor, fn_constructor_kwargs={"model": str(model_dir), "sampling": sampling}, concurrency=1, batch_size=2
    ).take_all()
    drafted = ray_data.from_items(rows).map_batches(
        ZgenPredictor, fn_constructor_kwargs={"model": str(model_dir), "sampling": sampling, "speculative": lambda model: PromptLookup(num_tokens=4)},
        concurrency=1, batch_size=2,
    ).take_all()
    assert sorted(r["generated_text"] for r in drafted) == sorted(r["generated_text"] for r in out)  # greedy: the plain tokens
    generator = Generator(load_model(model_dir))
    config = SamplingConfig(**sampling)
    for row in out:
        expected = generator.generate(row["prompt"], config)
        assert row["generated_text"] == expected.text and list(row["generated_token_ids"]) == expected.token_ids
        assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"]) == (3, len(expected.token_ids), expected.finish_reason)
    for row in chats:
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
        assert row["generated_text"] == generator.generate(messages, config).text


@pytest.mark.usefixtures("local_ray")
def test_batch_on_ray_writes_what_a_local_job_writes(model_dir: Path, tmp_path: Path) -> None:
    from zgen.integrations.ray import run_on_ray

    lines = [completion_line(f"r{i}", words(5 + i, 9 + i), max_tokens=6, temperature=0) for i in range(6)]
    lines += [chat_line("chat", words(12, 13), max_tokens=4, temperature=0), "not json"]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines[:4]) + "\n")
    first = run_on_ray(str(model_dir), source, tmp_path / "ray.jsonl", actors=2, lines_per_task=2, max_batch_size=2, progress=False)
    assert first.written == 4
    source.write_text("\n".join(lines) + "\n")  # more lines: the finished ones are skipped
    summary = run_on_ray(str(model_dir), source, tmp_path / "ray.jsonl", actors=2, lines_per_task=2, max_batch_size=2, progress=False)
    local = run(str(model_dir), source, tmp_path / "local.jsonl", max_batch_size=2, progress=False)
    assert (summary.skipped, summary.written, summary.failed, local.failed) == (4, 4, 1, 1)
    on_ray, here = by_id(read_records(tmp_path / "ray.jsonl")), by_id(read_records(tmp_path / "local.jsonl"))
    assert sorted(on_ray, key=str) == sorted(here, key=str)
    for custom_id, record in here.items():
        if record["error"] is None:
            assert on_ray[custom_id]["response"]["body"]["choices"] == record["response"]["body"]["choices"]
        else:
            assert on_ray[custom_id]["error"]["code"] == record["error"]["code"]
    # the summary adds up the actors' engine metrics: this run generated r4, r5 and chat
    assert summary.completion_tokens == sum(on_ray[k]["response"]["body"]["usage"]["completion_tokens"] for k in ("r4", "r5", "chat"))
    assert summary.generations == 3 and summary.time_to_first_token_s is not None and summary.speculative is None
    # Each actor drafts with a speculator it makes for its own model (a draft model's weights included).
    draft = functools.partial(DraftModel.early_exit, layers=1, num_tokens=3, adaptive=False)
    drafted = run_on_ray(str(model_dir), source, tmp_path / "drafted.jsonl", actors=2, lines_per_task=2, max_batch_size=2, progress=False, speculative=draft)
    assert drafted.written == 8 and drafted.speculative is not None and drafted.speculative.draft_tokens > 0
    speculated = by_id(read_records(tmp_path / "drafted.jsonl"))
    assert sorted(speculated, key=str) == sorted(here, key=str)
    for custom_id, record in here.items():  # greedy requests: the plain records
        if record["error"] is None:
            assert speculated[custom_id]["response"]["body"]["choices"] == record["response"]["body"]["choices"]
        else:
            assert speculated[custom_id]["error"]["code"] == record["error"]["code"]


@pytest.mark.usefixtures("local_ray")
def test_cli_batch_on_ray_speculates_in_each_actor(model_dir: Path, tmp_path: Path) -> None:
    """`zgen batch --ray` with speculator flags: each actor makes the flags' speculator for its own
    model (prompt lookup over prompts that repeat); the records are the local job's, the summary has
    the figures."""
    from typer.testing import CliRunner

    from zgen.cli import app

    lines = [completion_line(f"r{i}", words(*[5 + i, 6, 7] * 3), max_tokens=6, temperature=0) for i in range(4)]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    local = run(str(model_dir), source, tmp_path / "local.jsonl", max_batch_size=2, progress=False)
    args = ["batch", "--model", str(model_dir), "--input", str(source), "--output", str(tmp_path / "ray.jsonl"), "--quiet"]
    result = CliRunner().invoke(app, [*args, "--ray", "--ray-actors", "1", "--max-batch-size", "2", "--prompt-lookup", "--num-draft-tokens", "3", "--summary", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["succeeded"] == local.succeeded == 4 and summary["speculative"]["draft_tokens"] > 0
    here, on_ray = by_id(read_records(tmp_path / "local.jsonl")), by_id(read_records(tmp_path / "ray.jsonl"))
    assert {k: r["response"]["body"]["choices"] for k, r in on_ray.items()} == {k: r["response"]["body"]["choices"] for k, r in here.items()}
