"""load_model(..., tensor_parallel=N) on forced host devices: the same greedy tokens as one device,
through the Generator (dense and paged caches), a context, a batch job of two replicas of two devices
each, speculative decoding (Generator, batch job, ``zgen generate --tensor-parallel``); heads that N
does not divide are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hf_reference import save_random_checkpoint, small_configs
from zgen import load_model
from zgen.errors import ConfigError

SCRIPT = r"""
import json, sys
import jax
from zgen import Generator, Request, SamplingConfig, load_model
from zgen.cache.factory import paged_kv
from zgen.sharding import partition_spec

assert len(jax.devices()) == 4
one = load_model(sys.argv[1])
two = load_model(sys.argv[1], tensor_parallel=2)
assert two.params["layers.0.qkv"].sharding.spec == partition_spec("layers.0.qkv")
assert len(two.params["layers.0.gate_up"].sharding.device_set) == 2
requests = [Request(p, SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True)) for p in ("w5 w9 w13 w20", "w40 w41", "w7 w3 w88 w60 w61 w62")]
requests.append(Request("w11 w12 w13", SamplingConfig(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=10, ignore_eos=True)))
out = {}
for name, model in (("one", one), ("two", two)):
    for cache in ("tensor", "paged"):
        options = [paged_kv(max_memory_mb=8)] if cache == "paged" else []
        generator = Generator(model, *options, max_batch_size=4)
        out[f"{name}-{cache}"] = [r.token_ids for r in generator.batch_generate(requests)]
import re
from zgen.runtime.runner import runner_for
collectives = set()
for compiled in runner_for(two)._executables.values():  # one all-reduce per block, nothing gathered
    text = compiled.as_text()
    collectives.add((len(re.findall(r"all-reduce\(", text)), len(re.findall(r"all-gather\(|all-to-all\(", text))))
out["collectives"] = sorted(collectives)
from zgen import Context, Sampler, stop
for name, model in (("one", one), ("two", two)):  # contexts, on the model's own paged engine
    ctx = Context(model)
    ctx.fill_tokens([5, 9, 13, 20, 40])
    out[f"{name}-context"] = ctx.generate_result(Sampler.greedy(), stop.max_len(8)).token_ids
from zgen.batch import run  # two replicas, each split over two devices
lines = [json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": {"prompt": f"w{5 + i} w{9 + i}", "max_tokens": 6, "temperature": 0}}) for i in range(6)]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
summaries = [  # packed prefill steps (the job's default) on a paged cache
    run(one, sys.argv[2], f"{sys.argv[2]}.{dp}x{tp}", paged_kv(max_memory_mb=8), data_parallel=dp, tensor_parallel=tp, max_batch_size=2, progress=False)
    for dp, tp in ((1, 1), (2, 2))
]
out["replicas"] = [list(s.replica_requests) for s in summaries]
texts = [{r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in map(json.loads, open(f"{sys.argv[2]}.{dp}x{tp}"))} for dp, tp in ((1, 1), (2, 2))]
out["batch_same"] = texts[0] == texts[1] and len(texts[0]) == 6
from zgen.speculative import DraftModel, PromptLookup
from zgen.speculative.eagle import Eagle, EagleHead
greedy = [Request("w5 w9 w13 w5 w9 w13 w5", SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True))]
out["plain"] = Generator(one, max_batch_size=2).batch_generate(greedy)[0].token_ids
for name, speculator in (  # drafts of the split model itself, and of weights on one device (copied to each)
    ("eagle", Eagle(EagleHead.init(two, jax.random.PRNGKey(0)), adaptive=False)),
    ("draft", DraftModel(one, num_tokens=3, adaptive=False)),
):
    result = Generator(two, max_batch_size=2, speculative=speculator).batch_generate(greedy)[0]
    out[f"two-{name}"] = result.token_ids
    out[f"two-{name}-drafted"] = result.speculative.draft_tokens
spec_job = run(one, sys.argv[2], f"{sys.argv[2]}.spec", paged_kv(max_memory_mb=8), data_parallel=2, tensor_parallel=2, max_batch_size=2,
               progress=False, speculative=DraftModel.early_exit(one, layers=1))
spec_texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in map(json.loads, open(f"{sys.argv[2]}.spec"))}
out["batch_speculative_same"] = spec_texts == texts[0] and spec_job.speculative.draft_tokens > 0
from typer.testing import CliRunner
from zgen.cli import app
cli = CliRunner().invoke(app, ["generate", "-m", sys.argv[1], "-p", greedy[0].prompt, "-n", "10", "--temperature", "0", "--ignore-eos", "--json",
                               "--tensor-parallel", "2", "--prompt-lookup"])
out["cli"] = json.loads(cli.stdout)["token_ids"] if cli.exit_code == 0 else cli.output
from zgen.errors import ConfigError
from zgen.lora import random_adapter
try:
    two.push_adapter(random_adapter(two.config, rank=2))
    out["adapter_refused"] = False
except ConfigError:
    out["adapter_refused"] = True
print(json.dumps(out))
"""


def test_two_way_tensor_parallel_matches_one_device(tmp_path: Path, host_devices_env: Callable[[int], dict[str, str]]) -> None:
    save_random_checkpoint(small_configs()["llama"], tmp_path)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(tmp_path / "in.jsonl")], env=host_devices_env(4), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["two-tensor"] == out["one-tensor"] == out["two-paged"] == out["one-paged"]
    assert out["two-context"] == out["one-context"] and len(out["one-context"]) == 8
    assert out["collectives"] == [[2 * 2, 0]]  # 2 layers: the attention and the MLP block each end in one all-reduce
    assert out["adapter_refused"]  # LoRA rows would need the split layout: refused, not wrong
    assert out["batch_same"] and out["replicas"][0] == [6] and sum(out["replicas"][1]) == 6  # 2 replicas x 2 devices
    assert len({tuple(ids) for ids in out["one-tensor"]}) == 4
    # Speculative decoding on the split model: the plain greedy tokens, drafting with the split model's
    # own weights or with a one-device draft copied to the group, in a Generator, a batch job and the CLI.
    assert out["two-eagle"] == out["two-draft"] == out["plain"] and out["two-eagle-drafted"] > 0 and out["two-draft-drafted"] > 0
    assert out["batch_speculative_same"]
    assert out["cli"] == out["plain"]


def test_heads_that_do_not_divide_are_refused(tmp_path: Path) -> None:
    save_random_checkpoint(small_configs()["llama"], tmp_path)  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match=r"tensor_parallel=3 must divide .*attention heads \(4\), KV heads \(2\)"):
        load_model(tmp_path, tensor_parallel=3)
    with pytest.raises(ConfigError, match="needs as many local devices"):
        load_model(tmp_path, tensor_parallel=2)  # this process has one CPU device


def test_cli_refuses_what_the_devices_cannot_do(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from zgen.cli import app

    save_random_checkpoint(small_configs()["llama"], tmp_path / "model")
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "w5"}}\n')
    args = ["batch", "--model", str(tmp_path / "model"), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    both = CliRunner().invoke(app, [*args, "--tensor-parallel", "2", "--data-parallel", "2", "--quiet"])
    assert both.exit_code == 1 and "data_parallel=2 x tensor_parallel=2 needs as many local devices" in both.stderr
    split = CliRunner().invoke(app, [*args, "--tensor-parallel", "2", "--quiet"])
    assert split.exit_code == 1 and "needs as many local devices" in split.stderr
    assert not (tmp_path / "out.jsonl").exists()
