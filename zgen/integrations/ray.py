"""Batch generation on Ray Data, past one machine (``pip install "zgen[ray]"``).

Ray runs the distribution — one zgen engine per actor, the model loaded once per actor; zgen runs
the model inside each actor exactly as on one machine:

* :class:`ZgenPredictor` — a callable class for ``ray.data.Dataset.map_batches``: rows with a
  ``prompt`` column (text or token ids) or a ``messages`` column (chat messages) in; the same rows plus
  ``generated_text``, ``generated_token_ids``, ``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens`` and ``finish_reason`` out::

      ds = ray.data.read_parquet("s3://bucket/prompts/")
      ds = ds.map_batches(ZgenPredictor, fn_constructor_kwargs={"model": "/shared/llama-3-8b",
                          "sampling": {"temperature": 0.7, "max_new_tokens": 256}},
                          concurrency=8, num_gpus=1, batch_size=128)

* :func:`run_on_ray` (``zgen batch --ray``) — an OpenAI Batch API file run by Ray actors and written,
  as results stream back, into the same resumable output file :func:`zgen.batch.run` writes.

Both take ``speculative``: a function each actor calls with its loaded model to make its speculator
(``lambda model: DraftModel.early_exit(model, layers=8)``; Ray pickles the function, not a model).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from zgen.batch.format import error_record
from zgen.batch.job import JobOutput, count_requests, generate_records, job_generator, read_lines, screen
from zgen.batch.summary import BatchSummary
from zgen.cache.factory import CacheOption
from zgen.errors import ConfigError, InputError
from zgen.generator import Generator, Prompt, Request
from zgen.model import Model, load_model
from zgen.runtime.metrics import EngineMetrics, Histogram
from zgen.runtime.sampling import SamplingConfig
from zgen.runtime.speculation import Speculator

Batch = dict[str, Any]  # a Ray Data batch in the "numpy" format: column name -> array
SpeculatorFactory: TypeAlias = Callable[[Model], Speculator]  # an actor's speculator, made for its loaded model


class ZgenPredictor:
    """Generates for each row of a Ray Data batch (see the module docstring). ``sampling`` is a
    :class:`SamplingConfig` or its fields as a dict; ``cache_options`` choose the KV cache;
    ``speculative`` makes the actor's speculator from its model."""

    def __init__(
        self,
        model: str,
        *cache_options: CacheOption,
        dtype: str = "float32",
        sampling: SamplingConfig | Mapping[str, Any] | None = None,
        max_batch_size: int = 64,
        prefill_chunk: int = 512,
        speculative: SpeculatorFactory | None = None,
    ) -> None:
        self.sampling = sampling if isinstance(sampling, SamplingConfig) else SamplingConfig(**(sampling or {}))
        loaded = load_model(model, dtype=dtype)
        self.generator = Generator(
            loaded, *cache_options, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk,
            speculative=None if speculative is None else speculative(loaded),
        )

    def __call__(self, batch: Batch) -> Batch:
        results = self.generator.batch_generate([Request(prompt, self.sampling) for prompt in _prompts(batch)])
        out = dict(batch)
        out["generated_text"] = np.array([r.text for r in results], dtype=object)
        out["generated_token_ids"] = token_ids = np.empty(len(results), dtype=object)  # one array per row, ragged
        for i, r in enumerate(results):
            token_ids[i] = np.asarray(r.token_ids, np.int64)
        out["prompt_tokens"] = np.array([r.usage.prompt_tokens for r in results], np.int64)
        out["completion_tokens"] = np.array([r.usage.completion_tokens for r in results], np.int64)
        out["cached_tokens"] = np.array([r.usage.cached_prompt_tokens for r in results], np.int64)
        out["finish_reason"] = np.array([r.finish_reason for r in results], dtype=object)
        return out


def _prompts(batch: Batch) -> list[Prompt]:
    if "messages" in batch:
        return [[{str(k): str(v) for k, v in dict(m).items()} for m in row] for row in batch["messages"]]
    if "prompt" in batch:
        return [row if isinstance(row, str) else [int(t) for t in row] for row in batch["prompt"]]
    raise InputError(f"a batch needs a 'prompt' or a 'messages' column; it has {sorted(batch)}")


class BatchLineWorker:
    """A Ray actor's share of an OpenAI Batch API file: numbered request lines in, result records (as
    JSON text) out, computed by the same code as a local job (:func:`zgen.batch.job.generate_records`),
    each with the actor's id and its engine's metrics so far (JSON), for the job's summary."""

    def __init__(
        self, model: str, *cache_options: CacheOption, dtype: str = "float32", max_batch_size: int = 64,
        prefill_chunk: int = 512, model_name: str | None = None, speculative: SpeculatorFactory | None = None,
    ) -> None:
        loaded = load_model(model, dtype=dtype)
        self.generator = job_generator(
            loaded, cache_options, max_batch_size, prefill_chunk, speculative=None if speculative is None else speculative(loaded)
        )
        self.model_name = model_name or model
        self.window = 2 * max_batch_size
        self.worker = secrets.token_hex(8)

    def __call__(self, batch: Batch) -> Batch:
        pending = [(int(n), str(t)) for n, t in zip(batch["line"], batch["text"], strict=True)]
        records = generate_records(self.generator, pending, self.model_name, window=self.window)
        metrics = json.dumps(self.generator.metrics().as_dict())
        return {
            "record": np.array([json.dumps(r, ensure_ascii=False) for r in records], dtype=object),
            "worker": np.array([self.worker] * len(records), dtype=object),
            "metrics": np.array([metrics] * len(records), dtype=object),
        }


def metrics_from_json(text: str) -> EngineMetrics:
    """An :meth:`EngineMetrics.as_dict` snapshot sent as JSON, back as the snapshot."""
    raw = json.loads(text)
    for key in ("time_to_first_token", "inter_token_latency", "batch_occupancy"):
        h = raw[key]
        raw[key] = Histogram(tuple(h["bounds"]), tuple(h["counts"]), h["sum"])
    return EngineMetrics(**raw)


def run_on_ray(
    model: str,
    input: str | Path,
    output: str | Path,
    *options: CacheOption,
    actors: int = 1,
    gpus_per_actor: float = 0.0,
    lines_per_task: int = 64,
    max_batch_size: int = 64,
    prefill_chunk: int = 512,
    dtype: str = "float32",
    model_name: str | None = None,
    progress: bool = True,
    summary: str | Path | None = None,
    speculative: SpeculatorFactory | None = None,
) -> BatchSummary:
    """:func:`zgen.batch.run` with Ray actors doing the generation: ``actors`` of them (each loads
    ``model``, so it must be a built-in name or a path every node can read), ``gpus_per_actor`` GPUs
    each, ``lines_per_task`` request lines per Ray task; ``speculative`` makes each actor's
    speculator from its model. Connects to the Ray cluster that ``ray.init()`` finds
    (``RAY_ADDRESS``), or starts a local one. Records stream back to this process, which alone writes
    the output: resuming works as for a local job. The summary adds up the actors' engine metrics
    (each actor's engine is new, so its figures are this job's)."""
    try:
        import ray
        import ray.data
    except ImportError as err:
        raise ConfigError(f"running on Ray needs Ray Data ({err}); pip install 'zgen[ray]'") from None
    if isinstance(actors, bool) or not isinstance(actors, int) or actors < 1:
        raise ConfigError(f"actors must be an integer >= 1, got {actors!r}")
    lines = read_lines(Path(input))
    latest: dict[str, EngineMetrics] = {}  # each actor's last snapshot
    with JobOutput(output, progress=progress, generated_tokens=lambda: sum(m.generated_tokens for m in list(latest.values()))) as out:
        out.check_modules(None)
        screened = screen(lines, out.existing.keys)
        out.start(len(screened.pending) + len(screened.errors))
        for error in screened.errors:
            out.put(error_record(error))
        if screened.pending:
            if not ray.is_initialized():
                ray.init()
            ray.data.DataContext.get_current().enable_progress_bars = False  # the job's own bar counts records
            dataset = ray.data.from_items([{"line": n, "text": t} for n, t in screened.pending]).map_batches(
                BatchLineWorker,
                fn_constructor_args=(model, *options),
                fn_constructor_kwargs={
                    "dtype": dtype, "max_batch_size": max_batch_size, "prefill_chunk": prefill_chunk, "model_name": model_name,
                    "speculative": speculative,
                },
                concurrency=actors,
                num_gpus=gpus_per_actor,
                batch_size=lines_per_task,
                batch_format="numpy",
            )
            for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
                for text, worker, metrics in zip(batch["record"], batch["worker"], batch["metrics"], strict=True):
                    snapshot = metrics_from_json(str(metrics))
                    if str(worker) not in latest or snapshot.requests >= latest[str(worker)].requests:  # batches may arrive out of order
                        latest[str(worker)] = snapshot
                    out.put(json.loads(str(text)))
    return out.summary(list(latest.values()), count_requests(lines), screened.skipped, (), summary, speculating=speculative is not None)


__all__ = ["BatchLineWorker", "ZgenPredictor", "run_on_ray"]
