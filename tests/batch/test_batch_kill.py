"""A batch job killed with SIGKILL at random points, several times, then run to the end: the output
holds every custom_id exactly once, every line whole, and the same results as a run never killed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zgen
from batch_helpers import by_id, completion_line, read_records, save_tiny_chat_model, words
from zgen.batch import run

KILLS = 3


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
def test_sigkill_at_random_points_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    model_dir = save_tiny_chat_model(tmp_path / "model")
    requests = [
        completion_line(f"r{i}", words(*[(5 + 7 * i + j) % 90 + 5 for j in range(6 + i % 5)]), max_tokens=24, temperature=0.8 * (i % 2), seed=i)
        for i in range(40)
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(requests) + "\n")
    assert run(str(model_dir), source, tmp_path / "reference.jsonl", max_batch_size=2, progress=False).failed == 0
    expected = by_id(read_records(tmp_path / "reference.jsonl"))

    output = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "zgen.cli", "batch", "--model", str(model_dir), "--input", str(source), "--output", str(output), "--max-batch-size", "2", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(Path(zgen.__file__).parents[1])}
    rng = random.Random(0)
    kills = 0
    for _ in range(KILLS):
        before = _lines(output)
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while process.poll() is None and _lines(output) == before and time.monotonic() < deadline:
            time.sleep(0.02)  # killed once it has written something, at a random moment after
        time.sleep(rng.uniform(0.0, 0.4))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait()
    assert kills >= 2, "the job finished before it could be killed; give it more work"
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    records = read_records(output)  # every line whole and of the OpenAI types
    assert sorted(r["custom_id"] for r in records) == sorted(expected)  # none lost, none twice
    for custom_id, record in by_id(records).items():
        assert record["response"]["body"]["choices"] == expected[custom_id]["response"]["body"]["choices"]

