"""What an engine has done, as plain numbers and in the Prometheus text format.

The engine feeds a :class:`MetricsCollector` as it runs (requests submitted and finished, tokens as
they reach the host, the rows of every step); :meth:`Engine.metrics` (and ``Generator.metrics()``)
returns an :class:`EngineMetrics` snapshot that adds what the cache knows (pages used and shared,
prefix-cache lookups). Everything is readable without extra packages; :meth:`EngineMetrics.prometheus`
and :class:`PrometheusCollector` (``pip install 'zgen[metrics]'``) export it for scraping.

Latencies are seen from the host: time to first token runs from submission to the step that drew it;
tokens that reach the host together (a decode loop of several steps per sync) are spread evenly over
the interval since the request's previous tokens, one inter-token observation each.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from zgen.errors import ConfigError

__all__ = ["EngineMetrics", "Histogram", "MetricsCollector", "PrometheusCollector"]

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
OCCUPANCY_BUCKETS = (0.0625, 0.125, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Histogram:
    """Observations counted per bucket: ``counts[i]`` fell in ``(bounds[i-1], bounds[i]]``, the last
    count is above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (``0 <= q <= 1``) as Prometheus' ``histogram_quantile`` estimates it:
        linearly within the bucket it falls in (the first starts at 0; above every bound, the last
        bound). None without observations."""
        if not 0.0 <= q <= 1.0:
            raise ConfigError(f"a quantile lies in [0, 1], got {q}")
        if not self.count:
            return None
        rank, seen, lower = q * self.count, 0, 0.0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            if n and seen + n >= rank:
                return lower + (bound - lower) * (rank - seen) / n
            seen, lower = seen + n, bound
        return self.bounds[-1]

    def __add__(self, other: Histogram) -> Histogram:
        """Both histograms' observations (e.g. of several engines), over the same buckets."""
        if self.bounds != other.bounds:
            raise ConfigError("only histograms over the same buckets add up")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)), self.sum + other.sum)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` per bucket, ending with ``(inf, count)``."""
        total, out = 0, list[tuple[float, int]]()
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class _Counts:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def frozen(self) -> Histogram:
        return Histogram(self.bounds, tuple(self.counts), self.sum)


@dataclass(frozen=True)
class EngineMetrics:
    """A snapshot of an engine's metrics (counters since it was created).

    ``requests_finished`` by reason: ``stop`` / ``length`` (generations), ``done`` (forward passes),
    ``failed``, ``cancelled``. ``prompt_tokens``/``generated_tokens``/``cached_prompt_tokens`` add up
    the finished generations' usage. ``batch_occupancy``: rows per step over the engine's
    ``max_batch``. KV pages and prefix-cache numbers are ``None`` on caches without pages or without a
    prefix cache.
    """

    requests: int
    requests_running: int
    requests_finished: Mapping[str, int]
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    steps: int
    forward_passes: int
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    batch_occupancy: Histogram
    kv_pages_total: int | None = None
    kv_pages_used: int | None = None
    kv_pages_shared: int | None = None
    prefix_cache_lookups: int | None = None
    prefix_cache_hits: int | None = None
    prefix_cache_hit_tokens: int | None = None
    speculative_draft_tokens: int = 0
    speculative_accepted_tokens: int = 0
    speculative_steps: int = 0  # verification passes that checked a row's draft, summed over rows

    @property
    def speculative_acceptance_rate(self) -> float:
        drafted = self.speculative_draft_tokens
        return self.speculative_accepted_tokens / drafted if drafted else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able numbers (histograms as ``{"bounds", "counts", "sum"}``)."""
        return asdict(self)

    def prometheus(self, prefix: str = "zgen") -> str:
        """The Prometheus text exposition of this snapshot (needs ``prometheus-client``)."""
        registry, generate_latest = _prometheus_registry()
        registry.register(PrometheusCollector(lambda: self, prefix))
        return generate_latest(registry).decode()


class MetricsCollector:
    """What the engine reports while it runs (thread-safe; every method is a few additions)."""

    def __init__(self, max_batch: int) -> None:
        self._lock = threading.Lock()
        self._max_batch = max_batch
        self.requests = 0
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = _Counts(TTFT_BUCKETS)
        self.itl = _Counts(ITL_BUCKETS)
        self.occupancy = _Counts(OCCUPANCY_BUCKETS)
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.speculative_steps = 0

    def submitted(self) -> None:
        with self._lock:
            self.requests += 1

    def step(self, rows: int) -> None:
        with self._lock:
            self.occupancy.observe(rows / self._max_batch)

    def tokens(self, count: int, *, first_token_s: float | None, interval_s: float) -> None:
        """``count`` generated tokens reached the host; ``first_token_s``: the request's first token
        is among them, this long after submission; ``interval_s``: the time the other ones took."""
        if count <= 0:
            return
        with self._lock:
            self.generated_tokens += count
            later = count
            if first_token_s is not None:
                self.ttft.observe(first_token_s)
                later -= 1
            if later:
                self.itl.observe(max(interval_s, 0.0) / count, later)

    def finished_request(self, reason: str, *, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if reason != "done":  # a forward pass (reason "done") is no generation: its tokens are no prompt's
                self.prompt_tokens += prompt_tokens
                self.cached_prompt_tokens += cached_tokens

    def speculation(self, drafted: int, accepted: int, steps: int) -> None:
        """A row's speculative loop verified ``drafted`` tokens in ``steps`` passes and kept ``accepted`` of them."""
        if not 0 <= accepted <= drafted or steps < 0:
            raise ConfigError(
                f"accepted draft tokens ({accepted}) must lie in [0, drafted = {drafted}] and passes ({steps}) must be >= 0"
            )
        with self._lock:
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            self.speculative_steps += steps

    def snapshot(self, *, steps: int, forward_passes: int) -> EngineMetrics:
        """The counters so far (the engine adds its step counts here and its cache's numbers after)."""
        with self._lock:
            return EngineMetrics(
                requests=self.requests,
                requests_running=self.requests - sum(self.finished.values()),
                requests_finished=dict(self.finished),
                prompt_tokens=self.prompt_tokens,
                cached_prompt_tokens=self.cached_prompt_tokens,
                generated_tokens=self.generated_tokens,
                steps=steps,
                forward_passes=forward_passes,
                time_to_first_token=self.ttft.frozen(),
                inter_token_latency=self.itl.frozen(),
                batch_occupancy=self.occupancy.frozen(),
                speculative_draft_tokens=self.draft_tokens,
                speculative_accepted_tokens=self.accepted_tokens,
                speculative_steps=self.speculative_steps,
            )


def _prometheus_registry() -> tuple[Any, Callable[[Any], bytes]]:
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError:
        raise ConfigError("the Prometheus export needs prometheus-client: pip install 'zgen[metrics]'") from None
    return CollectorRegistry(auto_describe=False), generate_latest


class PrometheusCollector:
    """A ``prometheus_client`` collector over ``snapshot()`` (e.g. ``engine.metrics``)::

        from prometheus_client import REGISTRY, start_http_server
        REGISTRY.register(PrometheusCollector(generator.metrics))
        start_http_server(8000)
    """

    def __init__(self, snapshot: Callable[[], EngineMetrics], prefix: str = "zgen") -> None:
        self.snapshot = snapshot
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        m, p = self.snapshot(), self.prefix

        def counter(name: str, doc: str, value: float) -> Any:
            return CounterMetricFamily(f"{p}_{name}", doc, value=value)

        def histogram(name: str, doc: str, h: Histogram) -> Any:
            buckets = [("+Inf" if b == float("inf") else repr(float(b)), n) for b, n in h.cumulative()]
            return HistogramMetricFamily(f"{p}_{name}", doc, buckets=buckets, sum_value=h.sum)

        yield counter("requests", "Requests submitted.", m.requests)
        finished = CounterMetricFamily(f"{p}_requests_finished", "Requests finished, by reason.", labels=["reason"])
        for reason, n in sorted(m.requests_finished.items()):
            finished.add_metric([reason], n)
        yield finished
        yield GaugeMetricFamily(f"{p}_requests_running", "Requests submitted and not finished.", value=m.requests_running)
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", m.prompt_tokens)
        yield counter("cached_prompt_tokens", "Prompt tokens whose K/V were already stored.", m.cached_prompt_tokens)
        yield counter("generated_tokens", "Generated tokens.", m.generated_tokens)
        yield counter("steps", "Compiled steps run.", m.steps)
        yield counter("forward_passes", "Model forward passes run on the device.", m.forward_passes)
        yield histogram("time_to_first_token_seconds", "From submission to the first generated token.", m.time_to_first_token)
        yield histogram("inter_token_latency_seconds", "Between generated tokens of one request.", m.inter_token_latency)
        yield histogram("batch_occupancy_ratio", "Rows per step over the engine's max batch.", m.batch_occupancy)
        if m.kv_pages_total is not None:
            pages = GaugeMetricFamily(f"{p}_kv_pages", "KV pages of the pool, by state.", labels=["state"])
            for state, n in (("total", m.kv_pages_total), ("used", m.kv_pages_used), ("shared", m.kv_pages_shared)):
                pages.add_metric([state], n or 0)
            yield pages
        if m.prefix_cache_lookups is not None:
            yield counter("prefix_cache_lookups", "Prefix-cache lookups.", m.prefix_cache_lookups)
            yield counter("prefix_cache_hits", "Prefix-cache lookups that reused K/V.", m.prefix_cache_hits or 0)
            yield counter("prefix_cache_hit_tokens", "Tokens served from the prefix cache.", m.prefix_cache_hit_tokens or 0)
        yield counter("speculative_draft_tokens", "Draft tokens verified.", m.speculative_draft_tokens)
        yield counter("speculative_accepted_tokens", "Draft tokens accepted.", m.speculative_accepted_tokens)
        yield counter("speculative_steps", "Verification passes that checked a row's draft, summed over rows.", m.speculative_steps)
