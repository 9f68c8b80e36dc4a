"""Pool exhaustion and scheduling on a tiny random model with an 8-page pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from zgen import Context, Engine, EngineConfig, Sampler, stop
from zgen.cache.factory import CacheOptions, kv_dtype, paged_kv
from zgen.contexts import gather
from zgen.errors import ConfigError, InputError, PoolExhaustedError, SnapshotError


def test_pool_exhaustion_is_typed_and_leaves_everything_intact(tiny_engine: Engine) -> None:
    ctx = Context(tiny_engine)
    ctx.fill_tokens([3 + i % 90 for i in range(200)])  # 200 tokens: 13 pages, the pool has 8
    free = tiny_engine.kv.pool.num_free
    with pytest.raises(PoolExhaustedError):
        ctx.flush()
    assert ctx.kv_len == 0 and tiny_engine.kv.pool.num_free == free
    ctx.release()
    small = Context(tiny_engine)
    small.fill_tokens(range(3, 40))
    assert len(small.generate_result(Sampler.greedy(), stop.max_len(4)).token_ids) == 4
    small.release()
    assert tiny_engine.kv.pool.num_free == tiny_engine.kv.pool.num_blocks


def test_waiting_request_takes_the_pages_of_an_idle_context(tiny_engine: Engine) -> None:
    budget = tiny_engine.cache_options.max_memory_mb
    assert budget is not None
    waiting = Engine(tiny_engine.model, paged_kv(budget), config=EngineConfig(on_pool_exhausted="wait"))
    prompt = [3 + i % 90 for i in range(100)]
    holder = Context(waiting)
    holder.fill_tokens(prompt)
    holder.flush()  # 7 of 8 pages
    other = Context(waiting)
    other.fill_tokens([3 + i % 90 for i in range(40)])
    other.flush()  # the idle holder is preempted: its K/V are freed and recomputed when it runs again
    assert other.kv_len == 39 and waiting.stats.preemptions == 1
    other.release()
    fresh = Context(waiting)
    fresh.fill_tokens(prompt)
    expected = fresh.generate(Sampler.greedy(), stop.max_len(4))
    fresh.release()
    assert holder.generate(Sampler.greedy(), stop.max_len(4)) == expected


def test_waiting_request_fails_when_nothing_can_free_pages(tiny_engine: Engine) -> None:
    budget = tiny_engine.cache_options.max_memory_mb
    assert budget is not None
    waiting = Engine(tiny_engine.model, paged_kv(budget), config=EngineConfig(on_pool_exhausted="wait"))
    holder = Context(waiting)
    holder.fill_tokens([3 + i % 90 for i in range(100)])
    holder.flush()  # 7 of 8 pages
    holder.mask_token_range(10, 20)  # K/V computed under masks cannot be recomputed: never preempted
    other = Context(waiting)
    other.fill_tokens([3 + i % 90 for i in range(40)])
    with pytest.raises(PoolExhaustedError, match="no running request"):
        gather(holder.generate_async(Sampler.greedy(), stop.max_len(2)), other.flush_async())
    holder.release()
    other.flush()  # fits now
    assert other.kv_len == 39


def test_engine_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        EngineConfig(max_batch=0)
    with pytest.raises(ConfigError):
        EngineConfig(prefill_chunk=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        CacheOptions(kv_dtype="int3")


@pytest.mark.parametrize("format", ["fp8", "q4"])
def test_quantized_pages_save_and_open_exactly(tiny_engine: Engine, format: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZGEN_STORE_DIR", str(tmp_path))
    budget = tiny_engine.cache_options.max_memory_mb
    assert budget is not None
    engine = Engine(tiny_engine.model, paged_kv(budget), kv_dtype(format))
    ctx = Context(engine)
    ctx.fill_tokens([3 + i % 50 for i in range(37)])
    ctx.generate(Sampler.greedy(), stop.max_len(3))
    ctx.save("quantized")
    expected = ctx.generate_result(Sampler.greedy(), stop.max_len(6)).token_ids
    ctx.release()
    reopened = Context.open(engine, "quantized")
    assert reopened.generate_result(Sampler.greedy(), stop.max_len(6)).token_ids == expected
    with pytest.raises(SnapshotError, match="kv_dtype"):
        Context.open(tiny_engine, "quantized")  # same model, other page format


def test_a_context_runs_one_call_at_a_time(tiny_engine: Engine) -> None:
    ctx = Context(tiny_engine)
    ctx.fill_tokens(range(3, 20))
    with pytest.raises(InputError, match="already has a call running"):
        gather(ctx.generate_async(Sampler.greedy(), stop.max_len(2)), ctx.generate_async(Sampler.greedy(), stop.max_len(2)))
    ctx.release()
    again = Context(tiny_engine)  # the engine serves the next event loop normally
    again.fill_tokens(range(3, 10))
    assert len(again.generate_result(Sampler.greedy(), stop.max_len(2)).token_ids) == 2
    again.release()
