"""A batch job: a JSONL file of OpenAI Batch API requests in, a resumable JSONL file of results out.

The path of a job: read every input line → skip those whose custom_id the output already holds → check
every remaining line (JSON, url, parameters, duplicate custom_ids, prompt length: a bad line becomes an
error record for its custom_id and the job goes on) → queue the valid ones on the Generator's engine as
room allows (a window of ``2 × max_batch_size`` choices in flight, topped up the moment one finishes;
the engine refills freed rows ``refill_rows`` at a time so their prompts prefill together, and a shared
prompt prefix is served from the prefix cache) →
each request's record is appended and synced as soon as all its choices are done
(:mod:`zgen.batch.output`).

The job owns no decode loop: it translates lines into Generator requests (and, for ``top_logprobs``, a
scoring pass on the engine) and records what comes back. With ``data_parallel=N``, N replicas of the
model on N local devices pull requests from one queue and write into the one output file.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zgen.batch.format import (
    BatchRequest,
    Choice,
    LineError,
    RecordKey,
    TokenLogprobs,
    choice_sampling,
    error_record,
    parse_line,
    read_custom_id,
    success_record,
)
from zgen.batch.output import RecordWriter, ResultsFile
from zgen.batch.progress import JobProgress
from zgen.cache.factory import CacheOption
from zgen.errors import ConfigError, InputError, PromptTooLongError, ZgenError
from zgen.generator import Generator, Request, Submitted
from zgen.model import Model, load_model, split_model
from zgen.runtime.engine import ForwardRequest, Job
from zgen.runtime.results import GenerationResult

Device = Any  # a jax.Device (jax's stubs declare the name as a variable, not a type)


@dataclass(frozen=True)
class BatchSummary:
    """What a job did. ``succeeded``/``failed`` count the whole output file (earlier runs included);
    the token counts, ``written`` and the rate are this run's."""

    requests: int  # input lines
    succeeded: int
    failed: int
    skipped: int  # already in the output when this run started
    written: int  # records this run appended
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    wall_s: float
    output_tokens_per_s: float
    replica_requests: tuple[int, ...] = ()  # requests each replica finished this run (data parallelism)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"{self.requests} requests: {self.succeeded} succeeded, {self.failed} failed, {self.skipped} were already "
            f"done; this run wrote {self.written} records, {self.completion_tokens} output tokens ({self.prompt_tokens} "
            f"prompt, {self.cached_tokens} cached) in {self.wall_s:.1f} s, {self.output_tokens_per_s:,.1f} output tokens/s"
        )


@dataclass
class _Checked:
    """A valid request with its prompts' ids and each choice's request."""

    request: BatchRequest
    choices: list[tuple[int, Request]]  # (prompt index, request) per choice
    prompt_ids: list[list[int]]


@dataclass
class Screened:
    """The input lines after what needs no model: lines still to run (numbered from 1), error records
    for duplicated custom_ids, and how many lines the output already holds."""

    pending: list[tuple[int, str]]
    errors: list[LineError]
    skipped: int


def screen(lines: Sequence[str], done: set[RecordKey]) -> Screened:
    """Skip the lines whose key the output holds; a custom_id on several lines gets one error record."""
    ids_of = [read_custom_id(line) for line in lines]
    seen: dict[str, list[int]] = {}
    for number, custom_id in enumerate(ids_of, 1):
        if custom_id is not None:
            seen.setdefault(custom_id, []).append(number)
    screened = Screened([], [], 0)
    for number, (line, custom_id) in enumerate(zip(lines, ids_of, strict=True), 1):
        if not line.strip():
            continue  # blank lines are no requests (numbers still count them, as editors do)
        if (custom_id if custom_id is not None else number) in done:
            screened.skipped += 1
        elif custom_id is not None and len(seen[custom_id]) > 1:
            if number == seen[custom_id][0]:
                where = ", ".join(map(str, seen[custom_id]))
                message = f"custom_id {custom_id!r} is on lines {where}; custom_ids must be unique"
                screened.errors.append(LineError(number, custom_id, "duplicate_custom_id", message, "custom_id"))
        else:
            screened.pending.append((number, line))
    return screened


def check(pending: Sequence[tuple[int, str]], generator: Generator) -> tuple[list[_Checked], list[LineError]]:
    """Each numbered line parsed and its prompts tokenized: the runnable requests and the errors."""
    runnable: list[_Checked] = []
    errors: list[LineError] = []
    for number, line in pending:
        parsed = parse_line(line, number)
        checked = parsed if isinstance(parsed, LineError) else _encode(parsed, generator)
        if isinstance(checked, LineError):
            errors.append(checked)
        else:
            runnable.append(checked)
    return runnable, errors


def _encode(request: BatchRequest, generator: Generator) -> _Checked | LineError:
    """The request's prompts tokenized and checked against the model's context."""
    param = "messages" if request.url.endswith("chat/completions") else "prompt"
    context = generator.model.config.max_position_embeddings
    prompt_ids: list[list[int]] = []
    choices: list[tuple[int, Request]] = []
    try:
        for p, prompt in enumerate(request.prompts):
            ids = generator.encode_prompt(prompt)
            sampling = request.sampling
            if not request.max_tokens_given:  # a chat request without max_tokens: the rest of the context
                if len(ids) >= context:
                    raise PromptTooLongError(f"the prompt has {len(ids)} tokens and the model's context is {context}; shorten it")
                sampling = replace(sampling, max_new_tokens=context - len(ids))
            ids = generator.prepare(Request(ids, sampling))
            prompt_ids.append(ids)
            choices += [(p, Request(ids, choice_sampling(sampling, i))) for i in range(request.n)]
    except PromptTooLongError as err:
        return LineError(request.line, request.custom_id, "prompt_too_long", str(err).replace("max_new_tokens", "max_tokens"), param)
    except InputError as err:
        return LineError(request.line, request.custom_id, "invalid_parameter", str(err), param)
    return _Checked(request, choices, prompt_ids)


# -- running requests on one generator ------------------------------------------------------------------


class _Feed:
    """The requests still to start, shared by the replicas (each takes the next when it has room)."""

    def __init__(self, items: Sequence[_Checked]) -> None:
        self._items: Iterator[_Checked] = iter(items)
        self._lock = threading.Lock()

    def next(self) -> _Checked | None:
        with self._lock:
            return next(self._items, None)


@dataclass(eq=False)
class _Running:
    """A request in flight: its choices' handles and what they gave so far."""

    item: _Checked
    results: dict[int, Choice] = field(default_factory=lambda: {})
    failed: bool = False


@dataclass(eq=False)
class _Slot:
    """One choice in flight: its generation, then (for top_logprobs) its scoring pass."""

    running: _Running
    index: int
    generation: Submitted
    scoring: Job | None = None
    result: GenerationResult | None = None

    @property
    def job(self) -> Job:
        return self.scoring if self.scoring is not None else self.generation.job


class Driver:
    """Runs requests on one Generator: keeps up to ``window`` choices queued on its engine, and hands
    each finished request's record to ``emit``."""

    def __init__(self, generator: Generator, model_name: str, emit: Callable[[dict[str, object]], None], *, window: int) -> None:
        self.generator = generator
        self.model_name = model_name
        self.emit = emit
        self.window = window
        self.finished = 0  # requests this driver recorded

    def run(self, feed: _Feed) -> None:
        active: list[_Slot] = []
        try:
            while True:
                while len(active) < self.window and (item := feed.next()) is not None:
                    active += self._start(item)
                if not active:
                    return
                self.generator.engine.wait_any([slot.job for slot in active])
                for slot in [slot for slot in active if slot.job.done]:
                    active.remove(slot)
                    if (next_slot := self._advance(slot)) is not None:
                        active.append(next_slot)
                for slot in [slot for slot in active if slot.running.failed]:  # a failed request's other choices
                    active.remove(slot)
                    self.generator.engine.cancel(slot.job)
        finally:
            for slot in active:
                self.generator.engine.cancel(slot.job)

    def _start(self, item: _Checked) -> list[_Slot]:
        running = _Running(item)
        return [
            _Slot(running, i, self.generator.submit(request, item.prompt_ids[p])) for i, (p, request) in enumerate(item.choices)
        ]

    def _advance(self, slot: _Slot) -> _Slot | None:
        """A slot's job is done: start its scoring pass, or record its choice (and the request's record
        once every choice is in). Returns the slot if it goes on."""
        running = slot.running
        if running.failed:
            return None
        try:
            if slot.scoring is None:
                slot.result = slot.generation.result()
                top = running.item.request.top_logprobs
                if top and slot.result.token_ids:
                    slot.scoring = self._score(slot.result)
                    return slot
                logprobs = None
                if top is not None:
                    logprobs = [TokenLogprobs(t, lp, []) for t, lp in zip(slot.result.token_ids, slot.result.logprobs, strict=True)]
            else:
                assert slot.result is not None
                logprobs = _top_logprobs(slot.result, slot.scoring.future.result().logits, running.item.request.top_logprobs or 0)
        except ZgenError as err:
            running.failed = True
            request = running.item.request
            self.emit(error_record(LineError(request.line, request.custom_id, "generation_failed", str(err))))
            self.finished += 1
            return None
        prompt_index = running.item.choices[slot.index][0]
        running.results[slot.index] = Choice(prompt_index, slot.result, logprobs)
        if len(running.results) == len(running.item.choices):
            choices = [running.results[i] for i in range(len(running.item.choices))]
            record = success_record(running.item.request, choices, self.generator.model.tokenizer, self.model_name)
            self.emit(record)
            self.finished += 1
        return None

    def _score(self, result: GenerationResult) -> Job:
        """A forward pass over the prompt and the generated tokens that returns the logits before each
        generated token (the engine serves it in the same batches as every other job)."""
        engine = self.generator.engine
        tokens = result.prompt_token_ids + result.token_ids[:-1]
        first = len(result.prompt_token_ids) - 1
        seq = engine.new_sequence(tokens)
        try:
            job = engine.submit(seq, ForwardRequest(end=len(tokens), logits_at=tuple(range(first, len(tokens)))))
        except BaseException:
            engine.release(seq)
            raise
        job.future.add_done_callback(lambda _: engine.release(seq))
        return job


def _top_logprobs(result: GenerationResult, logits: dict[int, np.ndarray], k: int) -> list[TokenLogprobs]:
    first = len(result.prompt_token_ids) - 1
    entries: list[TokenLogprobs] = []
    for n, token in enumerate(result.token_ids):
        row = logits[first + n].astype(np.float64)
        logprobs = row - np.logaddexp.reduce(row)
        best = np.argpartition(-logprobs, k - 1)[:k]
        best = best[np.argsort(-logprobs[best], kind="stable")]
        entries.append(TokenLogprobs(token, float(logprobs[token]), [(int(t), float(logprobs[t])) for t in best]))
    return entries


# -- the job ---------------------------------------------------------------------------------------


def replica(model: Model, device: Device) -> Model:
    """The model's weights copied to ``device``, with compiled steps of its own."""
    return replace(model, params=jax.device_put(model.params, device), attachments={})


def read_lines(path: Path) -> list[str]:
    """The input's lines (line ``n`` at index ``n - 1``; :func:`screen` passes over blank ones)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InputError(f"cannot read the batch input {path}: {err.strerror}") from None
    return [raw.decode("utf-8", errors="replace") for raw in data.splitlines()]


class JobOutput:
    """The output side of a job: the results file (resumed), the writer thread, the progress bar and
    the totals the summary reports. Use it as a context manager; :meth:`start` once the work is known."""

    def __init__(self, output: str | Path, *, progress: bool) -> None:
        self._results = ResultsFile(output)
        self._progress = progress
        self._bar: JobProgress | None = None
        self._writer: RecordWriter | None = None
        self.started = time.perf_counter()
        self.written = self.failed = self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0

    def __enter__(self) -> JobOutput:
        self.existing = self._results.open()
        return self

    def start(self, total: int) -> None:
        """Show a bar over ``total`` records and start writing."""
        self._bar = JobProgress(total, enabled=self._progress).__enter__()
        self._writer = RecordWriter(self._results, self._written)

    def put(self, record: dict[str, object]) -> None:
        assert self._writer is not None, "start the output first"
        self._writer.put(record)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        try:
            if self._writer is not None:
                self._writer.close()  # everything handed over is written, even when the job failed
        finally:
            if self._bar is not None:
                self._bar.__exit__(None, None, None)
            self._results.close()

    def _written(self, records: list[dict[str, object]]) -> None:
        failed = sum(r["error"] is not None for r in records)
        tokens = 0
        for record in records:
            usage = _usage(record)
            self.prompt_tokens += usage.get("prompt_tokens", 0)
            self.cached_tokens += usage.get("cached_tokens", 0)
            tokens += usage.get("completion_tokens", 0)
        self.written += len(records)
        self.failed += failed
        self.completion_tokens += tokens
        assert self._bar is not None
        self._bar.advance(len(records), tokens, failed)

    def summary(self, requests: int, skipped: int, replica_requests: Sequence[int], path: str | Path | None) -> BatchSummary:
        """The job's summary (call after the ``with``); also written as JSON to ``path`` if given."""
        wall = time.perf_counter() - self.started
        result = BatchSummary(
            requests=requests,
            succeeded=len(self.existing.keys) - self.existing.failed + self.written - self.failed,
            failed=self.existing.failed + self.failed,
            skipped=skipped,
            written=self.written,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            wall_s=wall,
            output_tokens_per_s=self.completion_tokens / wall if wall > 0 else 0.0,
            replica_requests=tuple(replica_requests),
        )
        if path is not None:
            Path(path).write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        return result


def run(
    model: Model | str | Path,
    input: str | Path,
    output: str | Path,
    *options: CacheOption,
    max_batch_size: int = 64,
    prefill_chunk: int = 512,
    refill_rows: int | None = None,
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    dtype: str = "float32",
    model_name: str | None = None,
    progress: bool = True,
    summary: str | Path | None = None,
) -> BatchSummary:
    """Run the OpenAI-format batch file ``input`` into ``output`` (see the module docstring).

    ``model`` is a loaded model or what :func:`~zgen.model.load_model` takes; ``options`` choose the KV
    cache (``prefix_cache(...)`` shares common prompt prefixes). Running it again with the same
    arguments after a crash continues where it stopped. ``progress`` shows a bar on a terminal;
    ``summary`` also writes the summary as JSON to that file. ``data_parallel`` replicas of the model
    each run on one local device, or with ``tensor_parallel=T`` on a group of T devices.
    ``refill_rows`` (default: half of ``max_batch_size``): queued requests take freed rows that many at
    a time, prefilling together.
    """
    for what, value in (("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{what} must be an integer >= 1, got {value!r}")
    devices = jax.local_devices()
    if data_parallel * tensor_parallel > len(devices):
        raise ConfigError(
            f"data_parallel={data_parallel} x tensor_parallel={tensor_parallel} needs as many local devices; this "
            f"process sees {len(devices)} (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    lines = read_lines(Path(input))
    loaded = model if isinstance(model, Model) else load_model(model, dtype=dtype)
    if (data_parallel > 1 or tensor_parallel > 1) and loaded.split:
        raise ConfigError("the model is already split over devices; pass it unsplit with data_parallel / tensor_parallel")
    name = model_name or (str(model) if not isinstance(model, Model) else str(loaded.source or "zgen"))
    # Replica i runs on devices [i*T, (i+1)*T): one device, or a tensor-parallel group of T.
    groups = [list(devices[i * tensor_parallel : (i + 1) * tensor_parallel]) for i in range(data_parallel)]
    devs: list[Device | None] = [None] if data_parallel * tensor_parallel == 1 else [group[0] for group in groups]
    generators: list[Generator] = []
    for device, group in zip(devs, groups, strict=True):
        with jax.default_device(device):
            if tensor_parallel > 1:
                replica_model = split_model(loaded, tensor_parallel, group)
            else:
                replica_model = loaded if device is None else replica(loaded, device)
            generators.append(job_generator(replica_model, options, max_batch_size, prefill_chunk, refill_rows))
    try:
        with JobOutput(output, progress=progress) as out:
            screened = screen(lines, out.existing.keys)
            runnable, errors = check(screened.pending, generators[0])
            out.start(len(runnable) + len(errors) + len(screened.errors))
            for error in [*screened.errors, *errors]:
                out.put(error_record(error))
            replica_requests = _drive(generators, devs, runnable, name, out.put, max_batch_size)
    finally:
        for generator in generators:
            generator.close()
    return out.summary(count_requests(lines), screened.skipped, replica_requests, summary)


def count_requests(lines: Sequence[str]) -> int:
    return sum(bool(line.strip()) for line in lines)


def job_generator(
    model: Model, options: Sequence[CacheOption], max_batch_size: int, prefill_chunk: int, refill_rows: int | None = None
) -> Generator:
    """The Generator a batch job runs on: freed rows refilled ``refill_rows`` at a time (default half
    the batch), decoding rows sitting out the prefill steps of a paged cache."""
    refill = max(1, max_batch_size // 2) if refill_rows is None else refill_rows
    return Generator(
        model, *options, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk, refill_rows=refill, prefill_apart=True
    )


def generate_records(generator: Generator, pending: Sequence[tuple[int, str]], model_name: str, *, window: int) -> list[dict[str, object]]:
    """The records of these numbered lines (checked, then run on ``generator``): what one worker of a
    distributed job (:mod:`zgen.integrations.ray`) computes for its share."""
    runnable, errors = check(pending, generator)
    records = [error_record(error) for error in errors]
    Driver(generator, model_name, records.append, window=window).run(_Feed(runnable))
    return records


def _usage(record: dict[str, object]) -> dict[str, int]:
    response = record.get("response")
    if not isinstance(response, dict):
        return {}
    usage = response["body"]["usage"]  # type: ignore[index]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }


def _drive(
    generators: list[Generator], devices: Sequence[Device | None], runnable: list[_Checked], name: str,
    emit: Callable[[dict[str, object]], None], max_batch_size: int,
) -> list[int]:
    """Each generator's driver on a thread of its own (one alone runs here), pulling from one feed;
    how many requests each finished."""
    feed = _Feed(runnable)
    drivers = [Driver(g, name, emit, window=2 * max_batch_size) for g in generators]

    def drive(driver: Driver, device: Device | None) -> None:
        with jax.default_device(device):
            driver.run(feed)

    if len(drivers) == 1:
        drive(drivers[0], devices[0])
        return [drivers[0].finished]
    failures: list[BaseException] = []

    def guarded(driver: Driver, device: Device | None) -> None:
        try:
            drive(driver, device)
        except BaseException as err:  # the other replicas go on; the job reports it at the end
            failures.append(err)

    threads = [
        threading.Thread(target=guarded, args=(driver, device), name=f"zgen-batch-replica-{i}")
        for i, (driver, device) in enumerate(zip(drivers, devices, strict=True))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return [driver.finished for driver in drivers]
