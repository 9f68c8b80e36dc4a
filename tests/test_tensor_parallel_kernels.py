"""Tensor parallelism runs the attention kernels per device (shard_map over the head axis), on 4 forced
host devices with the kernels interpreted: one layer's write and attention equal one device's for every
KV state and page format, and whole greedy generations (prefill and decode, dense and paged bf16/q4
through the Triton kernels, and packed steps whose decoding rows attend in pieces beside long prompt
chunks) equal one device's, with one all-reduce per block and nothing gathered, and the KV buffers are
built split by KV heads."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import jax.numpy as jnp
import pytest

from zgen.cache.factory import paged_kv, resolve
from zgen.cache.sharded import write_and_attend_per_shard
from zgen.cache.tensor import DenseKVState
from zgen.cache.tracing import CacheTrace, TracingCacheProvider
from zgen.errors import ConfigError
from zgen.sharding import tensor_parallel_mesh

LAYER_SCRIPT = r"""
import json
from dataclasses import replace
import jax, jax.numpy as jnp, numpy as np
from zgen.cache.compressed import CompressedKVState
from zgen.cache.paged_state import MaskedPagedState, PagedKVState
from zgen.cache.sharded import attend_per_shard, write_and_attend_per_shard
from zgen.cache.tensor import DenseKVState
from zgen.pallas.paged_attention.layouts import KeyCalibration
from zgen.sharding import tensor_parallel_mesh

assert len(jax.devices()) == 4
mesh = tensor_parallel_mesh(4)
B, KVH, H, D, CAP = 2, 4, 8, 16, 32
rng = np.random.default_rng(0)
normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
calibration = [KeyCalibration(normal(KVH, D), normal(KVH, D), jnp.exp(0.3 * normal(KVH, D)), 1.0 / 10000 ** (jnp.arange(D // 2) / (D // 2))) for _ in range(2)]
paged = lambda fmt, **kw: replace(PagedKVState.contiguous(2, B, CAP, KVH, D, kv_dtype=fmt, **kw), attention="triton")
states = {
    "dense": DenseKVState.zeros(2, B, CAP, KVH, D, jnp.float32, attention="triton"),
    "compressed": CompressedKVState.zeros(2, B, CAP, KVH, D, jnp.float32, chunk_size=4),
    **{f"paged-{fmt}": paged(fmt) for fmt in ("bf16", "fp8")},
    **{f"paged-{fmt}": paged(fmt, key_calibration=calibration) for fmt in ("q4", "q3")},
}
states["masked-paged-bf16"] = MaskedPagedState(paged("bf16"), token_mask=jnp.asarray(rng.random((B, CAP)) > 0.2))
# A prefill chunk of 9 tokens (row 1 padded), then one decode token per row.
steps = [np.array([np.arange(9), [*range(6), -1, -1, -1]]), np.array([[9], [6]])]
feeds = [(normal(B, p.shape[1], H, D), normal(B, p.shape[1], KVH, D), normal(B, p.shape[1], KVH, D), jnp.asarray(p, jnp.int32)) for p in steps]


def one_device(state, q, k, v, positions):
    state = state.write(1, k, v, positions)
    return state.attend(1, q, positions, sliding_window=None), state


def per_shard(state, q, k, v, positions):
    return write_and_attend_per_shard(state, mesh, 1, q, k, v, positions, sliding_window=None)


def read_one_device(state, q, positions):
    return state.attend(1, q, positions, sliding_window=None)


def read_per_shard(state, q, positions):  # attention without a write (what EAGLE's feature reads do)
    return attend_per_shard(state, mesh, 1, q, positions, sliding_window=None)


out = {}
for name, state in states.items():
    results = []
    for run, read in ((one_device, read_one_device), (per_shard, read_per_shard)):
        s, outs = state, []
        for feed in feeds:
            o, s = jax.jit(run)(s, *feed)
            outs.append(np.asarray(o))
        if name in ("dense", "paged-bf16"):
            outs.append(np.asarray(jax.jit(read)(s, feeds[0][0], feeds[0][3])))
        view = s.layer_view(1)
        results.append((outs, np.asarray(view.k), np.asarray(view.v)))
    (one_outs, one_k, one_v), (split_outs, split_k, split_v) = results
    out[name] = {
        "attention": max(float(np.max(np.abs(a - b))) for a, b in zip(one_outs, split_outs)),
        "cache": max(float(np.max(np.abs(one_k - split_k))), float(np.max(np.abs(one_v - split_v)))),
        "keys_split": not jax.tree_util.tree_leaves(s.select(1))[0].sharding.is_fully_replicated,  # each device keeps its heads' K
    }
print(json.dumps(out))
"""

GENERATION_SCRIPT = r"""
import json, re
import jax, numpy as np
import zgen.runtime.engine as engine_module
from zgen import Generator, ModelConfig, Request, SamplingConfig
from zgen.cache.factory import dense_attention, kv_dtype, paged_kv
from zgen.model import attached, random_model, split_model
from zgen.runtime.calibration import key_calibration
from zgen.runtime.runner import runner_for
from zgen.runtime.step import Packing

assert len(jax.devices()) == 4
config = ModelConfig.from_hf(dict(
    model_type="llama", vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6,
))
one = random_model(config, dtype="float32")
four = split_model(one, 4)
attached(four, "key_calibration", lambda: key_calibration(one))  # q4 codes keys with the same statistics on both
prompts = ([5, 9, 13, 20, 40, 41, 42, 7, 3, 88, 60, 61, 62, 11, 12, 13, 14], [40, 41])
requests = [Request(p, SamplingConfig(temperature=0.0, max_new_tokens=5, ignore_eos=True)) for p in prompts]
# Packed steps where decoding rows ride along beside long prompt chunks, attention laid out in pieces of
# 4 tokens (each reading its row's pages): prompts of 2 to 70 tokens in chunks of 32 over 8 rows.
lengths = (70, 45, 3, 5, 2, 9, 4, 6)
ride_along = [Request([(7 * i + 3 * j) % 90 + 1 for j in range(n)], SamplingConfig(temperature=0.0, max_new_tokens=5, ignore_eos=True)) for i, n in enumerate(lengths)]
engine_module.PACKED_PIECE = 4
pieces_laid_out = []
packing_of = Packing.of
def recorded(*args, **kwargs):
    packed = packing_of(*args, **kwargs)
    pieces_laid_out.append(packed[3].owners is not None)
    return packed
Packing.of = staticmethod(recorded)
cases = {  # name: (cache options, generator settings, requests)
    "dense": ([dense_attention("triton")], {"max_batch_size": 2}, requests),
    "paged-bf16": ([paged_kv(4, attention="triton"), kv_dtype("bf16")], {"max_batch_size": 2}, requests),
    "paged-q4": ([paged_kv(4, attention="triton"), kv_dtype("q4")], {"max_batch_size": 2}, requests),
    "paged-bf16-pieces": (
        [paged_kv(4, attention="triton"), kv_dtype("bf16")],
        {"max_batch_size": 8, "prefill_chunk": 32, "packed_steps": True},
        ride_along,
    ),
}


def split_by_heads(leaf, axis):
    return len(leaf.sharding.device_set) == 4 and leaf.sharding.shard_shape(leaf.shape)[axis] == leaf.shape[axis] // 4


out = {}
for name, (options, settings, case_requests) in cases.items():
    runs = {}
    for label, model in (("one", one), ("four", four)):
        pieces_laid_out.clear()
        generator = Generator(model, *options, **settings)
        if label == "four" and name != "dense":  # the pool is built split by KV heads: no device holds all of it
            kv_split = split_by_heads(jax.tree_util.tree_leaves(generator.engine.kv.store.k)[0], 0)
        results = generator.batch_generate(case_requests)
        if label == "four" and name == "dense":  # rows made (and grown) split by KV heads
            kv_split = split_by_heads(generator.engine.kv.state.k[0], 2)
        runs[label] = ([r.token_ids for r in results], np.array([r.logprobs for r in results]))
    collectives = sorted({  # per compiled step: (all-reduces, anything that gathers or moves K/V)
        (len(re.findall(r"all-reduce\(", text)), len(re.findall(r"all-gather\(|all-to-all\(|collective-permute\(", text)))
        for text in (compiled.as_text() for compiled in runner_for(four)._executables.values())
    })
    out[name] = {
        "tokens": runs["one"][0], "same_tokens": runs["one"][0] == runs["four"][0],
        "logprob_gap": float(np.max(np.abs(runs["one"][1] - runs["four"][1]))),
        "steps": sorted({key[0] for key in runner_for(four)._executables}), "collectives": collectives,
        "kv_split": kv_split, "pieces": any(pieces_laid_out),
    }
    runner_for(four)._executables.clear()
print(json.dumps(out))
"""


def _run_on_four_devices(script: str, env: dict[str, str]) -> dict[str, dict[str, object]]:
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_one_layer_per_shard_equals_one_device_for_every_state_and_format(host_devices_env: Callable[[int], dict[str, str]]) -> None:
    out = _run_on_four_devices(LAYER_SCRIPT, host_devices_env(4))
    assert set(out) == {"dense", "compressed", "paged-bf16", "paged-fp8", "paged-q4", "paged-q3", "masked-paged-bf16"}
    for name, result in out.items():
        assert result["cache"] == 0.0 and result["keys_split"], (name, result)  # every device stored its own heads, exactly
        # The Triton kernels on plain pages: each device ran one device's math on its heads, bit for bit. XLA
        # einsums (the compressed and token-masked states, the coded formats' query folding) may round
        # differently at other shapes.
        exact = name in ("dense", "paged-bf16", "paged-fp8")
        assert result["attention"] == 0.0 if exact else result["attention"] < 2e-5, (name, result)


def test_generation_through_the_kernels_on_four_devices_equals_one_device(host_devices_env: Callable[[int], dict[str, str]]) -> None:
    out = _run_on_four_devices(GENERATION_SCRIPT, host_devices_env(4))
    assert set(out) == {"dense", "paged-bf16", "paged-q4", "paged-bf16-pieces"}
    assert [name for name, result in out.items() if result["pieces"]] == ["paged-bf16-pieces"]  # its steps attended in pieces
    for name, result in out.items():
        assert result["same_tokens"], (name, result)
        assert result["logprob_gap"] < 1e-4, (name, result)  # float32: only the all-reduce's summation order differs
        assert result["steps"] == ["decode", "mixed"], (name, result)  # prefill (mixed step) and the decode loop
        assert result["collectives"] == [[2 * 2, 0]], (name, result)  # 2 layers x (attention + MLP): one all-reduce each
        assert result["kv_split"], (name, result)
    assert len({tuple(ids) for ids in out["dense"]["tokens"]}) == 2  # type: ignore[union-attr]


def test_paged_attention_choice_and_unsplittable_states_are_refused() -> None:
    assert resolve([paged_kv(attention="triton")]).paged_attention == "triton"
    with pytest.raises(ConfigError, match="unknown paged attention implementation 'flash'; choose one of reference, xla, triton"):
        resolve([paged_kv(attention="flash")])
    traced = TracingCacheProvider(DenseKVState.zeros(1, 1, 8, 2, 16, jnp.float32), CacheTrace())
    q, kv, positions = jnp.zeros((1, 1, 4, 16)), jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ConfigError, match="a TracingCacheProvider cannot be split by heads over devices"):
        write_and_attend_per_shard(traced, tensor_parallel_mesh(1), 0, q, kv, kv, positions, sliding_window=None)
