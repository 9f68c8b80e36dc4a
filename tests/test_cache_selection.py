"""Cache kinds chosen through Generator options and CLI flags, end to end on SmolLM2 (and a small random
model where a test needs a pool small enough to evict)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.hf_reference import hf_teacher_forced, save_random_checkpoint, small_configs
from zgen import Generator, Request, SamplingConfig, load_model
from zgen.cache.options import compressed_kv, flat_kv, kv_dtype, paged_kv, prefix_cache, tiered_kv
from zgen.cache.tiered import TieredConfig, TieredPagedBackend
from zgen.cli import app
from zgen.errors import CacheError, ConfigError, PoolExhaustedError
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


# -- the tiered cache, on a small random model (16-token blocks of 8 KiB: a pool of 8 is 0.0625 MiB) ---

EIGHT_BLOCKS_MB = 8 * 16 * 2 * 256 / 2**20  # blocks x tokens x layers x fp32 K+V bytes per token and layer
TINY_GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen2")
    save_random_checkpoint(small_configs()["qwen2"], directory)
    return directory


@pytest.fixture(scope="module")
def tiny(random_checkpoint: Path) -> Model:
    return load_model(random_checkpoint, dtype="float32")


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 96, n).tolist()


def test_tiered_greedy_equals_the_tensor_cache(tiny: Model) -> None:
    prompts = [_ids(0, 40), _ids(0, 40)[:33] + _ids(1, 9), _ids(2, 7)]
    dense = Generator(tiny).batch_generate([Request(p, TINY_GREEDY) for p in prompts])
    with Generator(tiny, tiered_kv()) as tiered:
        assert isinstance(tiered.kv_backend, TieredPagedBackend)
        assert tiered.kv_backend.tiers.config.warm_format == "exact"
        for prompt, want in zip(prompts, dense, strict=True):
            assert tiered.generate(prompt, TINY_GREEDY).token_ids == want.token_ids


def test_a_prefix_the_pool_evicted_is_served_from_the_tiers(tiny: Model) -> None:
    shared = _ids(3, 48)  # 3 full blocks
    later = shared + _ids(4, 5)
    unrelated = _ids(5, 48)
    want = Generator(tiny).generate(later, TINY_GREEDY).token_ids
    results = {}
    for name, options in {"paged": (prefix_cache(64),), "tiered": (tiered_kv(),)}.items():
        with Generator(tiny, paged_kv(EIGHT_BLOCKS_MB), *options) as gen:  # one request fills the pool
            assert gen.kv_backend.pool.num_blocks == 8  # type: ignore[attr-defined]
            gen.generate(shared, TINY_GREEDY)  # its 3 prompt blocks enter the prefix cache ...
            gen.generate(unrelated, TINY_GREEDY)  # ... and are evicted to make room for this one
            results[name] = gen.generate(later, TINY_GREEDY)
            if name == "tiered":
                stats = gen.kv_backend.tiers.stats()  # type: ignore[attr-defined]
                assert stats.hits == 3 and stats.misses == 0
    assert results["paged"].usage.cached_prompt_tokens == 0  # gone with the eviction: all 53 prefilled
    assert results["tiered"].usage.cached_prompt_tokens == 48  # back from host RAM: 5 prefilled
    assert results["tiered"].token_ids == results["paged"].token_ids == want


def test_closing_the_generator_deletes_the_tiered_store(tiny: Model) -> None:
    with Generator(tiny, tiered_kv(TieredConfig(warm_format="int8"), max_memory_mb=EIGHT_BLOCKS_MB)) as gen:
        backend = gen.kv_backend
        assert isinstance(backend, TieredPagedBackend) and backend.pool.num_blocks == 8
        cold_dir = backend.tiers.cold_dir
        assert cold_dir.exists()
    assert not cold_dir.exists()
    with pytest.raises(CacheError, match="closed"):
        gen.generate([5, 6, 7], TINY_GREEDY)


def test_bad_tiered_options_are_config_errors(tiny: Model) -> None:
    with pytest.raises(ConfigError, match="hot_blocks"):
        tiered_kv(TieredConfig(hot_blocks=0))
    with pytest.raises(ConfigError, match="takes a TieredConfig"):
        Generator(tiny, tiered_kv({"warm_format": "int8"}))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="warm_format='exact'"):
        Generator(tiny, tiered_kv(TieredConfig(warm_format="int8")), kv_dtype("q4"))
    with pytest.raises(ConfigError, match="tiered cache, not the compressed"):
        Generator(tiny, tiered_kv(TieredConfig()), compressed_kv())
    with pytest.raises(ConfigError, match="prefix cache"):
        Generator(tiny, flat_kv(), prefix_cache(8))
    with pytest.raises(ConfigError, match="holds no block"):
        Generator(tiny, tiered_kv(max_memory_mb=0.001))


def test_cli_tiered_cache_on_generate_and_eval_ppl(random_checkpoint: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    model = ["--model", str(random_checkpoint)]
    args = ["generate", *model, "-p", "w5 w6 w7 w8", "--temperature", "0", "-n", "4", "--ignore-eos", "--json"]
    want = json.loads(runner.invoke(app, args).stdout)["token_ids"]
    result = runner.invoke(app, [*args, "--kv-cache", "tiered", "--prefix-cache"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["token_ids"] == want
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 90 + 3}" for i in range(100)))
    out = runner.invoke(app, ["eval", "ppl", *model, "--text-file", str(text), "--window", "32", "--chunk", "16", "--kv-cache", "tiered", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["windows"] == 4
    bad = runner.invoke(app, ["generate", *model, "-p", "w5", "--kv-cache", "compressed", "--prefix-cache"])
    assert bad.exit_code == 2 and "ConfigError" in bad.stderr
