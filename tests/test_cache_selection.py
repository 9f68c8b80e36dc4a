"""Cache kinds chosen through Generator options and CLI flags, end to end on SmolLM2 (and a small random
model where a test needs a pool small enough to evict)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.hf_reference import save_random_checkpoint, small_configs
from zgen import Generator, Request, SamplingConfig, load_model
from zgen.cache.factory import compressed_kv, flat_kv, kv_dtype, paged_kv, prefix_cache, tiered_kv
from zgen.cache.paged_manager import PagedKVManager
from zgen.cache.tiered import TieredConfig, TieredKVManager
from zgen.cli import app
from zgen.errors import CacheError, ConfigError, PoolExhaustedError
from zgen.model import Model

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=32)
PROMPT = [{"role": "user", "content": "List three uses of copper."}]
SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and only about metals." for i in range(1, 12))


def test_pool_exhaustion_is_typed_and_harmless(smollm2: Model) -> None:
    gen = Generator(smollm2, paged_kv(max_memory_mb=10))  # about 13 blocks of 16 fp32 tokens
    with pytest.raises(PoolExhaustedError):
        gen.generate("word " * 300, SamplingConfig(max_new_tokens=200))
    small = gen.generate("Hi", SamplingConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    assert len(small.token_ids) == 4
    kv = gen.engine.kv
    assert isinstance(kv, PagedKVManager) and kv.pool.num_free == kv.pool.num_blocks


def test_bad_cache_options() -> None:
    from zgen.cache.factory import CacheOptions

    with pytest.raises(ConfigError, match="unknown kv dtype"):
        CacheOptions(kv_dtype="int2")
    with pytest.raises(ConfigError, match="paged"):
        CacheOptions(kind="tensor", prefix_cache_blocks=8)
    with pytest.raises(ConfigError, match="page layout"):  # never a silent switch to a paged cache
        CacheOptions(kind="tensor", kv_dtype="q4")
    assert CacheOptions(kv_dtype="q4").resolved_kind == "paged" and CacheOptions().resolved_kind == "tensor"
    with pytest.raises(ConfigError, match="page_size must be an integer"):
        paged_kv(page_size=0)(CacheOptions())


def test_page_size_defaults_to_the_platforms() -> None:
    from zgen.cache.factory import CacheOptions, default_page_size

    assert default_page_size() == 16  # a CPU; 64 where the paged GPU kernel reads the pages
    assert paged_kv()(CacheOptions()).resolved_page_size == default_page_size()
    assert paged_kv(page_size=32)(CacheOptions()).resolved_page_size == 32


def test_cli_cache_flags_and_eval_ppl(random_checkpoint: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    model = ["--model", str(random_checkpoint)]
    args = ["generate", *model, "-p", "w5 w6 w7", "--temperature", "0", "-n", "5", "--ignore-eos", "--json"]
    result = runner.invoke(app, [*args, "--kv-cache", "paged", "--kv-dtype", "q4", "--prefix-cache"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["token_ids"]) == 5
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 90 + 3}" for i in range(100)))
    out = runner.invoke(app, ["eval", "ppl", *model, "--text-file", str(text), "--window", "64", "--chunk", "16", "--json"])
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
        assert isinstance(tiered.engine.kv, TieredKVManager)
        assert tiered.engine.kv.tiers.config.warm_format == "exact"
        for prompt, want in zip(prompts, dense, strict=True):
            assert tiered.generate(prompt, TINY_GREEDY).token_ids == want.token_ids


def test_a_prefix_the_pool_evicted_is_served_from_the_tiers(tiny: Model) -> None:
    shared = _ids(3, 48)  # 3 full blocks
    later = shared + _ids(4, 5)
    unrelated = _ids(5, 120)  # with its 8 new tokens: all 8 blocks of the pool
    want = Generator(tiny).generate(later, TINY_GREEDY).token_ids
    results = {}
    for name, options in {"paged": (prefix_cache(64),), "tiered": (tiered_kv(),)}.items():
        with Generator(tiny, paged_kv(EIGHT_BLOCKS_MB), *options) as gen:
            kv = gen.engine.kv
            assert isinstance(kv, PagedKVManager) and kv.pool.num_blocks == 8
            gen.generate(shared, TINY_GREEDY)  # its 3 prompt blocks enter the prefix cache ...
            gen.generate(unrelated, TINY_GREEDY)  # ... and are evicted to make room for this one
            results[name] = gen.generate(later, TINY_GREEDY)
            if isinstance(kv, TieredKVManager):
                stats = kv.tiers.stats()
                assert stats.hits == 3 and stats.misses == 0
    assert results["paged"].usage.cached_prompt_tokens == 0  # gone with the eviction: all 53 prefilled
    assert results["tiered"].usage.cached_prompt_tokens == 48  # back from host RAM: 5 prefilled
    assert results["tiered"].token_ids == results["paged"].token_ids == want


def test_closing_the_generator_deletes_the_tiered_store(tiny: Model) -> None:
    with Generator(tiny, tiered_kv(TieredConfig(warm_format="int8"), max_memory_mb=EIGHT_BLOCKS_MB)) as gen:
        kv = gen.engine.kv
        assert isinstance(kv, TieredKVManager) and kv.pool.num_blocks == 8
        cold_dir = kv.tiers.cold_dir
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
    assert bad.exit_code == 2 and "a prefix cache shares pages and the" in bad.stderr
