"""The runtime: everything that runs the model, once.

* :mod:`~zgen.runtime.step` — the one step: forward, draw, the mixed prefill+decode step, the
  on-device decode loop;
* :mod:`~zgen.runtime.runner` — those steps compiled ahead of time per shape bucket;
* :mod:`~zgen.runtime.engine` — the scheduler: continuous batching of every request and context,
  chunked prefill, KV room reserved before each step;
* :mod:`~zgen.runtime.sampling` and :mod:`~zgen.runtime.stop` — the one sampling and stop vocabulary;
* :mod:`~zgen.runtime.speculation` — the speculator protocol and the speculative loop (draft, verify in
  one forward pass, accept, roll back) that runs every speculator of :mod:`zgen.speculative`;
* :mod:`~zgen.runtime.grammar` — structured output: grammars whose token masks constrain the draw;
* :mod:`~zgen.runtime.exchange` — the GPU mailbox through which a decode loop hands draws to a host
  thread and takes its answers (a grammar's masks) with no Python in the loop;
* :mod:`~zgen.runtime.metrics` — what an engine has done, as plain numbers and Prometheus text;
* :mod:`~zgen.runtime.calibration` — the key statistics the coded KV formats need (it runs the model).

Front ends (the Generator, contexts, the CLI) translate requests into
:class:`~zgen.runtime.engine.ForwardRequest` s on :class:`~zgen.runtime.sequence.Sequence` s.
"""

from zgen.runtime import stop
from zgen.runtime.engine import Engine, EngineConfig, EngineStats, ForwardRequest, ForwardResult
from zgen.runtime.grammar import Grammar
from zgen.runtime.metrics import EngineMetrics
from zgen.runtime.results import GenerationResult, Timings, TokenUsage
from zgen.runtime.sampling import Sampler, SamplingConfig
from zgen.runtime.sequence import Sequence
from zgen.runtime.stop import StopCondition

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "EngineStats",
    "ForwardRequest",
    "ForwardResult",
    "GenerationResult",
    "Grammar",
    "Sampler",
    "SamplingConfig",
    "Sequence",
    "StopCondition",
    "Timings",
    "TokenUsage",
    "stop",
]
