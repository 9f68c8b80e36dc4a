"""A batch job: a JSONL file of OpenAI Batch API requests in, a resumable JSONL file of results out.

The path of a job: read every input line → skip those whose custom_id the output already holds → check
every remaining line (JSON, url, parameters, duplicate custom_ids, the LoRA module it names, prompt
length: a bad line becomes an error record for its custom_id and the job goes on) → queue the valid
ones on the Generator's engine as room allows (a window of ``2 × max_batch_size`` choices in flight,
topped up the moment one finishes;
the engine refills freed rows ``refill_rows`` at a time so their prompts prefill together, and a shared
prompt prefix is served from the prefix cache) →
each request's record is appended and synced as soon as all its choices are done
(:mod:`zgen.batch.output`).

The job owns no decode loop: it translates lines into Generator requests (and, for ``top_logprobs``, a
scoring pass on the engine) and records what comes back; a request naming a LoRA module carries its
adapter (:mod:`zgen.batch.adapters`), and the engine batches it with the base model's requests. With
``data_parallel=N``, N replicas of the model on N local devices pull requests from one queue and write
into the one output file. The summary reads this run's tokens and latencies from the engines' metrics
(:mod:`zgen.batch.summary`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zgen.batch.adapters import LoraModules, ModuleSpec, Selection, check_resume, register_modules
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
from zgen.batch.summary import BatchSummary, summarize
from zgen.cache.factory import CacheOption
from zgen.errors import ConfigError, InputError, PromptTooLongError, ZgenError
from zgen.generator import Generator, Request, Submitted
from zgen.model import Model, load_model, split_model
from zgen.runtime.engine import ForwardRequest, Job
from zgen.runtime.metrics import EngineMetrics
from zgen.runtime.results import GenerationResult
from zgen.runtime.speculation import Speculator

Device = Any  # a jax.Device (jax's stubs declare the name as a variable, not a type)


@dataclass
class _Checked:
    """A valid request with its prompts' ids, each choice's request and the adapter it runs with."""

    request: BatchRequest
    choices: list[tuple[int, Request]]  # (prompt index, request) per choice
    prompt_ids: list[list[int]]
    selection: Selection


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


def check(
    pending: Sequence[tuple[int, str]], generator: Generator, modules: LoraModules
) -> tuple[list[_Checked], list[LineError]]:
    """Each numbered line parsed, its adapter chosen among ``modules`` and its prompts tokenized: the
    runnable requests and the errors."""
    runnable: list[_Checked] = []
    errors: list[LineError] = []
    for number, line in pending:
        parsed = parse_line(line, number)
        selection = parsed if isinstance(parsed, LineError) else modules.select(parsed)
        if isinstance(selection, LineError):
            errors.append(selection)
            continue
        assert isinstance(parsed, BatchRequest)
        checked = _encode(parsed, selection, generator)
        if isinstance(checked, LineError):
            errors.append(checked)
        else:
            runnable.append(checked)
    return runnable, errors


def _encode(request: BatchRequest, selection: Selection, generator: Generator) -> _Checked | LineError:
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
            choices += [(p, Request(ids, choice_sampling(sampling, i), adapter=selection.adapters)) for i in range(request.n)]
    except PromptTooLongError as err:
        return LineError(request.line, request.custom_id, "prompt_too_long", str(err).replace("max_new_tokens", "max_tokens"), param)
    except InputError as err:
        return LineError(request.line, request.custom_id, "invalid_parameter", str(err), param)
    return _Checked(request, choices, prompt_ids, selection)


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

    def __init__(self, generator: Generator, emit: Callable[[dict[str, object]], None], *, window: int) -> None:
        self.generator = generator
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
                    slot.scoring = self._score(slot.result, running.item.selection)
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
            item = running.item
            record = success_record(item.request, choices, self.generator.model.tokenizer, item.selection.model)
            self.emit(record)
            self.finished += 1
        return None

    def _score(self, result: GenerationResult, selection: Selection) -> Job:
        """A forward pass over the prompt and the generated tokens, with the request's adapter, that
        returns the logits before each generated token (the engine serves it in the same batches as
        every other job)."""
        engine = self.generator.engine
        tokens = result.prompt_token_ids + result.token_ids[:-1]
        first = len(result.prompt_token_ids) - 1
        seq = engine.new_sequence(tokens)
        try:
            request = ForwardRequest(end=len(tokens), logits_at=tuple(range(first, len(tokens))), adapters=selection.adapters)
            job = engine.submit(seq, request)
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
    the counts of records written. Use it as a context manager; :meth:`start` once the work is known.
    ``generated_tokens()`` gives the output tokens generated so far in this run (the engines' metrics),
    for the bar's tokens/s."""

    def __init__(self, output: str | Path, *, progress: bool, generated_tokens: Callable[[], int]) -> None:
        self._results = ResultsFile(output)
        self._progress = progress
        self._generated_tokens = generated_tokens
        self._bar: JobProgress | None = None
        self._writer: RecordWriter | None = None
        self.started = time.perf_counter()
        self.written = self.failed = self._tokens_shown = 0

    def __enter__(self) -> JobOutput:
        self.existing = self._results.open()
        return self

    def check_modules(self, modules: LoraModules | None) -> None:
        """Refuse to resume with other LoRA modules than the records were made with (see
        :mod:`zgen.batch.adapters`); call before :meth:`start`."""
        identity = {} if modules is None else modules.identity()
        check_resume(self._results.path, identity, has_records=bool(self.existing.keys))

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
        self.written += len(records)
        self.failed += failed
        tokens = self._generated_tokens()
        assert self._bar is not None
        self._bar.advance(len(records), tokens - self._tokens_shown, failed)
        self._tokens_shown = tokens

    def summary(
        self, metrics: Sequence[EngineMetrics], requests: int, skipped: int, replica_requests: Sequence[int], path: str | Path | None,
        *, speculating: bool = False,
    ) -> BatchSummary:
        """The job's summary (call after the ``with``) from its engines' ``metrics`` (``speculating``:
        with a speculator's figures); also written as JSON to ``path`` if given."""
        result = summarize(
            metrics,
            requests=requests,
            succeeded=len(self.existing.keys) - self.existing.failed + self.written - self.failed,
            failed=self.existing.failed + self.failed,
            skipped=skipped,
            written=self.written,
            wall_s=time.perf_counter() - self.started,
            replica_requests=replica_requests,
            speculating=speculating,
        )
        if path is not None:
            result.write(path)
        return result


def run(
    model: Model | str | Path,
    input: str | Path,
    output: str | Path,
    *options: CacheOption,
    max_batch_size: int = 64,
    prefill_chunk: int = 512,
    refill_rows: int | None = None,
    step_tokens: int | None = None,
    packed_steps: bool = True,
    prefill_apart: bool = True,
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    dtype: str = "float32",
    model_name: str | None = None,
    progress: bool = True,
    summary: str | Path | None = None,
    lora_modules: Mapping[str, ModuleSpec] | None = None,
    speculative: Speculator | None = None,
) -> BatchSummary:
    """Run the OpenAI-format batch file ``input`` into ``output`` (see the module docstring).

    ``model`` is a loaded model or what :func:`~zgen.model.load_model` takes; ``options`` choose the KV
    cache (``prefix_cache(...)`` shares common prompt prefixes). Running it again with the same
    arguments after a crash continues where it stopped. ``progress`` shows a bar on a terminal;
    ``summary`` also writes the summary as JSON to that file. ``data_parallel`` replicas of the model
    each run on one local device, or with ``tensor_parallel=T`` on a group of T devices.
    ``refill_rows`` (default: an eighth of ``max_batch_size``, half with padded steps): queued requests
    take freed rows that many at a time, prefilling together. ``packed_steps`` (default): prefill steps
    pack their rows' tokens into one stream (a power of two wide, or with ``step_tokens`` exactly that
    many tokens, chunks cut to fill it); ``False`` pads each row to the chunk's width. Small refill
    groups in packed steps ran an 8B-shape job of 1,000 requests on an NVIDIA H200 at 1.50x fixed
    chunks, half-batch groups in padded steps at 1.24x (BENCHMARKS.md). ``prefill_apart=False``: the
    decoding rows ride along in prefill steps, one token each, instead of sitting them out.

    ``lora_modules`` registers LoRA adapters by name (name -> PEFT directory or loaded adapter,
    optionally ``(it, scale)``): a request runs with one when its body's ``model`` or ``lora`` names it
    (:mod:`zgen.batch.adapters`); ``model_name`` is the base model's name (default: ``model`` as given).
    An adapter that does not fit the model raises an AdapterError before anything runs. The summary's
    tokens and latencies are read from the engines' metrics (:mod:`zgen.batch.summary`).

    ``speculative`` (:mod:`zgen.speculative`) drafts tokens for every request (greedy results are the
    plain ones; sampled ones follow the same distribution), on every data-parallel replica (each
    drafts with a copy of the speculator's weights on its own device, or on each device of its
    ``tensor_parallel`` group).
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
    modules = register_modules(lora_modules, base_name=name, config=loaded.config)
    if modules.adapters and (tensor_parallel > 1 or loaded.split):
        raise ConfigError("LoRA modules on a model split with tensor_parallel are not available yet; run the job on one device per replica")
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
            generators.append(
                job_generator(
                    replica_model, options, max_batch_size, prefill_chunk, refill_rows, speculative, step_tokens, packed_steps, prefill_apart
                )
            )
    try:
        with JobOutput(output, progress=progress, generated_tokens=lambda: sum(g.metrics().generated_tokens for g in generators)) as out:
            out.check_modules(modules)
            screened = screen(lines, out.existing.keys)
            runnable, errors = check(screened.pending, generators[0], modules)
            out.start(len(runnable) + len(errors) + len(screened.errors))
            for error in [*screened.errors, *errors]:
                out.put(error_record(error))
            replica_requests = _drive(generators, devs, runnable, out.put, max_batch_size)
        metrics = [generator.metrics() for generator in generators]
    finally:
        for generator in generators:
            generator.close()
    return out.summary(metrics, count_requests(lines), screened.skipped, replica_requests, summary, speculating=speculative is not None)


def count_requests(lines: Sequence[str]) -> int:
    return sum(bool(line.strip()) for line in lines)


def job_generator(
    model: Model, options: Sequence[CacheOption], max_batch_size: int, prefill_chunk: int, refill_rows: int | None = None,
    speculative: Speculator | None = None, step_tokens: int | None = None, packed_steps: bool = True, prefill_apart: bool = True,
) -> Generator:
    """The Generator a batch job runs on: prefill steps packed into one stream (unless not
    ``packed_steps``; ``step_tokens`` implies them), freed rows refilled ``refill_rows`` at a time
    (default an eighth of the batch packed, half padded: a padded step costs its rows x the chunk
    however few tokens they hold), decoding rows sitting out the prefill steps of a paged cache
    (unless not ``prefill_apart``)."""
    packed = packed_steps or step_tokens is not None
    refill = max(1, max_batch_size // (8 if packed else 2)) if refill_rows is None else refill_rows
    return Generator(
        model, *options, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk, refill_rows=refill, prefill_apart=prefill_apart,
        speculative=speculative, packed_steps=packed, step_tokens=step_tokens,
    )


def generate_records(generator: Generator, pending: Sequence[tuple[int, str]], model_name: str, *, window: int) -> list[dict[str, object]]:
    """The records of these numbered lines (checked, then run on ``generator``): what one worker of a
    distributed job (:mod:`zgen.integrations.ray`) computes for its share."""
    runnable, errors = check(pending, generator, LoraModules(model_name))
    records = [error_record(error) for error in errors]
    Driver(generator, records.append, window=window).run(_Feed(runnable))
    return records


def _drive(
    generators: list[Generator], devices: Sequence[Device | None], runnable: list[_Checked],
    emit: Callable[[dict[str, object]], None], max_batch_size: int,
) -> list[int]:
    """Each generator's driver on a thread of its own (one alone runs here), pulling from one feed;
    how many requests each finished."""
    feed = _Feed(runnable)
    drivers = [Driver(g, emit, window=2 * max_batch_size) for g in generators]

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
