"""zgen batch --data-parallel N: N replicas on N forced host devices give what one device gives,
speculating too (each replica drafting with its own copy of a draft model's weights)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from batch_helpers import by_id, completion_line, read_records, save_tiny_chat_model, words

SCRIPT = """
import json, sys
import jax
from zgen import load_model
from zgen.batch import run
from zgen.speculative import DraftModel
assert len(jax.devices()) == 2, jax.devices()
model = load_model(sys.argv[1])
one = run(model, sys.argv[2], sys.argv[3], max_batch_size=2, progress=False)
two = run(model, sys.argv[2], sys.argv[4], max_batch_size=2, progress=False, data_parallel=2)
draft = DraftModel.early_exit(model, layers=1, num_tokens=3, adaptive=False)
drafted = run(model, sys.argv[2], sys.argv[5], max_batch_size=2, progress=False, data_parallel=2, speculative=draft)
print(json.dumps([one.to_json(), two.to_json(), drafted.to_json()]))
"""


@pytest.mark.slow
def test_two_replicas_on_two_host_devices_match_one(tmp_path: Path, host_devices_env: Callable[[int], dict[str, str]]) -> None:
    model_dir = save_tiny_chat_model(tmp_path / "model")
    lines = [
        completion_line(f"r{i}", words(*[(5 + 3 * i + j) % 90 + 5 for j in range(5 + i % 4)]), max_tokens=12, temperature=0.8 * (i % 2), seed=i)
        for i in range(16)
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    outputs = [tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "drafted.jsonl"]
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), str(source), *map(str, outputs)], env=host_devices_env(2), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    one, two, drafted = json.loads(done.stdout.splitlines()[-1])
    assert one["replica_requests"] == [16] and sum(two["replica_requests"]) == 16 and min(two["replica_requests"]) > 0
    single, parallel, speculated = (by_id(read_records(path)) for path in outputs)
    assert sorted(single) == sorted(parallel) == sorted(f"r{i}" for i in range(16))
    for custom_id, record in single.items():  # greedy and seeded rows alike
        assert parallel[custom_id]["response"]["body"]["choices"] == record["response"]["body"]["choices"]
    tokens = sum(record["response"]["body"]["usage"]["completion_tokens"] for record in single.values())
    assert one["completion_tokens"] == two["completion_tokens"] == tokens  # two replicas' metrics added up
    assert one["generations"] == two["generations"] == 16 and two["inter_token_latency_s"]["p50"] > 0
    # Drafting on both replicas: every request done, the greedy ones (even ids) token for token as without it.
    assert sum(drafted["replica_requests"]) == 16 and min(drafted["replica_requests"]) > 0
    assert drafted["speculative"]["draft_tokens"] > 0, drafted
    for i in range(0, 16, 2):
        assert speculated[f"r{i}"]["response"]["body"]["choices"] == single[f"r{i}"]["response"]["body"]["choices"]
