"""A batch job's summary: the output file's counts, and what the engines' metrics collectors measured.

The request counts (succeeded, failed, skipped, written) come from the output file; the tokens,
tokens/s and latency percentiles are read from the runtime's metrics (:meth:`Engine.metrics`, one
snapshot per replica, added up), so they count what the engines did in this run: a request with ``n``
choices counts its prompt ``n`` times (its output record, as the API does, once).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import reduce
from operator import add
from pathlib import Path

from zgen.runtime.metrics import EngineMetrics, Histogram
from zgen.runtime.results import SpeculativeStats


@dataclass(frozen=True)
class Percentiles:
    """Seconds at the 50th, 90th and 99th percentile, estimated from a metrics histogram's buckets."""

    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(histogram: Histogram) -> Percentiles | None:
        """None when nothing was observed."""
        p50, p90, p99 = (histogram.quantile(q) for q in (0.5, 0.9, 0.99))
        if p50 is None or p90 is None or p99 is None:
            return None
        return Percentiles(p50, p90, p99)


@dataclass(frozen=True)
class BatchSummary:
    """What a job did. ``succeeded``/``failed`` count the whole output file (earlier runs included);
    the rest is this run's: ``generations`` (choices the engines generated), the prompt, cached and
    output tokens, output tokens/s over ``wall_s``, the time to first token and inter-token latency
    percentiles, and with a speculator ``speculative`` (drafted and accepted tokens, verification
    passes), all read from the engines' metrics."""

    requests: int  # input lines
    succeeded: int
    failed: int
    skipped: int  # already in the output when this run started
    written: int  # records this run appended
    generations: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    wall_s: float
    output_tokens_per_s: float
    time_to_first_token_s: Percentiles | None = None
    inter_token_latency_s: Percentiles | None = None
    replica_requests: tuple[int, ...] = ()  # requests each replica finished this run (data parallelism)
    speculative: SpeculativeStats | None = None

    def to_json(self) -> dict[str, object]:
        """The fields as JSON; ``speculative`` as ``zgen generate --json`` gives it (rates included)."""
        out = asdict(self)
        out["speculative"] = None if self.speculative is None else self.speculative.as_dict()
        return out

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def describe(self) -> str:
        text = (
            f"{self.requests} requests: {self.succeeded} succeeded, {self.failed} failed, {self.skipped} were already "
            f"done; this run wrote {self.written} records, {self.completion_tokens} output tokens ({self.prompt_tokens} "
            f"prompt, {self.cached_tokens} cached) in {self.wall_s:.1f} s, {self.output_tokens_per_s:,.1f} output tokens/s"
        )
        for what, p in (("time to first token", self.time_to_first_token_s), ("inter-token latency", self.inter_token_latency_s)):
            if p is not None:
                text += f"; {what} p50 {_duration(p.p50)}, p90 {_duration(p.p90)}, p99 {_duration(p.p99)}"
        if self.speculative is not None:
            s = self.speculative
            text += (
                f"; speculative: {s.accepted_tokens} of {s.draft_tokens} drafted tokens accepted "
                f"({s.acceptance_rate:.0%}), {s.mean_accepted_per_step:.2f} a verification pass"
            )
        return text


def _duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def summarize(
    metrics: Sequence[EngineMetrics], *, requests: int, succeeded: int, failed: int, skipped: int, written: int,
    wall_s: float, replica_requests: Sequence[int] = (), speculating: bool = False,
) -> BatchSummary:
    """The summary of a run whose engines' metrics are ``metrics`` (one snapshot per engine, taken when
    the run ended; the engines were made for it); ``speculating``: the engines had a speculator."""
    generated = sum(m.generated_tokens for m in metrics)
    finished = [m.requests_finished for m in metrics]
    return BatchSummary(
        requests=requests,
        succeeded=succeeded,
        failed=failed,
        skipped=skipped,
        written=written,
        generations=sum(f.get("stop", 0) + f.get("length", 0) for f in finished),
        prompt_tokens=sum(m.prompt_tokens for m in metrics),
        cached_tokens=sum(m.cached_prompt_tokens for m in metrics),
        completion_tokens=generated,
        wall_s=wall_s,
        output_tokens_per_s=generated / wall_s if wall_s > 0 else 0.0,
        time_to_first_token_s=_percentiles([m.time_to_first_token for m in metrics]),
        inter_token_latency_s=_percentiles([m.inter_token_latency for m in metrics]),
        replica_requests=tuple(replica_requests),
        speculative=SpeculativeStats(
            sum(m.speculative_draft_tokens for m in metrics),
            sum(m.speculative_accepted_tokens for m in metrics),
            sum(m.speculative_steps for m in metrics),
        ) if speculating else None,
    )


def _percentiles(histograms: Sequence[Histogram]) -> Percentiles | None:
    return Percentiles.of(reduce(add, histograms)) if histograms else None
