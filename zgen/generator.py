"""Generator: prompts in, text out — a front end of the runtime's :class:`~zgen.runtime.engine.Engine`.

The path of one request: encode and validate the prompt → a :class:`~zgen.runtime.sequence.Sequence`
with the prompt pending → one :class:`~zgen.runtime.engine.ForwardRequest` that prefills it and goes on
generating until the request's stop condition → the engine batches it with every other live request
(a finished row frees its slot at once) → a :class:`~zgen.runtime.results.GenerationResult`. The
Generator owns no decode loop, no pool and no sampler: it translates.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Self, cast

import numpy as np

from zgen.cache.factory import CacheOption
from zgen.errors import AdapterError, ConfigError, InputError, PromptTooLongError
from zgen.lora.adapter import AdapterChoice, LoraAdapter, adapter_pairs, check_adapter
from zgen.model import Model
from zgen.runtime.beam import Beam, EarlyStopping, beam_search, check_beam_options
from zgen.runtime.engine import Engine, EngineConfig, ForwardRequest, ForwardResult, Job
from zgen.runtime.metrics import EngineMetrics
from zgen.runtime.results import GenerationResult, Timings, TokenUsage
from zgen.runtime.sampling import HostSampler, SamplingConfig
from zgen.runtime.sequence import Sequence as TokenSequence
from zgen.runtime.speculation import Speculator
from zgen.runtime.stop import StopCondition
from zgen.tokenizer import plain_token_ids

Message = Mapping[str, str]
Prompt = str | Sequence[int] | Sequence[Message]


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: StopCondition | None = None  # more stop rules, on top of the sampling config's own
    adapter: AdapterChoice | None = None  # LoRA adapter(s) for this request, on top of the model's pushed ones


class Generator:
    """Generates text from a loaded :class:`~zgen.model.Model`: prompts in, results or text streams out.

    Cache options (:mod:`zgen.cache.factory`: ``paged_kv``, ``kv_dtype``, ``prefix_cache``, ...) choose
    the KV cache (default: the dense ``tensor`` cache in the model's dtype). ``max_batch_size`` rows
    decode together (more requests queue and take rows as others finish); ``sync_interval`` is how
    many tokens the device loop runs between host checks when stop strings or streaming need the host;
    ``host_sampler`` picks every token with a Python callable on (ids sorted by probability, their
    probabilities) — a host round trip per token. ``speculative`` decodes every request with a
    speculator (:mod:`zgen.speculative`: ``PromptLookup``, ``DraftModel``): greedy output is token for
    token the plain output, and results carry the speculator's figures (``result.speculative``).
    ``refill_rows``: queued requests wait until that many rows are free, then prefill together;
    ``prefill_apart``: on a paged cache, prefill steps leave the decoding rows out; ``packed_steps``:
    a prefill step's rows are one token stream, of ``step_tokens`` tokens when that is set
    (:class:`~zgen.runtime.engine.EngineConfig`).

    A generator is a context manager: :meth:`close` frees what its cache holds outside the device (a
    tiered cache's host RAM and disk files; garbage collection frees them too). It is safe to use from
    several threads: their requests share the engine's steps.
    """

    def __init__(
        self,
        model: Model,
        *options: CacheOption,
        max_batch_size: int = 16,
        sync_interval: int = 8,
        prefill_chunk: int = 512,
        host_sampler: HostSampler | None = None,
        speculative: Speculator | None = None,
        refill_rows: int = 1,
        prefill_apart: bool = False,
        packed_steps: bool = False,
        step_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.host_sampler = host_sampler
        self.speculative = speculative
        config = EngineConfig(
            max_batch=max_batch_size, steps_per_sync=sync_interval, prefill_chunk=prefill_chunk, on_pool_exhausted="wait",
            refill_rows=refill_rows, prefill_apart=prefill_apart, packed_steps=packed_steps, step_tokens=step_tokens,
        )
        self.engine = Engine(model, *options, config=config, default_kind="tensor")
        self._paged_engine: Engine | None = None  # for beam search when the chosen cache cannot fork
        if speculative is not None:
            self.engine.check_speculator(speculative)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Free what the cache holds outside the device (a tiered store's RAM and files); a tiered
        generator cannot generate after."""
        self.engine.close()
        if self._paged_engine is not None:
            self._paged_engine.close()

    # -- public API ----------------------------------------------------------------------------

    def generate(
        self, prompt: Prompt, sampling: SamplingConfig | None = None, *, adapter: AdapterChoice | None = None
    ) -> GenerationResult:
        return self.batch_generate([Request(prompt, sampling or SamplingConfig(), adapter=adapter)])[0]

    def chat(
        self, messages: Sequence[Message], sampling: SamplingConfig | None = None, *, adapter: AdapterChoice | None = None
    ) -> GenerationResult:
        return self.generate(list(messages), sampling, adapter=adapter)

    def generate_stream(
        self, prompt: Prompt, sampling: SamplingConfig | None = None, *, per_token: bool = False,
        adapter: AdapterChoice | None = None,
    ) -> Iterator[str]:
        """Yield text pieces as they are decoded; their concatenation equals ``generate(...).text``.
        Text arrives every ``sync_interval`` tokens, or with ``per_token`` as each token is drawn (a
        host round trip per token). Closing the iterator early frees the request's row."""
        request = Request(prompt, sampling or SamplingConfig(), adapter=adapter)
        ids = self.encode_prompt(request.prompt)
        self._check_fits(len(ids), request.sampling.max_new_tokens)
        _, job = self._submit(request, ids, stream=True, per_token=per_token)
        yield from self.engine.stream(job)

    def batch_generate_stream(
        self, requests: Sequence[Request | Prompt], *, per_token: bool = False
    ) -> Iterator[tuple[int, str]]:
        """Stream several requests at once: ``(request index, text piece)`` in the order the pieces are
        decoded, interleaved; each request's pieces join to what :meth:`batch_generate` returns for it.
        Every request is validated before anything runs; ``per_token`` as in :meth:`generate_stream`.
        Closing the iterator early frees every row still generating."""
        jobs, _ = self._submit_all(requests, stream=True, per_token=per_token)
        yield from self.engine.stream_many(jobs)

    def batch_generate(self, requests: Sequence[Request | Prompt]) -> list[GenerationResult]:
        """Generate for several prompts; every request is validated before anything runs, then all are
        queued at once and the engine keeps ``max_batch_size`` of them decoding (continuous batching)."""
        jobs, encoded = self._submit_all(requests)
        try:
            return [self._result(self.engine.wait(job), ids) for job, ids in zip(jobs, encoded, strict=True)]
        finally:
            for job in jobs:
                self.engine.cancel(job)

    def _submit_all(self, requests: Sequence[Request | Prompt], *, stream: bool = False, per_token: bool = False) -> tuple[list[Job], list[list[int]]]:
        """Validate every request, then queue them all (none if any is invalid); the jobs and prompt ids."""
        normalized = [r if isinstance(r, Request) else Request(r) for r in requests]
        encoded = [self.prepare(r) for r in normalized]
        jobs: list[Job] = []
        try:
            for ids, request in zip(encoded, normalized, strict=True):
                jobs.append(self._submit(request, ids, stream=stream, per_token=per_token)[1])
        except BaseException:
            for job in jobs:
                self.engine.cancel(job)
            raise
        return jobs, encoded

    def prepare(self, request: Request | Prompt) -> list[int]:
        """The prompt's token ids, checked to fit the model's context with the request's
        ``max_new_tokens`` (a typed error says what does not): what :meth:`submit` checks."""
        request = request if isinstance(request, Request) else Request(request)
        ids = self.encode_prompt(request.prompt)
        self._check_fits(len(ids), request.sampling.max_new_tokens)
        return ids

    def submit(self, request: Request | Prompt, prompt_ids: Sequence[int] | None = None) -> Submitted:
        """Queue one request and return at once (``prompt_ids``: what :meth:`prepare` returned, to skip
        encoding again). ``engine.wait(submitted.job)`` or ``engine.wait_any(jobs)`` step the engine;
        every queued request rides along in those steps (continuous batching)."""
        request = request if isinstance(request, Request) else Request(request)
        ids = self.prepare(request) if prompt_ids is None else list(prompt_ids)
        return Submitted(self._submit(request, ids)[1], ids)

    def logits(self, token_ids: Sequence[int], *, adapter: AdapterChoice | None = None) -> np.ndarray:
        """Next-token logits ``[len(token_ids), vocab]`` after every prefix, in float32."""
        ids = self.engine.check_ids(token_ids)
        if not ids:
            raise InputError("logits needs at least one token")
        seq = self.engine.new_sequence(ids)
        try:
            request = ForwardRequest(end=len(ids), logits_at=tuple(range(len(ids))), adapters=adapter_pairs(adapter))
            result = self.engine.wait(self.engine.submit(seq, request))
        finally:
            self.engine.release(seq)
        return np.stack([result.logits[p] for p in range(len(ids))])

    def beam_search(
        self,
        prompt: Prompt,
        num_beams: int,
        *,
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
        max_new_tokens: int = 256,
        adapter: AdapterChoice | None = None,
    ) -> list[Beam]:
        """The ``num_beams`` best continuations of ``prompt`` by beam search, best first, with HF
        transformers' choices and scores (``generate(num_beams=..., do_sample=False)``; see
        :mod:`zgen.runtime.beam`). Beams share KV pages copy-on-write: on a cache without pages the
        generator keeps a paged engine for them."""
        check_beam_options(num_beams, max_new_tokens, length_penalty, early_stopping)
        ids = self.encode_prompt(prompt)
        self._check_fits(len(ids), max_new_tokens)
        engine = self.engine
        if not engine.kv.pages:
            if self._paged_engine is None:
                self._paged_engine = Engine(self.model, config=self.engine.config)
            engine = self._paged_engine
        return beam_search(
            engine, ids, num_beams=num_beams, max_new_tokens=max_new_tokens, eos_token_ids=self.model.eos_token_ids,
            length_penalty=length_penalty, early_stopping=early_stopping, adapters=adapter_pairs(adapter),
        )

    def new_session(self, *, adapter: AdapterChoice | None = None) -> Session:
        """A conversation keeping its KV between turns; every turn runs with ``adapter`` (see :class:`Session`)."""
        return Session(self, adapter=adapter)

    def metrics(self) -> EngineMetrics:
        """What this generator's engine has done: requests, tokens, latencies, batch occupancy, KV
        pages (see :mod:`zgen.runtime.metrics`; ``.prometheus()`` gives the Prometheus text)."""
        return self.engine.metrics()

    # -- prompt handling -----------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (text, chat messages or ids), checked against the vocabulary."""
        tokenizer = self.model.tokenizer
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        elif isinstance(prompt, (bytes, bytearray)):  # a Sequence of ints, but never meant as token ids
            raise InputError("a prompt is text, not bytes: decode it first (e.g. data.decode('utf-8'))")
        elif isinstance(prompt, Sequence) and plain_token_ids(prompt, self.model.config.vocab_size):
            ids = list(cast(Sequence[int], prompt))  # token ids, the common case, checked without a scan for chat messages
        elif isinstance(prompt, Sequence) and any(isinstance(m, Mapping) for m in prompt):
            messages = [m for m in prompt if isinstance(m, Mapping)]
            if len(messages) != len(prompt):
                raise InputError(
                    "chat messages are dicts like {'role': 'user', 'content': 'Hi'}; "
                    f"got a list holding {', '.join(sorted({type(m).__name__ for m in prompt}))}"
                )
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        elif isinstance(prompt, Sequence):
            ids = self.engine.check_ids([t for t in prompt if not isinstance(t, Mapping)])  # (none are, here)
        else:
            raise InputError(f"a prompt is text, chat messages or token ids, got {type(prompt).__name__}")
        if not ids:
            raise InputError("the prompt is empty; give at least one token")
        return ids

    def _check_fits(self, prompt_len: int, max_new: int) -> None:
        limit = self.model.config.max_position_embeddings
        if prompt_len + max_new > limit:
            raise PromptTooLongError(
                f"prompt of {prompt_len} tokens plus max_new_tokens={max_new} exceeds the model's context "
                f"of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )

    # -- requests on the engine ----------------------------------------------------------------

    def _sampling(self, request: Request) -> SamplingConfig:
        config = request.sampling
        if self.host_sampler is not None:
            if config.choose is not None:
                raise ConfigError("the request's sampling config has its own choose function and the generator a host_sampler; pass one")
            config = replace(config, choose=self.host_sampler)
        return config

    def _submit(
        self, request: Request, ids: list[int], *, stream: bool = False, per_token: bool = False, seq: TokenSequence | None = None
    ) -> tuple[TokenSequence, Job]:
        """Queue a generation of ``request`` on a new sequence of ``ids``, released when the job is done
        (or on ``seq``, whose tokens must already be ``ids`` and which stays the caller's)."""
        config = self._sampling(request)
        stop = StopCondition.from_sampling(config, self.model.eos_token_ids)
        if request.stop is not None:
            stop = stop | request.stop
        forward = ForwardRequest(
            end=len(ids), sample_at=(len(ids) - 1,), sampling=config, generate=stop, stream=stream, per_token=per_token,
            adapters=adapter_pairs(request.adapter),
            speculative=self.speculative,
        )
        if seq is not None:
            return seq, self.engine.submit(seq, forward)
        seq = self.engine.new_sequence(ids, seed=secrets.randbits(63))
        try:
            job = self.engine.submit(seq, forward)
        except BaseException:
            self.engine.release(seq)
            raise
        owned = seq  # a request's sequence frees its row the moment it is done, for the next request
        job.future.add_done_callback(lambda _: self.engine.release(owned))
        return seq, job

    @staticmethod
    def _result(result: ForwardResult, ids: list[int]) -> GenerationResult:
        return GenerationResult(
            text=result.text,
            token_ids=list(result.tokens),
            prompt_token_ids=list(ids),
            logprobs=list(result.logprobs),
            finish_reason=result.finish_reason,
            usage=TokenUsage(len(ids), len(result.tokens), result.cached_tokens),
            timings=Timings(result.prefill_s, result.decode_s, result.steps),
            speculative=result.speculative,
        )


@dataclass(frozen=True, eq=False)
class Submitted:
    """A request queued with :meth:`Generator.submit`."""

    job: Job
    prompt_token_ids: list[int]

    @property
    def done(self) -> bool:
        return self.job.done

    def result(self) -> GenerationResult:
        """The result of a done request (raises its error)."""
        if not self.job.done:
            raise InputError("this request is still running; wait for it first (generator.engine.wait(submitted.job))")
        return Generator._result(self.job.future.result(), self.prompt_token_ids)


class Session:
    """A conversation that keeps its KV between turns, on every cache kind.

    Each call takes the whole conversation (text, ids or chat messages); the longest prefix shared with
    the tokens already in this session's cache is not computed again. Safe beside other sessions of
    one Generator (a session on a row cache holds its row between turns: :meth:`reset` frees it).

    ``adapter`` (one LoRA adapter, an ``(adapter, scale)`` pair or a list of them) runs every turn with
    that mix, on top of the model's pushed adapters; :meth:`push_adapter` / :meth:`pop_adapter` change
    it for later turns. K/V computed under one mix are wrong under another, so the session keeps its
    KV only while the mix (its own and the model's stack) is the one that computed it: the first turn
    after a change computes the whole conversation again (``usage.cached_prompt_tokens`` is 0), then
    turns reuse the KV as before.
    """

    def __init__(self, generator: Generator, *, adapter: AdapterChoice | None = None) -> None:
        self.generator = generator
        self._lock = threading.Lock()
        self._seq: TokenSequence | None = None
        self._adapters: list[tuple[LoraAdapter, float]] = []
        for pair in adapter_pairs(adapter):
            self.push_adapter(*pair)
        self._kv_mix: tuple[tuple[LoraAdapter, float], ...] = ()  # the adapters the kept K/V were computed with

    @property
    def adapters(self) -> tuple[tuple[LoraAdapter, float], ...]:
        """The session's adapter mix, (adapter, scale) in the order applied."""
        return tuple(self._adapters)

    def push_adapter(self, adapter: LoraAdapter, scale: float = 1.0) -> None:
        """Run later turns with ``adapter`` (times ``scale``) too, on top of the session's others; the
        next turn computes the conversation's K/V again (class docstring)."""
        ((adapter, scale),) = adapter_pairs((adapter, scale))
        check_adapter(adapter, self.generator.model.config)
        self._adapters.append((adapter, scale))

    def pop_adapter(self) -> LoraAdapter:
        """Take the last adapter pushed on this session off its mix and return it."""
        if not self._adapters:
            raise AdapterError("no adapter was pushed on this session; nothing to pop")
        return self._adapters.pop()[0]

    @property
    def token_ids(self) -> list[int]:
        return [] if self._seq is None else list(self._seq.tokens)

    def generate(self, prompt: Prompt, sampling: SamplingConfig | None = None) -> GenerationResult:
        ids, sampling = self._checked(prompt, sampling)
        with self._lock:
            job = self._submit(ids, sampling, stream=False, per_token=False)
            return self.generator._result(self.generator.engine.wait(job), ids)

    def generate_stream(self, prompt: Prompt, sampling: SamplingConfig | None = None, *, per_token: bool = False) -> Iterator[str]:
        """Yield the reply's text pieces as they are decoded (``per_token``: as each token is drawn);
        their concatenation equals what :meth:`generate` returns, and the session keeps the turn's KV
        the same way. Finish or close the iterator before the session's next call (it holds the
        session until then); closing it early drops the unfinished reply."""
        ids, sampling = self._checked(prompt, sampling)
        with self._lock:
            yield from self.generator.engine.stream(self._submit(ids, sampling, stream=True, per_token=per_token))

    def _checked(self, prompt: Prompt, sampling: SamplingConfig | None) -> tuple[list[int], SamplingConfig]:
        sampling = sampling or SamplingConfig()
        ids = self.generator.encode_prompt(prompt)
        self.generator._check_fits(len(ids), sampling.max_new_tokens)
        return ids, sampling

    def _submit(self, ids: list[int], sampling: SamplingConfig, *, stream: bool, per_token: bool) -> Job:
        """Queue the turn on this session's sequence, keeping the K/V of the prefix it shares (hold the lock)."""
        gen = self.generator
        seq = self._seq or gen.engine.new_sequence(seed=secrets.randbits(63))
        self._seq = seq
        mix = (*gen.model.adapters, *self._adapters)  # what the engine runs the turn with
        same_mix = len(mix) == len(self._kv_mix) and all(
            a is b and x == y for (a, x), (b, y) in zip(mix, self._kv_mix, strict=True)
        )
        shared = _common_prefix(seq.tokens, ids[:-1]) if same_mix else 0  # the last prompt token is fed for its logits
        seq.keep(shared)
        seq.append(ids[shared:])
        self._kv_mix = mix
        request = Request(ids, sampling, adapter=tuple(self._adapters))
        return gen._submit(request, ids, stream=stream, per_token=per_token, seq=seq)[1]

    def reset(self) -> None:
        with self._lock:
            if self._seq is not None:
                self.generator.engine.release(self._seq)
            self._seq = None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


__all__ = ["Beam", "GenerationResult", "Generator", "Request", "Session", "Submitted", "Timings", "TokenUsage"]
