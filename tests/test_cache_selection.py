"""Cache kinds chosen through Generator options and CLI flags, end to end on SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.hf_reference import hf_teacher_forced
from zgen import Generator, SamplingConfig
from zgen.cache.options import compressed_kv, flat_kv, kv_dtype, paged_kv, prefix_cache
from zgen.cli import app
from zgen.errors import ConfigError, PoolExhaustedError
from zgen.model import Model

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=32)
PROMPT = [{"role": "user", "content": "List three uses of copper."}]
SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and only about metals." for i in range(1, 12))


def test_flat_tensor_paged_float32_agree_with_each_other_and_hf(smollm2: Model, hf_smollm2: Any) -> None:
    outputs = {
        name: Generator(smollm2, *options).generate(PROMPT, GREEDY)
        for name, options in {"tensor": (), "flat": (flat_kv(),), "paged": (paged_kv(64), kv_dtype("fp32"))}.items()
    }
    tokens = outputs["tensor"].token_ids
    assert all(r.token_ids == tokens for r in outputs.values())
    ids = Generator(smollm2).encode_prompt(PROMPT)
    ref_tokens, _ = hf_teacher_forced(hf_smollm2, ids, tokens)
    assert ref_tokens == tokens


def test_quantized_and_compressed_caches_generate(smollm2: Model) -> None:
    for options in [(paged_kv(64), kv_dtype("fp8")), (kv_dtype("q4"),), (compressed_kv(16),)]:
        result = Generator(smollm2, *options).generate("The sun rises in the", SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True))
        assert len(result.token_ids) == 6 and result.text


def test_prefix_cache_skips_the_shared_system_prompt(smollm2: Model) -> None:
    gen = Generator(smollm2, paged_kv(128), prefix_cache(capacity_blocks=512))
    plain = Generator(smollm2)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is gold soft?"}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Does iron rust?"}]
    cold = gen.generate(first, GREEDY)
    warm = gen.generate(second, GREEDY)
    assert cold.usage.cached_prompt_tokens == 0
    system_tokens = len(Generator(smollm2).encode_prompt([{"role": "system", "content": SYSTEM}]))
    assert warm.usage.cached_prompt_tokens >= system_tokens - 16  # whole pages of the shared prefix
    assert warm.token_ids == plain.generate(second, GREEDY).token_ids
    backend = gen.kv_backend
    assert backend.radix is not None and backend.radix.stats.hits >= 1  # type: ignore[attr-defined]


def test_pool_exhaustion_is_typed_and_harmless(smollm2: Model) -> None:
    gen = Generator(smollm2, paged_kv(max_memory_mb=10))  # about 13 blocks of 16 fp32 tokens
    with pytest.raises(PoolExhaustedError):
        gen.generate("word " * 300, SamplingConfig(max_new_tokens=200))
    small = gen.generate("Hi", SamplingConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    assert len(small.token_ids) == 4
    pool = gen.kv_backend.pool  # type: ignore[attr-defined]
    assert pool.num_free == pool.num_blocks


def test_bad_cache_options() -> None:
    from zgen.cache.options import CacheOptions

    with pytest.raises(ConfigError, match="unknown kv dtype"):
        CacheOptions(kv_dtype="int2")
    with pytest.raises(ConfigError, match="paged"):
        CacheOptions(kind="tensor", prefix_cache_blocks=8)


def test_cli_cache_flags_and_eval_ppl(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["generate", "-p", "Copper is", "--temperature", "0", "-n", "5", "--ignore-eos", "--kv-cache", "paged", "--kv-dtype", "q4", "--prefix-cache", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["token_ids"]) == 5
    text = tmp_path / "text.txt"
    text.write_text("The harbour was quiet that morning, and the boats rocked gently at their moorings. " * 6)
    out = runner.invoke(app, ["eval", "ppl", "--text-file", str(text), "--window", "64", "--chunk", "16", "--json"])
    assert out.exit_code == 0, out.output
    fields = json.loads(out.stdout)
    assert set(fields) == {"ppl", "nll", "tokens_scored", "windows"}
    assert fields["ppl"] > 1 and fields["windows"] >= 2
