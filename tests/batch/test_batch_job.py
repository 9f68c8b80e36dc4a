"""zgen batch: OpenAI Batch API files in, records the OpenAI client's own types accept out; bad lines
become error records; the output resumes; the command line's exit code and summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batch_helpers import by_id, chat_line, completion_line, read_records, save_tiny_chat_model, words
from zgen import Generator, SamplingConfig, load_model
from zgen.batch import run
from zgen.cache.factory import prefix_cache
from zgen.cli import app
from zgen.model import Model
from zgen.speculative import PromptLookup


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Model:
    return load_model(model_dir)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_records_follow_the_openai_types_and_match_the_generator(model: Model, tmp_path: Path) -> None:
    lines = [completion_line(f"c{i}", words(*range(5 + i, 13 + i)), max_tokens=4 + i, temperature=0) for i in range(5)]
    lines += [
        chat_line("chat", words(10, 11, 12), max_completion_tokens=6, logprobs=True, top_logprobs=3, n=2, seed=5),
        completion_line("ids", [[5, 6, 7], [8, 9]], max_tokens=5, logprobs=2, temperature=0, stop=["w60"]),
    ]
    summary = run(model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", max_batch_size=3, progress=False)
    records = by_id(read_records(tmp_path / "out.jsonl"))
    assert sorted(records) == sorted(["c0", "c1", "c2", "c3", "c4", "chat", "ids"])
    assert (summary.succeeded, summary.failed, summary.written) == (7, 0, 7)
    generator = Generator(model, max_batch_size=3)
    for i in range(5):  # greedy: what the Generator gives for the same prompt
        body = records[f"c{i}"]["response"]["body"]
        expected = generator.generate(words(*range(5 + i, 13 + i)), SamplingConfig(temperature=0.0, max_new_tokens=4 + i))
        assert body["choices"][0]["text"] == expected.text
        assert body["choices"][0]["finish_reason"] == expected.finish_reason
        assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 4 + i, "total_tokens": 12 + i, "prompt_tokens_details": {"cached_tokens": 0}}
    chat = records["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion" and len(chat["choices"]) == 2
    for choice in chat["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["message"]["content"].split())  # one word per token
        for entry in content:
            best = [alt["logprob"] for alt in entry["top_logprobs"]]
            assert len(best) == 3 and best == sorted(best, reverse=True) and entry["logprob"] <= best[0] + 1e-9
    ids = records["ids"]["response"]["body"]
    assert [c["index"] for c in ids["choices"]] == [0, 1] and ids["usage"]["prompt_tokens"] == 5
    for choice in ids["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"])
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
        greedy = [max(top.values()) for top in logprobs["top_logprobs"]]
        assert logprobs["token_logprobs"] == pytest.approx(greedy)  # temperature 0 picks the best


def test_bad_lines_become_error_records_and_the_job_goes_on(model: Model, tmp_path: Path) -> None:
    good = completion_line("good", words(5, 6), max_tokens=3, temperature=0)  # unseeded sampling could draw the end token
    lines = [
        good,
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
        completion_line("temperature", "w5", temperature=3),
        completion_line("max", "w5", max_tokens=0),
        completion_line("bool", "w5", max_tokens=True),
        completion_line("unknown", "w5", tools=[]),
        completion_line("stream", "w5", stream=True),
        chat_line("top", "w5", top_logprobs=2),
        chat_line("role", "w5", logprobs="yes"),
        completion_line("long", words(*[5] * 250), max_tokens=10),
        completion_line("dup", "w5"),
        completion_line("dup", "w6"),
        json.dumps({"custom_id": "", "url": "/v1/completions", "body": {"prompt": "w5"}}),
        completion_line("badid", [5, 96]),
        completion_line("empty", ""),
        "   ",  # a blank line is no request
    ]
    summary = run(model, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", progress=False)
    records = read_records(tmp_path / "out.jsonl")
    errors = {r["custom_id"] or f"line {r['error']['line']}": r["error"]["code"] for r in records if r["error"]}
    assert errors == {
        "line 2": "invalid_json", "line 3": "invalid_json", "url": "invalid_url", "temperature": "invalid_parameter",
        "max": "invalid_parameter", "bool": "invalid_parameter", "unknown": "invalid_parameter", "stream": "invalid_parameter",
        "top": "invalid_parameter", "role": "invalid_parameter", "long": "prompt_too_long", "dup": "duplicate_custom_id",
        "line 15": "invalid_request", "badid": "invalid_parameter", "empty": "invalid_parameter",
    }
    assert [r["custom_id"] for r in records].count("dup") == 1
    assert by_id(records)["good"]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert (summary.requests, summary.succeeded, summary.failed) == (17, 1, 15)
    again = run(model, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)  # error records count as done
    assert (again.written, again.skipped, again.failed) == (0, 17, 15)
    assert len(read_records(tmp_path / "out.jsonl")) == len(records)


def test_prefix_cache_serves_the_shared_system_prompt(model: Model, tmp_path: Path) -> None:
    system = words(*[7, 8, 9, 10] * 10)  # 40 shared tokens: two full pages of 16
    lines = [completion_line(f"r{i}", f"{system} {words(20 + i, 30 + i)}", max_tokens=4, temperature=0) for i in range(6)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    plain = run(model, source, tmp_path / "plain.jsonl", max_batch_size=2, progress=False)
    cached = run(model, source, tmp_path / "cached.jsonl", prefix_cache(capacity_blocks=64), max_batch_size=2, progress=False)
    assert plain.cached_tokens == 0 and cached.cached_tokens >= 4 * 32  # the first requests compute it
    texts = {k: r["response"]["body"]["choices"][0]["text"] for k, r in by_id(read_records(tmp_path / "plain.jsonl")).items()}
    again = {k: r["response"]["body"]["choices"][0]["text"] for k, r in by_id(read_records(tmp_path / "cached.jsonl")).items()}
    assert texts == again
    assert sum(r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in read_records(tmp_path / "cached.jsonl")) == cached.cached_tokens


def test_a_rerun_skips_done_requests_and_repairs_a_torn_line(model: Model, tmp_path: Path) -> None:
    lines = [completion_line(f"r{i}", words(5 + i, 6 + i), max_tokens=3, temperature=0) for i in range(6)]
    write_lines(tmp_path / "first.jsonl", lines[:3])
    run(model, tmp_path / "first.jsonl", tmp_path / "out.jsonl", progress=False)
    with open(tmp_path / "out.jsonl", "a", encoding="utf-8") as out:
        out.write('{"id": "batch_req_torn", "custom_id": "r3", "resp')  # a crash in the middle of a write
    summary = run(model, write_lines(tmp_path / "all.jsonl", lines), tmp_path / "out.jsonl", progress=False)
    assert (summary.skipped, summary.written, summary.succeeded) == (3, 3, 6)
    assert sorted(r["custom_id"] for r in read_records(tmp_path / "out.jsonl")) == [f"r{i}" for i in range(6)]
    finished = run(model, tmp_path / "all.jsonl", tmp_path / "out.jsonl", progress=False)
    assert (finished.skipped, finished.written) == (6, 0)


def test_cli_exit_code_summary_and_foreign_output(model_dir: Path, tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", [completion_line("a", "w5 w6", max_tokens=2, temperature=0), "oops"])
    args = ["batch", "--model", str(model_dir), "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--max-batch-size", "4"]
    result = CliRunner().invoke(app, [*args, "--summary", str(tmp_path / "summary.json")], env={"TTY_COMPATIBLE": "1", "COLUMNS": "200"})
    assert result.exit_code == 3, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["requests"], summary["succeeded"], summary["failed"], summary["completion_tokens"]) == (2, 1, 1, 2)
    assert "tok/s" in result.stderr and "2/2" in result.stderr  # the progress bar, on a terminal
    assert "2 requests: 1 succeeded, 1 failed" in result.stderr
    quiet = CliRunner().invoke(app, [*args, "--quiet", "--kv-memory-mb", "4"])  # nothing left to do; the failure still counts
    assert (quiet.exit_code, quiet.stderr) == (3, "")
    rows = CliRunner().invoke(app, [*args, "--kv-cache", "tensor", "--kv-memory-mb", "4"])
    assert rows.exit_code == 2 and "no page pool" in rows.output
    (tmp_path / "foreign.jsonl").write_text("hello\n")
    result = CliRunner().invoke(app, [*args[:-4], "--output", str(tmp_path / "foreign.jsonl")])
    assert result.exit_code == 1 and "not a batch result record" in result.stderr
    assert (tmp_path / "foreign.jsonl").read_text() == "hello\n"


def test_speculative_decoding_gives_the_plain_records(model: Model, model_dir: Path, tmp_path: Path) -> None:
    lines = [completion_line(f"r{i}", words(*[5 + i, 6, 7] * 4), max_tokens=8, temperature=0) for i in range(4)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    plain = run(model, source, tmp_path / "plain.jsonl", max_batch_size=2, progress=False)
    drafted = run(model, source, tmp_path / "drafted.jsonl", max_batch_size=2, progress=False, speculative=PromptLookup(num_tokens=4))
    texts = {k: r["response"]["body"]["choices"][0]["text"] for k, r in by_id(read_records(tmp_path / "plain.jsonl")).items()}
    assert texts == {k: r["response"]["body"]["choices"][0]["text"] for k, r in by_id(read_records(tmp_path / "drafted.jsonl")).items()}
    assert drafted.succeeded == 4
    # The summary's speculative figures, as `zgen generate --json` gives them (the prompts repeat: lookups draft).
    assert plain.speculative is None and plain.to_json()["speculative"] is None
    figures = drafted.to_json()["speculative"]
    assert isinstance(figures, dict) and figures["draft_tokens"] >= figures["accepted_tokens"] > 0, figures
    assert figures["acceptance_rate"] == figures["accepted_tokens"] / figures["draft_tokens"]
    assert figures["mean_accepted_per_step"] > 0 and "drafted tokens accepted" in drafted.describe()
    args = ["batch", "--model", str(model_dir), "--input", str(source), "--quiet"]
    cli = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "cli.jsonl"), "--jacobi", "--num-draft-tokens", "4"])
    assert cli.exit_code == 0, cli.output
    assert texts == {k: r["response"]["body"]["choices"][0]["text"] for k, r in by_id(read_records(tmp_path / "cli.jsonl")).items()}
    refused = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "bad.jsonl"), "--num-draft-tokens", "4"], env={"COLUMNS": "200"})
    assert refused.exit_code == 2 and "needs --prompt-lookup" in refused.output
    assert not (tmp_path / "bad.jsonl").exists()


def test_packed_prefill_steps_give_the_plain_records(model: Model, model_dir: Path, tmp_path: Path) -> None:
    """Prefill steps packed into one stream give the padded steps' records: ``--step-tokens`` (streams
    of that many tokens, chunks cut to fill them), the default (streams a power of two wide), and
    ``prefill_apart=False`` (the decoding rows riding along in them). A budget below the batch is
    refused before anything runs."""
    lines = [completion_line(f"r{i}", words(*range(5, 12 + 5 * i)), max_tokens=3 + i, temperature=0) for i in range(5)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    run(model, source, tmp_path / "plain.jsonl", max_batch_size=4, prefill_chunk=16, packed_steps=False, progress=False)
    texts = {k: r["response"]["body"]["choices"][0]["text"] for k, r in by_id(read_records(tmp_path / "plain.jsonl")).items()}
    args = ["batch", "--model", str(model_dir), "--input", str(source), "--quiet", "--max-batch-size", "4", "--prefill-chunk", "16", "--kv-memory-mb", "4"]
    for name, flags in (("budget", ["--step-tokens", "24"]), ("streams", [])):
        packed = CliRunner().invoke(app, [*args, "--output", str(tmp_path / f"{name}.jsonl"), *flags])
        assert packed.exit_code == 0, packed.output
        assert texts == {k: r["response"]["body"]["choices"][0]["text"] for k, r in by_id(read_records(tmp_path / f"{name}.jsonl")).items()}
    run(model, source, tmp_path / "along.jsonl", max_batch_size=4, prefill_chunk=16, refill_rows=1, prefill_apart=False, progress=False)
    assert texts == {k: r["response"]["body"]["choices"][0]["text"] for k, r in by_id(read_records(tmp_path / "along.jsonl")).items()}
    refused = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "bad.jsonl"), "--step-tokens", "2"], env={"COLUMNS": "200"})
    assert refused.exit_code == 1 and "step_tokens" in refused.stderr
    assert not (tmp_path / "bad.jsonl").exists()
