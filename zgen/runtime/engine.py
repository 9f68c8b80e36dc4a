"""The Engine: one scheduler that runs every request and context of a model, batched.

Front ends never run the model. A Generator request and a context call both become a
:class:`ForwardRequest` on a :class:`~zgen.runtime.sequence.Sequence` — feed its pending tokens up to
``end``, sample or read logits at chosen positions, and optionally go on generating until a
:class:`~zgen.runtime.stop.StopCondition` — submitted as a :class:`Job`. Each :meth:`Engine.step`
serves every waiting job it can, in one compiled call:

* **decode loop** — when every job is plain decoding (one pending token, sampling on the device, no
  attention override): up to the whole remaining budget of tokens in one ``lax.while_loop`` on the
  device (:func:`~zgen.runtime.step.decode_loop`). A host stop rule (a multi-token sequence, a stop
  string) or a text stream brings it back every ``steps_per_sync`` tokens; requests waiting for a row
  bring it back as soon as enough rows finish for them.
* **mixed step** — otherwise: every job feeds a chunk of its pending tokens (at most
  ``prefill_chunk``, so a long prompt never stalls the others) or one decode token, as one row of a
  padded ``[B, T]`` batch, and draws at its requested positions (:func:`~zgen.runtime.step.mixed_step`).

Continuous batching: a finished job gives its row back at once and a waiting one takes it at the next
step; KV room is reserved before each step (:meth:`~zgen.cache.base.KVHandle.reserve`), and a job that
finds none waits while others run (``on_pool_exhausted="wait"``) or fails alone (``"error"``) with its
sequence unchanged. One job's fault (a host choice function that raises or returns an invalid id)
fails that job alone and rolls its sequence back.

Sampling draws for position ``p`` use ``fold_in(key, p)`` of the row's key (the config's seed, else the
sequence's), so a sequence samples the same tokens alone, batched, through either step or front end.

Driving: a synchronous caller steps the engine itself until its job is done (:meth:`Engine.wait`;
other threads' jobs ride along in the same steps, one step at a time under a lock); an async caller
awaits :meth:`Engine.wait_async`, and the steps run on its event loop, where every job submitted at the
same moment shares a step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from collections.abc import Hashable, Iterator, Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import jax
import numpy as np

from zgen.cache.base import KVManager, KVState, StepRow
from zgen.cache.factory import CacheOption, make_kv, resolve
from zgen.cache.formats import kv_dtype_of, kv_format
from zgen.cache.paged_manager import PagedKVManager
from zgen.cache.paged_state import PagedKVState
from zgen.errors import AdapterError, CacheError, ConfigError, InputError, PoolExhaustedError, PromptTooLongError, TokenIdError, ZgenError
from zgen.lora.adapter import LoraAdapter, check_adapter
from zgen.model import Model
from zgen.pallas.paged_attention.layouts import KeyCalibration
from zgen.runtime.adapters import AdapterBanks
from zgen.runtime.calibration import key_calibration as model_key_calibration
from zgen.runtime.grammar import GrammarDrafts, GrammarLoop, GrammarMatcher, fill_masks, mask_words
from zgen.runtime.metrics import EngineMetrics, MetricsCollector
from zgen.runtime.results import FinishReason
from zgen.runtime.runner import runner_for
from zgen.runtime.sampling import PenaltyState, SamplingConfig, SamplingFlags, SamplingParams, penalty_state, row_key_data
from zgen.runtime.sequence import Sequence
from zgen.runtime.speculation import (
    TIMING_DRAWS, WINDOW, DraftControl, LoopTimes, SpeculativeLoop, SpeculativeStats, Speculator, TreeSpeculator, draft_room, loop_key,
)
from zgen.runtime.step import DecodeLoop, MixedBatch, Packing
from zgen.runtime.stop import StopCondition, TextStream
from zgen.shapes import next_pow2
from zgen.tokenizer import plain_token_ids

GREEDY = SamplingConfig(temperature=0.0)
#: Most grammar-constrained rows a decode loop takes (a host worker advances them beside each forward
#: pass, :class:`~zgen.runtime.grammar.GrammarLoop`); more rows step the engine token by token. On an
#: NVIDIA H200 (SmolLM2 shape, JSON schema, ``benchmarks/grammar.py``) 32 constrained rows take
#: 0.98-1.01 ms/token in the loop (unconstrained: 0.93-0.94); larger batches are not measured.
GRAMMAR_LOOP_ROWS = 32
#: Tokens of a piece of a packed step's attention layout on a paged cache (:class:`~zgen.runtime.step.Packing`):
#: where decoding rows ride along beside long prompt chunks, each row is laid out in pieces of at most
#: this many tokens instead of padded to the longest chunk (used when that at least halves the layout).
PACKED_PIECE = 32


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling settings of an :class:`Engine` (the cache is chosen with cache options)."""

    max_batch: int = 64  # rows per compiled step (and sequences a row cache holds at once)
    prefill_chunk: int = 256  # pending tokens one sequence feeds per step
    steps_per_sync: int = 16  # decode steps per host round trip when something needs the host
    on_pool_exhausted: Literal["error", "wait"] = "error"
    # New jobs wait until this many rows are free (while others decode), so their prompts prefill
    # together: a mixed step is padded to [rows, chunk], and one admission per step wastes most of it.
    refill_rows: int = 1
    # On a paged cache, a step that prefills leaves the decoding rows out (they would each be padded to
    # the chunk's width for one token); they go on in the next decode loop. Its rows then come a refill
    # group at a time, the first admission's too, so prefill steps have one width (one compiled shape).
    prefill_apart: bool = False
    # A step that prefills packs its rows' tokens into one stream (:class:`~zgen.runtime.step.Packing`):
    # the matmuls see no padding, so decoding rows ride along at the price of their one token and a
    # prefill chunk costs its own tokens. Steps of rows with LoRA adapters stay padded.
    packed_steps: bool = False
    # With packed steps: a step that prefills carries at most this many tokens, in a stream of exactly
    # this width (one compiled shape). Rows take their chunks in turn until it is full, and a row cut
    # short goes on in the next step, so steps hold tokens rather than the padding of short chunks
    # (a group of prompts of 256-1,024 tokens in [rows, 512] steps fills ~63 % of its slots).
    step_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch", "prefill_chunk", "steps_per_sync", "refill_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("prefill_apart", "packed_steps"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.step_tokens is not None:
            if isinstance(self.step_tokens, bool) or not isinstance(self.step_tokens, int) or self.step_tokens < self.max_batch:
                raise ConfigError(
                    f"EngineConfig.step_tokens must be an integer >= max_batch ({self.max_batch}): a step's every row "
                    f"takes at least one token; got {self.step_tokens!r}"
                )
            if not self.packed_steps:
                raise ConfigError("EngineConfig.step_tokens budgets packed steps; set packed_steps=True with it")
        if self.on_pool_exhausted not in ("error", "wait"):
            raise ConfigError(f"EngineConfig.on_pool_exhausted must be 'error' or 'wait', got {self.on_pool_exhausted!r}")


@dataclass
class EngineStats:
    """Counters since the engine was created (``forward_passes`` counts every model forward run on
    the device: a decode loop of k iterations counts k)."""

    steps: int = 0
    forward_passes: int = 0
    rows: int = 0  # batch rows served, summed over steps
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0  # sequences whose KV was freed for an earlier job (recomputed when they run again)
    fallback_steps: int = 0  # plain decode steps of speculative jobs: in fallback, or none drafted (in a loop or as one)


@dataclass(frozen=True)
class ForwardRequest:
    """Feed a sequence's pending tokens up to position ``end`` and read out results.

    Positions are absolute token indices. ``sample_at``/``logits_at``: positions whose next-token
    logits are sampled with ``sampling`` / returned raw. ``attention_mask`` (bool ``[end - start,
    end]``, ``start`` the sequence's KV length at submission) replaces the causal rule for the fed
    tokens. ``generate``: the last sample (at ``end - 1``) is the first generated token; append it and
    go on until this stop condition (or the model's context is full). ``stream``: keep the generated
    text's pieces for :meth:`Engine.stream` as they come. ``per_token``: the host takes every token as
    it is drawn (the batch it runs in then decodes one token per host round trip).
    ``adapters``: LoRA adapters with their scales this request runs with, on top of the model's pushed
    ones (``Model.push_adapter``). ``speculative``: decode the generation with this speculator
    (:mod:`zgen.runtime.speculation`); the tokens are what plain decoding gives (greedy, and sampling
    with deterministic drafts) or follow the same distribution (sampled drafts).
    """

    end: int
    sample_at: tuple[int, ...] = ()
    logits_at: tuple[int, ...] = ()
    sampling: SamplingConfig = GREEDY
    attention_mask: np.ndarray | None = None
    generate: StopCondition | None = None
    stream: bool = False
    adapters: tuple[tuple[LoraAdapter, float], ...] = ()
    per_token: bool = False
    speculative: Speculator | None = None


@dataclass
class ForwardResult:
    """Samples in order (for a generation: the generated tokens), their log-probs, raw float32 logits
    per ``logits_at`` position, and for a generation its text and finish reason."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logits: dict[int, np.ndarray] = field(default_factory=dict)
    text: str = ""
    finish_reason: FinishReason = "length"
    cached_tokens: int = 0  # of the fed tokens, those whose K/V were there already (prefix cache, earlier calls)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    speculative: SpeculativeStats | None = None  # with a speculator: what it drafted and the target kept


class Job:
    """One submitted request: its sequence, progress, result and future."""

    def __init__(self, seq: Sequence, request: ForwardRequest, tokenizer_stream: TextStream | None) -> None:
        self.seq = seq
        self.request = request
        self.future: Future[ForwardResult] = Future()
        self.start = seq.kv_len  # KV length at submission (row 0 of attention_mask)
        self.origin = seq.num_tokens  # tokens at submission (a failed job rolls back to these)
        self.result = ForwardResult(cached_tokens=seq.kv_len)
        self.text = tokenizer_stream
        self.generating = False
        self.drawn: list[int] = []  # generated tokens of this step, appended to the sequence together
        self.pieces: list[str] = []
        self.cancelled = False
        self.admitted = False
        # The LoRA adapters it runs with: the model's stack when it was submitted, then its own.
        self.adapters = request.adapters
        self.control: dict[str, np.ndarray] | None = None  # a speculative job's draft-length control, one row
        self.grammar: GrammarMatcher | None = None  # a constrained generation's parser (SamplingConfig.grammar)
        self._started: float | None = None
        self._first_token: float | None = None
        self.submitted = time.perf_counter()
        self.delivered: float | None = None  # when its last generated tokens reached the host

    @property
    def done(self) -> bool:
        return self.future.done()

    @property
    def sampling(self) -> SamplingConfig:
        return self.request.sampling

    def feed_end(self) -> int:
        """Feed tokens up to (excluding) this position in the current phase."""
        return self.seq.num_tokens if self.generating else self.request.end

    def draws_left(self, max_len: int) -> int:
        """Samples this job may still draw (generations: until their budget or the context is full)."""
        if self.text is None:
            return 1
        budget = self.text.stop.max_tokens or max_len
        return max(0, min(budget - len(self.text.tokens), max_len - self.seq.num_tokens + 1))

    def loopable(self) -> bool:
        """One token left to feed, sampled on the device, nothing else asked of it: the decode loop serves it."""
        r = self.request
        if self.sampling.choose is not None or r.attention_mask is not None:
            return False
        if self.generating:
            return self.seq.kv_len == self.seq.num_tokens - 1  # (a preempted job feeds its tokens again first)
        last = r.end - 1
        return self.seq.kv_len == last and set(r.sample_at) == {last} and not r.logits_at

    def needs_host(self) -> bool:
        return self.text is not None and (self.text.stop.needs_host or self.request.stream)


@dataclass
class _Row:
    job: Job
    start: int
    count: int  # tokens fed (decode: draws reserved)
    reads: list[int]  # absolute positions whose logits this row draws or returns


class Engine:
    """Owns a model's KV cache and schedules every request and context on it (see the module docstring).

    Cache options (``paged_kv(...)``, ``kv_dtype("q4")``, ``prefix_cache(...)``, ... from
    :mod:`zgen.cache.factory`) choose the cache; without a kind the engine is paged (contexts need
    pages), ``default_kind`` changes that (the Generator's default is ``tensor``). The coded formats
    (q4, q3) code keys with ``key_calibration`` (default: the model's own, computed once).
    """

    def __init__(
        self,
        model: Model,
        *options: CacheOption,
        config: EngineConfig | None = None,
        default_kind: str = "paged",
        key_calibration: Seq[KeyCalibration] | None = None,
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        cache = resolve(options)
        if cache.kind is None:  # a page layout needs pages; otherwise the front end's default
            cache = replace(cache, kind=default_kind if cache.resolved_kind == "tensor" else cache.resolved_kind)
        self.cache_options = cache
        storage = self.cache_options.kv_dtype or kv_dtype_of(model.dtype)
        if kv_format(storage, model.config.head_dim).coded and key_calibration is None:
            key_calibration = model_key_calibration(model)
        self.kv: KVManager = make_kv(
            self.cache_options, model.config, model.dtype,
            max_rows=self.config.max_batch, max_write=next_pow2(self.config.prefill_chunk), key_calibration=key_calibration,
            mesh=model.mesh,
        )
        self.runner = runner_for(model)
        self.stats = EngineStats()
        self.loop_times = LoopTimes()  # what a speculative pass costs in plain steps, measured here
        self._draft_carry: _DraftCarry | None = None  # a resumable speculator's state after the last loop
        # Each adaptive speculator's falls and failed probes in a row, the fewest of its last loop's rows:
        # a new request starts there (a speculator that does not pay here is not tried afresh on each).
        self._misses: dict[Hashable, int] = {}
        self.collector = MetricsCollector(self.config.max_batch)
        self._step_started = time.perf_counter()
        self._queue: list[Job] = []
        self._queue_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._scheduled: set[asyncio.AbstractEventLoop] = set()
        self._seeds = itertools.count(0x5EED)
        self._sequences: weakref.WeakSet[Sequence] = weakref.WeakSet()  # every live sequence (preemption victims)
        self._banks = AdapterBanks(model.config, model.dtype)  # LoRA banks of the steps' adapter mixes
        self._last_params: tuple[list[SamplingConfig], SamplingParams] | None = None  # reused while a batch decodes
        # the decode loops' constrained rows (a loop split over devices hands over through callbacks)
        self._loop_grammars = GrammarLoop(model.config.vocab_size, one_device=model.mesh is None)
        self._draft_grammars = GrammarDrafts(model.config.vocab_size)  # the speculative loops' constrained rows
        self._speculators: weakref.WeakSet[Speculator] = weakref.WeakSet()  # checked against this model

    @property
    def max_len(self) -> int:
        """Tokens one sequence can hold (the model's context length)."""
        return self.model.config.max_position_embeddings

    def close(self) -> None:
        """Free what the cache holds outside the device (a tiered store's RAM and files)."""
        self.kv.close()

    def metrics(self) -> EngineMetrics:
        """What this engine has done so far, as plain numbers (see :mod:`zgen.runtime.metrics`)."""
        snapshot = self.collector.snapshot(steps=self.stats.steps, forward_passes=self.stats.forward_passes)
        if not isinstance(self.kv, PagedKVManager):
            return snapshot
        pool = self.kv.pool.stats()
        snapshot = replace(snapshot, kv_pages_total=pool.num_blocks, kv_pages_used=pool.num_used, kv_pages_shared=pool.shared_blocks)
        if self.kv.radix is None:
            return snapshot
        radix = self.kv.radix.stats
        return replace(snapshot, prefix_cache_lookups=radix.lookups, prefix_cache_hits=radix.hits, prefix_cache_hit_tokens=radix.hit_tokens)

    # -- sequences ------------------------------------------------------------------------------

    def next_seed(self) -> int:
        return next(self._seeds) * 0x9E3779B97F4A7C15 % 2**63

    def new_sequence(self, tokens: Seq[int] = (), *, seed: int | None = None) -> Sequence:
        """An empty (or pre-filled, all pending) sequence on this engine's cache."""
        seq = Sequence(self.kv.new_handle(), self.next_seed() if seed is None else int(seed), tokens)
        self._sequences.add(seq)
        return seq

    def fork(self, seq: Sequence, *, seed: int | None = None) -> Sequence:
        """A sequence with the same tokens sharing every page (paged caches only)."""
        if not self.kv.pages:
            raise ConfigError(f"the {self.kv.kind} cache holds one row per sequence and cannot fork; use a paged cache")
        fork = getattr(seq.kv, "fork")
        twin = Sequence(fork(), self.next_seed() if seed is None else int(seed), seq.tokens)
        twin.masked, twin.custom_attention = seq.masked.copy(), seq.custom_attention
        self._sequences.add(twin)
        return twin

    def release(self, seq: Sequence) -> None:
        """Offer the sequence's K/V to the prefix cache (unless computed under masks) and free it."""
        if seq.released:
            return
        if not seq.custom_attention and seq.kv_len:
            self.kv.commit_prefix(seq.kv, seq.tokens[: seq.kv_len])
        seq.release()

    def check_ids(self, ids: Seq[int]) -> list[int]:
        """``ids`` as ints in ``[0, vocab)``, or TokenIdError."""
        vocab = self.model.config.vocab_size
        if plain_token_ids(ids, vocab):
            return list(ids)
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < vocab]
        if bad:
            raise TokenIdError(f"token ids {bad[:5]} are outside [0, {vocab}) for this model's vocabulary (or not integers)")
        return [int(i) for i in ids]

    # -- jobs -----------------------------------------------------------------------------------

    def submit(self, seq: Sequence, request: ForwardRequest) -> Job:
        """Queue ``request`` on ``seq`` (checked first: a bad request is refused before anything runs)."""
        if seq.released:
            raise CacheError("this sequence was released; fork or open a live one")
        if seq.busy:
            raise InputError("this context already has a call running; await it first (fork to work on a copy)")
        self._check(seq, request)
        stream = None if request.generate is None else TextStream(self.model.tokenizer, request.generate, incremental=request.stream)
        job = Job(seq, request, stream)
        job.adapters = (*self.model.adapters, *request.adapters)
        if request.sampling.grammar is not None and request.generate is not None:
            job.grammar = GrammarMatcher(request.sampling.grammar, self.model, request.generate.device_token_ids)
        seq.busy = True
        job.future.add_done_callback(lambda _: setattr(seq, "busy", False))
        with self._queue_lock:
            self._queue.append(job)
        self.collector.submitted()
        return job

    def wait(self, job: Job) -> ForwardResult:
        """Step the engine until ``job`` is done (serving every other waiting job too); its result."""
        while not job.done:
            with self._step_lock:
                if not job.done:
                    self.step()
        return job.future.result()

    def wait_any(self, jobs: Seq[Job]) -> None:
        """Step the engine until at least one of ``jobs`` is done (a front end that keeps many jobs in
        flight, such as a batch job, refills freed rows as soon as one finishes)."""
        while not any(job.done for job in jobs):
            with self._step_lock:
                if not any(job.done for job in jobs):
                    self.step()

    async def wait_async(self, job: Job) -> ForwardResult:
        """Await ``job`` while the engine steps on this event loop (see the module docstring)."""
        loop = asyncio.get_running_loop()
        self._schedule(loop)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self.cancel(job)
            raise

    def stream(self, job: Job) -> Iterator[str]:
        """Step until ``job`` is done, yielding its generated text as it comes. Closing the iterator
        early cancels the job (its row is freed at once)."""
        try:
            while True:
                if job.pieces:
                    pieces, job.pieces = job.pieces, []
                    yield "".join(pieces)
                if job.done:
                    job.future.result()  # raises the job's error
                    return
                with self._step_lock:
                    if not job.done and not job.pieces:
                        self.step()
        finally:
            if not job.done:
                self.cancel(job)

    def stream_many(self, jobs: Seq[Job]) -> Iterator[tuple[int, str]]:
        """Step until every job is done, yielding ``(index in jobs, text piece)`` as pieces come,
        interleaved; each job's pieces join to its text. The first failed job's error is raised;
        closing the iterator early cancels the jobs still running."""
        try:
            while True:
                for i, job in enumerate(jobs):
                    if job.pieces:
                        pieces, job.pieces = job.pieces, []
                        yield i, "".join(pieces)
                    if job.done and job.future.exception() is not None:
                        job.future.result()  # raises the job's error
                if all(job.done and not job.pieces for job in jobs):
                    return
                with self._step_lock:
                    if not any(job.pieces for job in jobs):
                        self.step()
        finally:
            for job in jobs:
                if not job.done:
                    self.cancel(job)

    def cancel(self, job: Job) -> None:
        """Drop a job: its sequence goes back to what it was at submission."""
        if job.done:
            return
        with self._step_lock:
            if not job.done:
                job.cancelled = True
                self._fail(job, ZgenError("the request was cancelled"))

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop not in self._scheduled:
            self._scheduled.add(loop)
            # Two hops: tasks woken by the last step run (and submit their next jobs) before this step.
            loop.call_soon(loop.call_soon, self._drive_async, loop)

    def _drive_async(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled.discard(loop)
        if not self._step_lock.acquire(blocking=False):
            loop.call_later(0.0005, self._schedule, loop)  # another thread is stepping
            return
        try:
            self.step()
        finally:
            self._step_lock.release()
        with self._queue_lock:
            pending = any(not job.done for job in self._queue)
        if pending:
            self._schedule(loop)

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> None:
        """Serve one compiled step of the waiting jobs (callers hold the step lock: use :meth:`wait`)."""
        with self._queue_lock:
            self._queue = [job for job in self._queue if not job.done]
            jobs = list(self._queue)
        if not jobs:
            return
        candidates, finishes = self._admissible(jobs[: self.config.max_batch], sum(not job.admitted for job in jobs))
        decode = all(job.loopable() for job in candidates)
        decode = decode and sum(job.grammar is not None for job in candidates) <= GRAMMAR_LOOP_ROWS
        if not decode and self.config.prefill_apart and self.kv.pages:
            candidates = [job for job in candidates if not job.loopable()]
            if self.config.refill_rows > 1:  # a full batch's first prompts prefill a group at a time too: one step width
                prompts = {id(job) for job in [job for job in candidates if not job.generating][: next_pow2(self.config.refill_rows)]}
                candidates = [job for job in candidates if job.generating or id(job) in prompts]
        speculator = self._speculator(candidates) if decode else None
        if speculator is None:
            self._draft_carry = None  # only a speculative loop (or its timing draws) comes between two it serves
        extra = 0 if speculator is None else draft_room(speculator)  # written past a pass's pending token
        per_step = 1 if speculator is None else speculator.num_tokens + 1  # tokens one pass may keep
        steps = self._loop_steps(candidates, per_step=per_step) if decode else 1
        rows: list[_Row] = []
        blocked: list[tuple[Job, PoolExhaustedError]] = []
        preempted: set[int] = set()
        position = {id(job): n for n, job in enumerate(jobs)}  # candidates may skip jobs: preempt only later ones
        budget = None if decode else self.config.step_tokens  # tokens this step may still take
        for job in candidates:
            n = position[id(job)]
            if id(job) in preempted:
                continue  # its KV was just freed for an earlier job: it feeds its tokens again next step
            if budget == 0:
                break  # the step is full: the rest go on in the next one
            while True:
                try:
                    rows.append(self._reserve(job, steps if decode else None, extra, limit=budget))
                    budget = None if budget is None else budget - rows[-1].count
                    break
                except PoolExhaustedError as err:
                    if self._preempt(jobs[n + 1 :], preempted, running=self.config.on_pool_exhausted == "wait"):
                        continue
                    blocked.append((job, err))
                    break
        for job, err in blocked:
            if self.config.on_pool_exhausted == "error":
                self._fail(job, err)
            elif not rows:  # nothing runs, so nothing will free room: waiting would hang
                self._fail(job, PoolExhaustedError(
                    f"{err} (no running request can free room: release contexts or sessions, drop masked pages, "
                    "or give the engine more KV memory)"
                ))
        if not rows:
            return
        for row in rows:
            row.job.seq.last_step = self.stats.steps
        self.collector.step(len(rows))
        self._step_started = time.perf_counter()
        try:
            if decode:
                waiting = bool(blocked) or bool(preempted) or len(jobs) > len(candidates)
                if speculator is not None and self._times_plain_first(rows, speculator):
                    for row in rows:  # a few plain draws time the plain step (the rows' drafting is untouched)
                        row.count = min(row.count, TIMING_DRAWS)
                    self._run_decode(rows, min(steps, _draw_bucket(TIMING_DRAWS)), exit_on_finish=waiting, finishes=finishes, timing=True)
                elif speculator is not None and self._rests_through(rows, speculator):
                    self._run_fallback(rows, steps, speculator, exit_on_finish=waiting, finishes=finishes)
                elif speculator is not None:
                    host = waiting or any(row.job.needs_host() for row in rows)
                    iterations = min(steps, self.config.steps_per_sync) if host else steps
                    iterations = 1 if any(row.job.request.per_token for row in rows) else iterations
                    # Return once a window's passes are timed: the rest weigh their cost.
                    passes = WINDOW if self._times_passes_first(rows, speculator) else iterations
                    self._run_speculative(rows, steps, iterations, passes, speculator, exit_on_finish=waiting)
                else:
                    self._run_decode(rows, steps, exit_on_finish=waiting, finishes=finishes)
            else:
                self._run_mixed(rows)
        except BaseException as err:
            for row in rows:  # every job of a step that broke fails; its sequence is as it was
                self._fail(row.job, err if isinstance(err, Exception) else ZgenError(repr(err)))
            if not isinstance(err, Exception):
                raise

    def _admissible(self, candidates: list[Job], new_jobs: int) -> tuple[list[Job], int]:
        """The candidates to serve now, and how many rows must finish before the decode loop returns
        for the new jobs left waiting (``refill_rows``: they are admitted together once that many
        rows are free, or as soon as nothing else runs)."""
        new = sum(not job.admitted for job in candidates)
        running = len(candidates) - new
        wanted = min(self.config.refill_rows, new_jobs)
        free = self.config.max_batch - running
        if not new or not running or free >= wanted:
            return candidates, 1
        return [job for job in candidates if job.admitted], wanted - free

    @staticmethod
    def _speculator(jobs: list[Job]) -> Speculator | None:
        """The speculator a decode step runs with: the one every job asked for (same loop key), with
        no penalties (they depend on each drawn token) and no LoRA adapters (the speculative loop runs
        the base model); otherwise the step decodes plainly, which gives the same tokens. Grammar rows
        speculate too: the loop checks their drafts against the grammar (see :mod:`zgen.runtime.speculation`),
        chains of them only (a tree speculator decodes them plainly)."""
        first = jobs[0].request.speculative
        if first is None:
            return None
        key = loop_key(first)
        for job in jobs:
            spec = job.request.speculative
            if spec is None or loop_key(spec) != key or job.sampling.uses_penalties or job.adapters:
                return None
            if job.grammar is not None and isinstance(spec, TreeSpeculator) and spec.tree_size is not None:
                return None  # grammar masks follow chains of drafts
        return first

    def _loop_steps(self, jobs: list[Job], *, per_step: int = 1) -> int:
        """Draws of this decode loop: every job's whole budget, unless one needs the host sooner (after
        ``steps_per_sync`` passes, each of which draws up to ``per_step`` tokens). Jobs left waiting do
        not shorten it: every one that could take a free row is in the batch, and the others (a full
        batch's, or new jobs held back for a refill group, see :meth:`_admissible`) join once enough
        rows are done, when the loop returns anyway."""
        draws = max(job.draws_left(self.max_len) for job in jobs)
        if any(job.request.per_token for job in jobs):
            return next_pow2(per_step)  # one pass
        if any(job.needs_host() for job in jobs):
            draws = min(draws, self.config.steps_per_sync * per_step)
        return _draw_bucket(draws)

    def _preempt(self, later: list[Job], preempted: set[int], *, running: bool) -> bool:
        """Make room: free the KV of one sequence whose K/V can be recomputed — an idle one (no call
        running on it) least recently served first, then (``running``) the latest-arrived later job.
        Its tokens stay; it feeds them again when it next runs, which gives the same K/V and so the
        same tokens. Sequences whose K/V were computed under masks cannot be recomputed: never taken."""
        idle = sorted((s for s in list(self._sequences) if not s.busy), key=lambda s: s.last_step)
        victims = [(None, s) for s in idle] + ([(job, job.seq) for job in reversed(later)] if running else [])
        for job, seq in victims:
            if seq.released or seq.kv_len == 0 or seq.custom_attention or seq.any_masked:
                continue
            if job is not None and (id(job) in preempted or job.done):
                continue
            seq.kv.reset()
            if job is not None:
                preempted.add(id(job))
            self.stats.preemptions += 1
            return True
        return False

    def _reserve(self, job: Job, decode_steps: int | None, extra: int = 0, limit: int | None = None) -> _Row:
        """Room for the job's next step; a decode loop's row gets ``decode_steps`` draws (and ``extra``
        positions past them, where a speculative loop writes drafts it may reject), a step's row at most
        ``limit`` tokens of its chunk."""
        seq = job.seq
        if not job.admitted or seq.kv_len == 0:
            self._admit(job)
        start = seq.kv_len
        if decode_steps is not None:
            want = min(decode_steps, job.draws_left(self.max_len))
            room = lambda n: min(n + extra, self.max_len - start)  # noqa: E731 - drafts past the context are never written
            try:
                seq.kv.reserve(room(want))
            except PoolExhaustedError:
                want = min(want, self.config.steps_per_sync)
                seq.kv.reserve(room(want))  # a smaller step fits more often; raises if even that does not
            return _Row(job, start, want, [start])
        chunk = self.config.prefill_chunk if limit is None else min(self.config.prefill_chunk, limit)
        end = min(job.feed_end(), start + chunk)
        seq.kv.reserve(end - start)
        r = job.request
        if job.text is not None and not job.generating:
            self.kv.expect(r.end + job.draws_left(self.max_len))
        if job.generating:  # the next token is drawn after the last one is fed
            reads = [end - 1] if end == seq.num_tokens else []
        else:
            reads = sorted({p for p in (*r.sample_at, *r.logits_at) if start <= p < end})
        return _Row(job, start, end - start, reads)

    def _admit(self, job: Job) -> None:
        """A job's first step (or a preempted one's next): an empty sequence starts from a cached
        prefix if the prefix cache has one; the first step starts the job's clock."""
        seq = job.seq
        plain = job.request.attention_mask is None and not job.adapters
        if seq.kv_len == 0 and not seq.custom_attention and not seq.any_masked and plain:
            reads = (*job.request.sample_at, *job.request.logits_at)  # positions read out must be fed
            cached = self.kv.match_prefix(seq.kv, seq.tokens[: min(job.feed_end(), min(reads, default=job.feed_end()) + 1)])
            if not job.admitted:
                job.result.cached_tokens = cached
                job.start = seq.kv_len
        if not job.admitted:
            job.admitted = True
            job._started = time.perf_counter()

    def _width(self, jobs: list[Job]) -> tuple[int, list[int]]:
        """The batch width of a step of ``jobs``, and each one's row index in it."""
        width, index = self.kv.layout([job.seq.kv for job in jobs])
        if self.kv.pages:
            # Refills come in groups: no narrower step shapes (each a compile) than a group's. Nor wider
            # than the engine's batch: a padded row costs the paged kernels time (their split of the
            # pages counts every row: coded q4, 33 rows of 32k, H200: 1.41 ms alone, 2.44 padded to 64).
            width = max(len(jobs), min(max(width, next_pow2(self.config.refill_rows)), self.config.max_batch))
        return width, index

    def _times_plain_first(self, rows: list[_Row], speculator: Speculator) -> bool:
        """Whether a decode step of ``rows`` with an adaptive ``speculator`` runs plainly first, to time
        the plain step at this width: the fallback weighs a pass's measured cost against it (rows under
        a grammar or taken a token at a time are not timed: their host work would count as the step's).
        A plain step timed cold is timed again once a pass is (speculation starts in between)."""
        if not speculator.adaptive or not _timed(rows):
            return False
        width = self._width([row.job for row in rows])[0]
        plain = ("plain", width)
        if self.loop_times.per_iteration(plain) is None:
            return True
        return not self.loop_times.warm(plain) and self.loop_times.pass_cost(width, speculator) > 0

    def _times_passes_first(self, rows: list[_Row], speculator: Speculator) -> bool:
        """Whether the plain step at this width is timed and ``speculator``'s pass not yet."""
        width = self._width([row.job for row in rows])[0]
        return speculator.adaptive and self.loop_times.per_iteration(("plain", width)) is not None and not self.loop_times.pass_cost(width, speculator)

    def _control(self, job: Job, speculator: Speculator) -> dict[str, np.ndarray]:
        """``job``'s draft-length control (one row); a new request's starts where the speculator's last
        loop left off on this engine (see ``_misses``)."""
        if job.control is None:
            job.control = DraftControl.initial(1, speculator.num_tokens, self._misses.get(loop_key(speculator), 0))
        return job.control

    def _rests_through(self, rows: list[_Row], speculator: Speculator) -> bool:
        """Whether every row of a decode step with an adaptive ``speculator`` stays in fallback through
        all its draws (no probe falls due): the step is then the plain decode loop itself."""
        if not speculator.adaptive:
            return False
        controls = [self._control(row.job, speculator) for row in rows]
        return all(int(c["length"][0]) == 0 and int(c["wait"][0]) >= row.count for row, c in zip(rows, controls, strict=True))

    def _run_fallback(self, rows: list[_Row], steps: int, speculator: Speculator, *, exit_on_finish: bool, finishes: int) -> None:
        """A decode step whose rows all stay in fallback: the plain decode loop (a speculative loop's
        stretch of plain steps costs a GPU more, in its own arguments and loop predicates: 3 to 5 plain
        steps a SmolLM2 generation at batch 1), each row's wait counted down by its draws."""
        if any(row.job.request.per_token for row in rows):  # one draw a host round trip, as a plain batch's
            steps = 1
            for row in rows:
                row.count = min(row.count, 1)
        before = [row.job.seq.num_tokens for row in rows]
        self.stats.fallback_steps += self._run_decode(rows, steps, exit_on_finish=exit_on_finish, finishes=finishes)
        for row, tokens in zip(rows, before, strict=True):
            job = row.job
            control = self._control(job, speculator)
            control["wait"] = control["wait"] - (job.seq.num_tokens - tokens)
            job.result.speculative = job.result.speculative or SpeculativeStats(0, 0, 0)

    def _step_rows(self, rows: list[_Row], tokens: int) -> tuple[int, list[int], KVState]:
        width, index = self._width([row.job for row in rows])
        step_rows = []
        for row in rows:
            seq, r = row.job.seq, row.job.request
            override = None
            if r.attention_mask is not None and not row.job.generating:
                first = row.start - row.job.start
                override = np.asarray(r.attention_mask, bool)[first : first + row.count]
                seq.custom_attention = True
            masked = np.flatnonzero(seq.masked) if seq.any_masked else None
            if masked is not None or row.job.adapters:  # K/V unlike a plain prefill's: never a shared prefix
                seq.custom_attention = True
            step_rows.append(StepRow(seq.kv, row.start, row.count, masked, override))
        return width, index, self.kv.step_state(step_rows, width, tokens)

    def _sampling(
        self, rows: list[_Row], index: list[int], width: int
    ) -> tuple[SamplingParams, SamplingFlags, np.ndarray, PenaltyState | None]:
        """The rows' sampling parameters (on the device), flags, key data (on the host: it travels with
        the step's other host inputs) and penalty state."""
        configs = [GREEDY] * width
        seeds: list[int | None] = [0] * width
        for row, i in zip(rows, index, strict=True):
            configs[i] = row.job.sampling
            seeds[i] = row.job.sampling.seed if row.job.sampling.seed is not None else row.job.seq.seed
        vocab = self.model.config.vocab_size
        flags = SamplingFlags.from_configs(configs, vocab)
        keys = row_key_data(seeds)
        penalties = self._penalties(rows, index, width) if flags.penalties else None
        if self._last_params is None or self._last_params[0] != configs:
            self._last_params = configs, SamplingParams.from_configs(configs, vocab)
        return self._last_params[1], flags, keys, penalties

    def _penalties(self, rows: list[_Row], index: list[int], width: int) -> PenaltyState:
        """Penalty state from token ids: each row has seen its sequence, and generated its job's tokens."""
        seen = [row.job.seq.tokens[: row.start + row.count] for row in rows]
        generated = [row.job.text.tokens if row.job.text is not None else [] for row in rows]
        seen_ids = np.zeros((width, next_pow2(max(len(s) for s in seen), 16)), np.int32)
        gen_ids = np.zeros((width, next_pow2(max(max(len(g) for g in generated), 1), 16)), np.int32)
        seen_len, gen_len = np.zeros(width, np.int32), np.zeros(width, np.int32)
        for i, s, g in zip(index, seen, generated, strict=True):
            seen_ids[i, : len(s)], seen_len[i] = s, len(s)
            gen_ids[i, : len(g)], gen_len[i] = g, len(g)
        seen_ids, seen_len, gen_ids, gen_len = jax.device_put((seen_ids, seen_len, gen_ids, gen_len))
        return penalty_state(seen_ids, seen_len, gen_ids, gen_len, self.model.config.vocab_size)

    def _run_mixed(self, rows: list[_Row]) -> None:
        t = next_pow2(max(row.count for row in rows), 1 if all(row.count == 1 for row in rows) else 16)
        if self.config.step_tokens is not None and t > 1:  # chunks cut to fill a budget come in any length: one width
            t = next_pow2(self.config.prefill_chunk, 16)
        r = next_pow2(max(max(len(row.reads), 1) for row in rows))
        width, index, state = self._step_rows(rows, t)
        tokens = np.zeros((width, t), np.int32)
        positions = np.full((width, t), -1, np.int32)
        read_rows = np.zeros((width, r), np.int32)
        draw_index = np.zeros((width, r), np.int32)
        for row, i in zip(rows, index, strict=True):
            tokens[i, : row.count] = row.job.seq.tokens[row.start : row.start + row.count]
            positions[i, : row.count] = np.arange(row.start, row.start + row.count)
            read_rows[i, : len(row.reads)] = [p - row.start for p in row.reads]
            draw_index[i, : len(row.reads)] = row.reads
        params, flags, keys, penalties = self._sampling(rows, index, width)
        host_choice = any(row.job.sampling.choose is not None for row in rows)
        want_logits = host_choice or any(p in row.job.request.logits_at for row in rows for p in row.reads if not row.job.generating)
        want_draws = any(row.job.generating or p in row.job.request.sample_at for row in rows for p in row.reads)
        slots, bank = self._banks.for_rows([row.job.adapters for row in rows], index, width)
        packing = None
        if self.config.packed_steps and slots is None and t > 1:
            counts = [0] * width
            for row, i in zip(rows, index, strict=True):
                counts[i] = row.count
            piece = PACKED_PIECE if isinstance(state, PagedKVState) else None  # pieces read their rows' pages
            tokens, positions, read_rows, packing = Packing.of(tokens, positions, read_rows, counts, self.config.step_tokens, piece)
        host: dict[str, Any] = dict(tokens=tokens, positions=positions, read_rows=read_rows, draw_index=draw_index, keys=keys)
        batch = MixedBatch(**host, sampling=params, penalties=penalties, adapter_slots=slots, packing=packing)  # numpy: sent by the compiled call
        constrained = [(row.job.grammar, i) for row, i in zip(rows, index, strict=True) if row.job.grammar is not None and row.reads]
        if constrained:
            # The forward is dispatched first; the grammar masks are computed on the host while it runs.
            out_logits, state = self.runner.forward(
                state, batch.tokens, batch.positions, batch.read_rows, batch.adapter_slots, batch.packing, adapters=bank
            )
            self.kv.absorb(state)
            masks = np.full((width, mask_words(self.model.config.vocab_size)), -1, np.int32)
            failed = fill_masks(constrained, masks)
            for row, i in zip(rows, index, strict=True):
                if i in failed:
                    self._fail(row.job, failed[i])
            out = self.runner.draw(out_logits, batch, jax.device_put(masks), flags=flags, logits=want_logits, filtered=host_choice)
        else:
            out, state = self.runner.mixed(
                state, batch, flags=flags, logits=want_logits, filtered=host_choice, draws=want_draws, adapters=bank
            )
            self.kv.absorb(state)
        sampled, logprobs, logits, filtered = jax.device_get((out.tokens, out.logprobs, out.logits, out.filtered))
        self.stats.steps += 1
        self.stats.forward_passes += 1
        self.stats.rows += len(rows)
        for row, i in zip(rows, index, strict=True):
            job = row.job
            if job.done:
                continue
            self.stats.prefill_tokens += 0 if job.generating else row.count
            try:
                for k, p in enumerate(row.reads):
                    if p in job.request.logits_at and not job.generating:
                        job.result.logits[p] = np.asarray(logits[i, k], np.float32)
                    if job.generating or p in job.request.sample_at:
                        token, logprob = int(sampled[i, k]), float(logprobs[i, k])
                        if job.sampling.choose is not None:
                            token, logprob = self._host_choice(job, logits[i, k], filtered[i, k])
                        self._take(job, p, token, logprob)
                self._deliver(job)
                job.result.steps += 1
                if not job.generating and row.start + row.count >= job.request.end and job.text is None:
                    self._finish(job)
                elif job.generating:
                    self._after_generation_step(job)
            except Exception as err:  # this job's fault (a host choice function): it fails alone
                self._fail(job, err)

    def _host_choice(self, job: Job, raw: np.ndarray, filtered: np.ndarray) -> tuple[int, float]:
        choose = job.sampling.choose
        assert choose is not None
        x = filtered.astype(np.float64)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        token = choose(order, probs[order])
        vocab = self.model.config.vocab_size
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab:
            raise TokenIdError(f"the sampler's choice function returned {token!r}, not a token id in [0, {vocab})")
        row = raw.astype(np.float64)
        return int(token), float(row[int(token)] - np.logaddexp.reduce(row))

    def _run_decode(self, rows: list[_Row], steps: int, *, exit_on_finish: bool, finishes: int = 1, timing: bool = False) -> int:
        """A plain decode loop over ``rows``; ``timing``: it times the plain step for an adaptive speculator
        (and, the first time at this width, a loop call's fixed cost). Returns the steps it took."""
        width, index, state = self._step_rows(rows, 1)
        token = np.zeros(width, np.int32)
        position = np.full(width, -1, np.int32)
        done = np.ones(width, bool)
        last_step = np.zeros(width, np.int32)
        stops = [job.text.stop.device_token_ids if (job := row.job).text is not None else () for row in rows]
        stop_ids = np.full((width, next_pow2(max(max(len(s) for s in stops), 1))), -1, np.int32)
        for row, i, ids in zip(rows, index, stops, strict=True):
            token[i], position[i], done[i], last_step[i] = row.job.seq.tokens[row.start], row.start, row.count <= 0, row.count - 1
            stop_ids[i, : len(ids)] = ids
        params, flags, keys, penalties = self._sampling(rows, index, width)
        slots, bank = self._banks.for_rows([row.job.adapters for row in rows], index, width)
        columns = self.runner.loop_columns(steps)
        constrained = [(row.job.grammar, i) for row, i in zip(rows, index, strict=True) if row.job.grammar is not None]
        grammar = self._loop_grammars if constrained else None
        if grammar is not None:
            done[list(grammar.start(constrained, width))] = True
        host: dict[str, Any] = dict(  # numpy: the compiled call sends them with its arguments, at no extra cost
            token=token, position=position, done=done, last_step=last_step, stop_ids=stop_ids, keys=keys,
            out_tokens=np.full((width, columns), -1, np.int32), out_logprobs=np.zeros((width, columns), np.float32),
            step=np.int32(0), max_steps=np.int32(steps),
            # the loop leaves once more than done_at_start rows are done: after `finishes` of them
            exit_on_finish=np.bool_(exit_on_finish), done_at_start=np.int32(done.sum() + finishes - 1),
        )
        loop = DecodeLoop(**host, penalties=penalties, adapter_slots=slots)
        timed = _timed(rows) and bank is None and penalties is None  # the steps a speculative pass competes with
        try:
            if timing and timed and self.loop_times.call_seconds(width) is None:
                state = self._time_call(width, state, loop, params, flags)
            started, compiling = time.perf_counter(), self.runner.compile_seconds
            loop, state = self.runner.decode(state, loop, params, flags=flags, adapters=bank, grammar=grammar)
            self.kv.absorb(state)
            out, logprobs, iterations = jax.device_get((loop.out_tokens, loop.out_logprobs, loop.step))
            if timed:
                warm = self.runner.compile_seconds == compiling
                self.loop_times.record_plain(width, self.runner.run_seconds(started, compiling), int(iterations), warm=warm)
        finally:  # the loop has run (its results are here): the grammars' last turn is all that may be left
            failures = {} if grammar is None else grammar.finish()
        self.stats.steps += 1
        self.stats.forward_passes += int(iterations)
        self.stats.rows += len(rows)
        for row, i, ids in zip(rows, index, stops, strict=True):
            if i in failures:
                self._fail(row.job, failures[i])
                continue
            drawn = _row_draws(out[i, : min(row.count, int(iterations))].tolist(), ids)
            self._take_loop_draws(row, drawn, logprobs[i], grammar_taken=row.job.grammar is not None)
        return int(iterations)

    def _take_loop_draws(self, row: _Row, drawn: list[int], logprobs: np.ndarray, *, grammar_taken: bool = False) -> None:
        """A loop row's draws: keep their K/V (the input and all but the last draw), roll back the rest.
        ``grammar_taken``: the loop's grammar host work already advanced the job's grammar past them."""
        job = row.job
        self.stats.decode_tokens += len(drawn)
        job.seq.kv.truncate(row.start + len(drawn))
        for n, t in enumerate(drawn):
            self._take(job, row.start + n, t, float(logprobs[n]), grammar_taken=grammar_taken)
        if grammar_taken:
            self._end_if_grammar_complete(job)
        self._deliver(job)
        job.result.steps += 1
        if job.text is None:
            self._finish(job)  # a single draw, nothing continues
        else:
            self._after_generation_step(job)

    def _time_call(self, width: int, state: KVState, loop: DecodeLoop, params: SamplingParams, flags: SamplingFlags) -> KVState:
        """Time the fixed cost of a decode loop call at ``width`` rows: the same call with no step to run
        (the least of three, compiling first if it must); returns the KV state, which it leaves as it was."""
        idle = replace(loop, max_steps=np.int32(0))
        for _ in range(3):
            started, compiling = time.perf_counter(), self.runner.compile_seconds
            out, state = self.runner.decode(state, idle, params, flags=flags)
            jax.device_get((out.out_tokens, out.out_logprobs, out.step))
            self.loop_times.record_call(width, self.runner.run_seconds(started, compiling))
        return state

    def _run_speculative(
        self, rows: list[_Row], steps: int, iterations: int, passes: int, speculator: Speculator, *, exit_on_finish: bool
    ) -> None:
        """Decode ``rows`` with ``speculator`` in one on-device loop of at most ``iterations`` (passes or
        plain steps), ``passes`` of them verifying drafts, each row up to its reserved draws (at most
        ``steps``) (:mod:`zgen.runtime.speculation`)."""
        k = speculator.num_tokens
        width, index, state = self._step_rows(rows, k + 1)
        length = next_pow2(max(row.start + row.count + k + 2 for row in rows), 16)
        history = np.zeros((width, length), np.int32)
        lengths = np.ones(width, np.int32)
        limit = np.zeros(width, np.int32)
        budget = np.zeros(width, np.int32)
        done = np.ones(width, bool)
        control: dict[str, Any] = DraftControl.initial(width, k)
        stops = [job.text.stop.device_token_ids if (job := row.job).text is not None else () for row in rows]
        stop_ids = np.full((width, next_pow2(max(max(len(s) for s in stops), 1))), -1, np.int32)
        for row, i, ids in zip(rows, index, stops, strict=True):
            seq = row.job.seq
            history[i, : row.start + 1] = seq.tokens[: row.start + 1]
            lengths[i], limit[i], budget[i], done[i] = row.start + 1, seq.kv_len, row.count, row.count <= 0
            stop_ids[i, : len(ids)] = ids
            for name, value in self._control(row.job, speculator).items():
                control[name][i] = value[0]
        params, flags, keys, _ = self._sampling(rows, index, width)
        zeros = lambda: np.zeros(width, np.int32)  # noqa: E731
        # Room for the most draws any loop of the model had, plus what the last pass may keep past them:
        # loops of fewer draws (the first after a timing, or near a budget's end) share one executable.
        columns = self.runner.loop_columns(steps) + k + 1
        host: dict[str, Any] = dict(  # numpy, sent by the compiled call
            history=history, length=lengths, limit=limit, budget=budget, emitted=zeros(), done=done, stop_ids=stop_ids,
            keys=keys, out_tokens=np.full((width, columns), -1, np.int32),
            out_logprobs=np.zeros((width, columns), np.float32), drafted=zeros(), accepted=zeros(), verified=zeros(),
            control=DraftControl(**control), pass_cost=np.float32(self.loop_times.pass_cost(width, speculator)),
            step=np.int32(0), plain_steps=np.int32(0), max_steps=np.int32(iterations), max_passes=np.int32(passes), exit_on_finish=np.bool_(exit_on_finish),
            done_at_start=np.int32(done.sum()),
        )
        loop = SpeculativeLoop(**host)
        constrained = [(row.job.grammar, i) for row, i in zip(rows, index, strict=True) if row.job.grammar is not None]
        self._draft_grammars.start(constrained)
        seqs = tuple((i, row.job.seq) for row, i in zip(rows, index, strict=True))
        carried, self._draft_carry = _carried(self._draft_carry, seqs, speculator, history, lengths), None
        started, compiling = time.perf_counter(), self.runner.compile_seconds
        try:
            grammar = self._draft_grammars if constrained else None
            loop, state, final = self.runner.speculate(state, loop, params, speculator, flags=flags, grammar=grammar, carried=carried)
        finally:
            failures = self._draft_grammars.finish()
        self.kv.absorb(state)
        out, logprobs, emitted, drafted, accepted, verified, iterations, plain_steps, ctl, history, lengths = jax.device_get((
            loop.out_tokens, loop.out_logprobs, loop.emitted, loop.drafted, loop.accepted, loop.verified, loop.step, loop.plain_steps,
            loop.control, loop.history, loop.length,
        ))
        if final is not None:
            self._draft_carry = _DraftCarry(seqs, speculator, final, history, lengths)
        if _timed(rows):
            warm = self.runner.compile_seconds == compiling
            seconds = self.runner.run_seconds(started, compiling)
            self.loop_times.record_loop(width, speculator, seconds, int(iterations), int(plain_steps), warm=warm)
        if speculator.adaptive:
            self._misses[loop_key(speculator)] = int(min(ctl.misses[i] for i in index))
        self.stats.fallback_steps += int(plain_steps)
        self.stats.steps += 1
        self.stats.forward_passes += int(iterations)
        self.stats.rows += len(rows)
        for row, i, ids in zip(rows, index, stops, strict=True):
            job = row.job
            job.control = {name: np.asarray(getattr(ctl, name))[i : i + 1] for name in control}
            stats = SpeculativeStats(int(drafted[i]), int(accepted[i]), int(verified[i]))
            self.collector.speculation(stats.draft_tokens, stats.accepted_tokens, stats.steps)
            job.result.speculative = stats if job.result.speculative is None else job.result.speculative + stats
            if i in failures:
                self._fail(job, failures[i])
                continue
            drawn = _row_draws(out[i, : min(row.count, int(emitted[i]))].tolist(), ids)
            self._take_loop_draws(row, drawn, logprobs[i], grammar_taken=job.grammar is not None)

    def _take(self, job: Job, position: int, token: int, logprob: float, *, grammar_taken: bool = False) -> None:
        """Record a token sampled at ``position``; a generation keeps it (``job.drawn``, appended to the
        sequence after the step's tokens are all taken) and goes on."""
        r = job.request
        if not job.generating:
            if job.text is None or position != r.end - 1:
                job.result.tokens.append(token)
                job.result.logprobs.append(logprob)
                return
            job.generating = True  # the sample after the last fed token is the first generated one
            job._first_token = time.perf_counter()
        assert job.text is not None
        if job.text.done:
            return  # drawn past a stop on the device: rolled back when the job finishes
        if job.grammar is not None and not grammar_taken:
            job.grammar.consume(token)
        piece = job.text.push(token)
        job.drawn.append(token)
        job.result.tokens.append(token)
        job.result.logprobs.append(logprob)
        if piece and r.stream:
            job.pieces.append(piece)
        if job.grammar is not None and not grammar_taken:
            self._end_if_grammar_complete(job)

    @staticmethod
    def _end_if_grammar_complete(job: Job) -> None:
        """A generation whose grammar is complete ends: nothing else may follow."""
        assert job.text is not None
        if job.grammar is not None and job.grammar.complete and not job.text.done:
            piece = job.text.finish("stop")
            if piece and job.request.stream:
                job.pieces.append(piece)

    def _deliver(self, job: Job) -> None:
        """Append the step's generated tokens to the sequence and count them (metrics)."""
        if job.drawn:
            now = time.perf_counter()
            first = now - job.submitted if job.delivered is None else None
            since = job.delivered if job.delivered is not None else self._step_started
            self.collector.tokens(len(job.drawn), first_token_s=first, interval_s=now - since)
            job.delivered = now
        job.seq.append(job.drawn)
        job.drawn = []

    def _after_generation_step(self, job: Job) -> None:
        assert job.text is not None
        if not job.text.done and job.draws_left(self.max_len) <= 0:
            piece = job.text.finish("length")
            if piece and job.request.stream:
                job.pieces.append(piece)
        if job.text.done:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        result = job.result
        if job.text is not None:
            job.seq.keep_pending(job.request.end + len(job.text.tokens))  # draws past a stop are rolled back
            result.text, result.finish_reason = job.text.text, job.text.finish_reason  # type: ignore[assignment]
        now = time.perf_counter()
        started = job._started or now
        first = job._first_token or now
        result.prefill_s, result.decode_s = first - started, now - first
        reason = result.finish_reason if job.text is not None else "done"
        self.collector.finished_request(reason, prompt_tokens=job.request.end, cached_tokens=result.cached_tokens)
        job.future.set_result(result)

    def _fail(self, job: Job, err: BaseException) -> None:
        """Fail ``job`` alone: its sequence goes back to what it was when the job was submitted."""
        seq = job.seq
        try:
            if not seq.released:
                seq.keep(min(job.origin, seq.num_tokens))
                if seq.kv_len > job.start:
                    seq.kv.truncate(job.start)
        except ZgenError:
            pass  # the cache itself is broken (a step failed after donating it); the job's error says why
        finally:
            if not job.done:
                self.collector.finished_request("cancelled" if job.cancelled else "failed")
                job.future.set_exception(err)

    # -- checks ---------------------------------------------------------------------------------

    def _check(self, seq: Sequence, request: ForwardRequest) -> None:
        start, end = seq.kv_len, request.end
        if not start < end <= seq.num_tokens:
            raise InputError(f"nothing to feed: positions [{start}, {end}) of a sequence of {seq.num_tokens} tokens")
        for p in (*request.sample_at, *request.logits_at):
            if not start <= p < end:
                raise InputError(f"position {p} is not among the fed positions [{start}, {end})")
        if request.generate is not None and (end - 1) not in request.sample_at:
            raise InputError("generating needs a sample at the last fed position")
        if request.sampling.grammar is not None and (request.generate is None or request.sample_at != (end - 1,)):
            raise InputError("a grammar constrains a generation: sample only at the last fed position and generate")
        if end > self.max_len:
            raise PromptTooLongError(f"{end} tokens exceed the model's context of {self.max_len}")
        mask = request.attention_mask
        if mask is not None and np.shape(mask) != (end - start, end):
            raise InputError(f"attention_mask must be bool [{end - start}, {end}] (fed tokens x all tokens), got {np.shape(mask)}")
        if (mask is not None or seq.any_masked) and not self.kv.pages:
            raise ConfigError(f"masks need a paged cache (paged or tiered); this engine uses {self.kv.kind}")
        if request.adapters and self.model.split:
            raise ConfigError("LoRA adapters on a model split with tensor_parallel are not available yet; load it on one device")
        for pair in request.adapters:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], LoraAdapter)):
                raise AdapterError(f"a request's adapters are (LoraAdapter, scale) pairs, got {pair!r}")
            check_adapter(pair[0], self.model.config)
        if request.speculative is not None:
            self.check_speculator(request.speculative)

    def check_speculator(self, speculator: Speculator) -> None:
        """Refuse a speculator this engine cannot run (another vocabulary; the compressed cache, whose
        chunk pooling cannot take back rejected drafts; token trees on a format that codes keys with their
        positions) with a typed error."""
        if self.kv.kind == "compressed":
            raise ConfigError(
                "speculative decoding writes drafts it may reject, and the compressed cache pools chunks as "
                "tokens arrive, so it cannot roll them back exactly; use the tensor, flat, paged or tiered cache"
            )
        size = speculator.tree_size if isinstance(speculator, TreeSpeculator) else None
        storage = self.cache_options.kv_dtype or kv_dtype_of(self.model.dtype)
        if size is not None and kv_format(storage, self.model.config.head_dim).coded:
            raise ConfigError(
                f"token trees need a KV format that stores a key apart from its position, and {storage!r} codes keys "
                "with their positions (a tree pass would differ from plain decoding within that format's noise); "
                "draft a chain (no tree=) on q4/q3, or use fp8, bf16, fp16 or fp32 pages for trees"
            )
        if speculator not in self._speculators:
            speculator.check_target(self.model)
            self._speculators.add(speculator)


def _timed(rows: list[_Row]) -> bool:
    """Whether a loop over ``rows`` times the device's steps (``Engine.loop_times``): not with rows under
    a grammar or taken a token at a time, whose host round trips would count as the steps'."""
    return not any(row.job.grammar is not None or row.job.request.per_token for row in rows)


@dataclass(frozen=True)
class _DraftCarry:
    """A resumable speculator's state as its last loop left it, with the rows' sequences and tokens then."""

    seqs: tuple[tuple[int, Sequence], ...]  # (batch row, sequence)
    speculator: Speculator
    state: Any
    history: np.ndarray
    lengths: np.ndarray


def _carried(carry: _DraftCarry | None, seqs: tuple[tuple[int, Sequence], ...], speculator: Speculator, history: np.ndarray,
             lengths: np.ndarray) -> Any:
    """The state a speculative loop over ``seqs`` (holding ``history[:lengths]``) goes on from: the last
    loop's, if it ran a resumable ``speculator`` over the same sequences in the same rows at the same
    shapes and each row's tokens still agree with what it held then; else ``None`` (start over)."""
    if carry is None or carry.speculator is not speculator or carry.history.shape != history.shape:
        return None
    if len(carry.seqs) != len(seqs) or any(i != j or a is not b for (i, a), (j, b) in zip(carry.seqs, seqs, strict=True)):
        return None
    for i, _ in seqs:
        m = min(int(carry.lengths[i]), int(lengths[i]))
        if not np.array_equal(carry.history[i, :m], history[i, :m]):
            return None
    return carry.state


def _draw_bucket(draws: int) -> int:
    """A decode loop's length in few sizes (16, 64, 256, ...): each size is a compiled loop, and a
    longer loop than the draws costs nothing (rows stop at their own last draw)."""
    size = 16
    while size < draws:
        size *= 4
    return size


def _row_draws(out: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """A decode-loop row's draws: up to and including its first stop id, and before the first -1 (a
    row the loop ended otherwise, as its grammar completing)."""
    end = next((n + (token != -1) for n, token in enumerate(out) if token == -1 or token in stop_ids), len(out))
    return out[:end]


__all__ = ["Engine", "EngineConfig", "EngineStats", "ForwardRequest", "ForwardResult", "Job"]
