"""Engine metrics: the plain numbers match what was generated, the cache's pages and prefix hits are
reported, and the Prometheus export parses to the same numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hf_reference import save_random_checkpoint, small_configs
from zgen import Context, Engine, Generator, Request, SamplingConfig, load_model
from zgen.cache.factory import paged_kv, prefix_cache
from zgen.contexts.drafter import NgramDrafter
from zgen.model import Model
from zgen.errors import ConfigError
from zgen.runtime.metrics import EngineMetrics, Histogram


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    directory: Path = tmp_path_factory.mktemp("tiny-hf")
    save_random_checkpoint(small_configs()["llama_tied"], directory)
    return load_model(directory)


def greedy(n: int, **more: object) -> SamplingConfig:
    return SamplingConfig(temperature=0.0, max_new_tokens=n, **more)  # type: ignore[arg-type]


def test_counts_match_what_was_generated(tiny: Model) -> None:
    gen = Generator(tiny, max_batch_size=4)
    requests = [Request("w3 w4 w5", greedy(5, ignore_eos=True)), Request("w6 w7", greedy(3, ignore_eos=True)),
                Request([3, 4, 5, 6, 7], greedy(4, stop_token_ids=(9,)))]
    results = gen.batch_generate(requests)
    streamed = "".join(gen.generate_stream("w8 w9", greedy(6, ignore_eos=True)))
    results.append(gen.generate("w8 w9", greedy(6, ignore_eos=True)))
    assert streamed == results[-1].text

    m = gen.metrics()
    assert m.requests == 5 and m.requests_running == 0
    reasons = [r.finish_reason for r in results]
    assert sum(m.requests_finished.values()) == 5
    assert m.requests_finished.get("length", 0) == reasons.count("length") + 1  # the streamed one
    generated = sum(r.usage.completion_tokens for r in results) + 6
    assert m.generated_tokens == generated
    assert m.prompt_tokens == sum(r.usage.prompt_tokens for r in results) + len(results[-1].prompt_token_ids)
    assert m.time_to_first_token.count == 5
    assert m.inter_token_latency.count == generated - 5  # every token after a request's first
    assert m.batch_occupancy.count == m.steps == gen.engine.stats.steps
    assert 0 < m.time_to_first_token.mean and 0 < m.inter_token_latency.mean
    assert m.kv_pages_total is None  # the dense cache has no pages

    stream = gen.generate_stream("w3 w4", greedy(32, ignore_eos=True))
    next(stream)
    stream.close()  # cancelled: its row is freed at once
    m = gen.metrics()
    assert m.requests_finished["cancelled"] == 1 and m.requests_running == 0


def test_pages_prefix_hits_failures_and_speculation_on_a_paged_engine(tiny: Model) -> None:
    engine = Engine(tiny, paged_kv(4, page_size=4), prefix_cache(64))
    prompt = list(range(3, 23))
    first = Context(engine)
    first.fill_tokens(prompt)
    first.generate(greedy(4, ignore_eos=True))
    first.release()  # its full pages go to the prefix cache
    second = Context(engine)
    second.fill_tokens(prompt)
    result = second.generate_result(greedy(4, ignore_eos=True))
    assert result.usage.cached_prompt_tokens > 0
    fork = second.fork()
    m = engine.metrics()
    assert m.prefix_cache_lookups is not None and m.prefix_cache_hits is not None and m.prefix_cache_hit_tokens is not None
    assert m.prefix_cache_hits >= 1 and m.prefix_cache_hit_tokens >= result.usage.cached_prompt_tokens
    assert m.cached_prompt_tokens == result.usage.cached_prompt_tokens
    assert m.kv_pages_total and m.kv_pages_used and m.kv_pages_shared  # the fork shares every page
    assert m.kv_pages_shared >= fork.pages_shared > 0

    spec = fork.generate_with_drafter(NgramDrafter(max_draft=4), greedy(8, ignore_eos=True))
    m = engine.metrics()
    assert spec.token_ids and m.speculative_draft_tokens >= m.speculative_accepted_tokens >= 0
    assert 0.0 <= m.speculative_acceptance_rate <= 1.0


def test_prometheus_export_parses_to_the_plain_numbers(tiny: Model) -> None:
    gen = Generator(tiny, paged_kv(4), prefix_cache(32))
    results = gen.batch_generate([Request("w3 w4 w5 w6", greedy(4, ignore_eos=True))] * 2)
    m: EngineMetrics = gen.metrics()
    families = {f.name: f for f in text_string_to_metric_families(m.prometheus())}

    def value(name: str, suffix: str = "", **labels: str) -> float:
        samples = [s for s in families[name].samples if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(samples) == 1, (name, suffix, labels)
        return samples[0].value

    assert value("zgen_requests", "_total") == m.requests == 2
    assert value("zgen_generated_tokens", "_total") == m.generated_tokens == sum(len(r.token_ids) for r in results)
    assert value("zgen_prompt_tokens", "_total") == m.prompt_tokens
    assert value("zgen_requests_finished", "_total", reason="length") == 2
    assert value("zgen_time_to_first_token_seconds", "_count") == 2
    assert value("zgen_time_to_first_token_seconds", "_bucket", le="+Inf") == 2
    assert value("zgen_inter_token_latency_seconds", "_count") == m.inter_token_latency.count == 6
    assert value("zgen_batch_occupancy_ratio", "_count") == m.steps
    assert value("zgen_kv_pages", state="total") == m.kv_pages_total
    assert value("zgen_prefix_cache_lookups", "_total") == m.prefix_cache_lookups
    assert value("zgen_speculative_steps", "_total") == m.speculative_steps == 0
    assert m.as_dict()["generated_tokens"] == m.generated_tokens


def test_forward_passes_add_no_prompt_tokens(tiny: Model) -> None:
    gen = Generator(tiny)
    gen.logits([3, 4, 5, 6])  # a forward pass (scoring), not a generation
    result = gen.generate("w3 w4 w5", greedy(2, ignore_eos=True))
    m = gen.metrics()
    assert m.requests_finished == {"done": 1, "length": 1}
    assert m.prompt_tokens == result.usage.prompt_tokens


def test_histogram_quantiles_and_sums() -> None:
    h = Histogram((1.0, 2.0, 4.0), (2, 2, 0, 1), 9.0)  # two in (0, 1], two in (1, 2], one above 4
    assert h.quantile(0.0) == 0.0 and h.quantile(0.2) == 0.5 and h.quantile(0.5) == 1.25
    assert h.quantile(0.99) == 4.0  # above every bound: the last bound, as Prometheus says
    assert Histogram((1.0,), (0, 0), 0.0).quantile(0.5) is None
    with pytest.raises(ConfigError):
        h.quantile(1.5)
    both = h + h
    assert (both.counts, both.sum, both.quantile(0.5)) == ((4, 4, 0, 2), 18.0, 1.25)
    with pytest.raises(ConfigError):
        _ = h + Histogram((1.0,), (1, 0), 0.5)
