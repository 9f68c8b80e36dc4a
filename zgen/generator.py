"""Generator: prompts in, text out, over a model's compiled execution plan.

The path of one request: encode → validate → bucket the shapes → prefill (one compiled call) →
decode loop on device (one compiled call per host sync) → detokenize incrementally → stop strings.
The host syncs only where something needs it: stop strings and streaming sync every
``sync_interval`` tokens, a host-side sampler every token, plain generation once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from zgen.cache.base import CacheBackend, KVState
from zgen.cache.options import CacheOption, make_backend, resolve
from zgen.cache.paged import PagedBackend, PagedKVState
from zgen.cache.tensor import DenseBackend
from zgen.errors import ConfigError, InputError, PromptTooLongError, TokenIdError
from zgen.graph.plan import DecodeState
from zgen.model import Model
from zgen.sampling import (
    HostSampler,
    SamplingConfig,
    SamplingFlags,
    SamplingParams,
    filter_logits,
    host_candidates,
    init_penalty_state,
    make_row_keys,
    update_penalty_state,
)
from zgen.stopping import StopStringMatcher
from zgen.tokenizer import IncrementalDecoder

Message = Mapping[str, str]
Prompt = str | Sequence[int] | Sequence[Message]


@dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache, not prefill

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    prefill_s: float
    decode_s: float
    host_syncs: int


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    logprobs: list[float]  # log-softmax of each chosen token under the unmodified distribution
    finish_reason: str  # "stop" (stop token or stop string) or "length"
    usage: TokenUsage
    timings: Timings


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


def _bucket(n: int, minimum: int) -> int:
    """Smallest power of two ≥ n (and ≥ minimum): few distinct shapes, so few compilations."""
    size = minimum
    while size < n:
        size *= 2
    return size


class _RowText:
    """Incremental detokenization and stop-string matching of one generated sequence."""

    def __init__(self, decoder: IncrementalDecoder, stops: Sequence[str], stop_ids: frozenset[int]) -> None:
        self.decoder = decoder
        self.matcher = StopStringMatcher(stops)
        self.stop_ids = stop_ids
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.text: list[str] = []
        self.done = False
        self.finish_reason = "length"

    def push(self, token: int, logprob: float) -> str:
        """Take one generated token; returns the text it releases."""
        if self.done:
            return ""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.done, self.finish_reason = True, "stop"
            return self._emit(self.decoder.flush(), final=True)
        return self._emit(self.decoder.push(token), final=False)

    def finish(self) -> str:
        if self.done:
            return ""
        self.done = True
        return self._emit(self.decoder.flush(), final=True)

    def _emit(self, piece: str, *, final: bool) -> str:
        out, stopped = self.matcher.push(piece)
        if stopped:
            self.done, self.finish_reason = True, "stop"
        elif final:
            out += self.matcher.flush()
        self.text.append(out)
        return out


@dataclass
class _Batch:
    """The shapes and device state of one batch of requests."""

    prompts: list[list[int]]
    configs: list[SamplingConfig]
    rows: list[_RowText]
    cache: KVState
    state: DecodeState
    sampling: SamplingParams
    flags: SamplingFlags
    prefill_s: float
    reused: list[int] = field(default_factory=lambda: [])  # per row: prompt tokens taken from the prefix cache


class Generator:
    """Generates text from a loaded :class:`~zgen.model.Model` (the Go package's ``Generator``).

    ``max_batch_size`` bounds one compiled batch (larger request lists run in several);
    ``sync_interval`` is how many tokens the device loop runs between host checks when stop
    strings or streaming need the host; ``host_sampler`` replaces on-device sampling with a
    Python callable on (ids sorted by probability, their probabilities) — it costs a host round
    trip per token.

    A generator is a context manager: :meth:`close` frees what its cache holds outside the device (a
    tiered cache's host RAM and disk files; garbage collection frees them too).
    """

    def __init__(
        self,
        model: Model,
        *options: CacheOption,
        max_batch_size: int = 16,
        sync_interval: int = 8,
        host_sampler: HostSampler | None = None,
        kv_backend: CacheBackend[Any] | None = None,
    ) -> None:
        if max_batch_size < 1 or sync_interval < 1:
            raise ConfigError("max_batch_size and sync_interval must be at least 1")
        self.model = model
        self.max_batch_size = max_batch_size
        self.sync_interval = sync_interval
        self.host_sampler = host_sampler
        if kv_backend is not None and options:
            raise ConfigError("pass either cache options or a kv_backend, not both")
        self.cache_options = resolve(options)
        self._owns_backend = kv_backend is None
        self.kv_backend: CacheBackend[Any] = kv_backend or make_backend(self.cache_options, model)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the cache backend this generator built, if it holds anything to free (a tiered cache's
        store: host RAM, disk files, its temporary directory; such a generator cannot generate after).
        A ``kv_backend`` passed in is the caller's to close.
        """
        close = getattr(self.kv_backend, "close", None)
        if self._owns_backend and callable(close):
            close()

    # -- public API ----------------------------------------------------------------------------

    def generate(self, prompt: Prompt, sampling: SamplingConfig | None = None) -> GenerationResult:
        return self.batch_generate([Request(prompt, sampling or SamplingConfig())])[0]

    def chat(self, messages: Sequence[Message], sampling: SamplingConfig | None = None) -> GenerationResult:
        return self.generate(list(messages), sampling)

    def generate_stream(self, prompt: Prompt, sampling: SamplingConfig | None = None) -> Iterator[str]:
        """Yield text pieces as they are decoded; their concatenation equals ``generate(...).text``."""
        batch = self._start([Request(prompt, sampling or SamplingConfig())])
        try:
            for pieces in self._decode(batch, stream=True):
                if pieces[0]:
                    yield pieces[0]
        finally:
            self._finish(batch)

    def batch_generate(self, requests: Sequence[Request | Prompt]) -> list[GenerationResult]:
        """Generate for several prompts at once, in batches of up to ``max_batch_size`` rows."""
        normalized = [r if isinstance(r, Request) else Request(r) for r in requests]
        results: list[GenerationResult] = []
        for start in range(0, len(normalized), self.max_batch_size):
            batch = self._start(normalized[start : start + self.max_batch_size])
            decode_start = time.perf_counter()
            try:
                syncs = sum(1 for _ in self._decode(batch, stream=False))
                results.extend(self._results(batch, time.perf_counter() - decode_start, syncs))
            finally:
                self._finish(batch)
        return results

    def _finish(self, batch: _Batch) -> None:
        """Hand the batch's cache back, first sharing its full blocks with the prefix cache."""
        backend, cache = self.kv_backend, batch.cache
        if isinstance(backend, PagedBackend) and backend.radix is not None and isinstance(cache, PagedKVState):
            for row, (prompt, text) in enumerate(zip(batch.prompts, batch.rows, strict=True)):
                backend.commit_prefix(cache, row, prompt + text.tokens)  # every token was fed
        self.kv_backend.release(cache)

    def new_session(self) -> Session:
        return Session(self)

    # -- prompt handling -----------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        tokenizer = self.model.tokenizer
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        elif prompt and all(isinstance(m, Mapping) for m in prompt):
            messages = [m for m in prompt if isinstance(m, Mapping)]
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt if not isinstance(t, Mapping)]
        self._validate(ids)
        return ids

    def _validate(self, ids: Sequence[int]) -> None:
        if not ids:
            raise InputError("the prompt is empty; give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise TokenIdError(f"token ids {bad[:5]} are outside [0, {vocab}) for this model's vocabulary")

    def _check_fits(self, prompt_len: int, max_new: int) -> None:
        limit = self.model.config.max_position_embeddings
        if prompt_len + max_new > limit:
            raise PromptTooLongError(
                f"prompt of {prompt_len} tokens plus max_new_tokens={max_new} exceeds the model's context "
                f"of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )

    # -- the batch pipeline --------------------------------------------------------------------

    def _start(self, requests: Sequence[Request], prompts: list[list[int]] | None = None) -> _Batch:
        prompts = prompts or [self.encode_prompt(r.prompt) for r in requests]
        configs = [r.sampling for r in requests]
        for ids, config in zip(prompts, configs, strict=True):
            self._check_fits(len(ids), config.max_new_tokens)
        config = self.model.config
        width = _bucket(len(prompts), 1)
        # Padding rows repeat row 0 and start finished; their results are dropped.
        padded = prompts + [prompts[0]] * (width - len(prompts))
        needed = max(len(p) + c.max_new_tokens for p, c in zip(prompts, configs, strict=True))
        capacity = max(
            min(_bucket(needed, 128), _bucket(config.max_position_embeddings, 128)),
            _bucket(max(len(p) for p in padded), 16),
        )
        backend = self.kv_backend
        if isinstance(backend, PagedBackend) and backend.radix is not None:
            cache, reused = backend.allocate_with_prefix(padded, capacity)
        else:
            cache, reused = backend.allocate(width, capacity), [0] * width
        try:
            logits, cache, prefill_s = self._prefill(cache, [p[r:] for p, r in zip(padded, reused, strict=True)], reused)
        except BaseException:
            backend.release(cache)
            raise
        batch = self._make_batch(prompts, configs, padded, logits, cache, prefill_s)
        batch.reused = reused[: len(prompts)]
        return batch

    def _prefill(
        self, cache: KVState, rows: Sequence[Sequence[int]], offsets: Sequence[int]
    ) -> tuple[jax.Array, KVState, float]:
        """Feed each row's tokens at positions offset, offset+1, ...; returns its last token's logits."""
        model = self.model
        longest = max(len(r) for r in rows)
        bucket = 1 if longest == 1 else _bucket(longest, 16)  # a single token (host-sampled step) is not padded
        tokens = np.full((len(rows), bucket), model.plan.pad_id, np.int32)
        for i, ids in enumerate(rows):
            tokens[i, : len(ids)] = ids
        positions = np.asarray(offsets, np.int32)[:, None] + np.arange(bucket, dtype=np.int32)
        last = np.asarray([len(r) - 1 for r in rows], np.int32)[:, None]
        start = time.perf_counter()
        logits, cache = model.plan.prefill(
            model.params, cache, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(last)
        )
        logits.block_until_ready()
        return logits[:, 0], cache, time.perf_counter() - start

    def _make_batch(
        self,
        prompts: list[list[int]],
        configs: list[SamplingConfig],
        padded: list[list[int]],
        logits: jax.Array,
        cache: KVState,
        prefill_s: float,
    ) -> _Batch:
        model = self.model
        width, real = len(padded), len(prompts)
        configs_padded = configs + [configs[0]] * (width - real)
        lengths = jnp.asarray([len(p) for p in padded], jnp.int32)
        eos = model.eos_token_ids
        stop_sets = [
            frozenset(() if c.ignore_eos else (c.stop_token_ids if c.stop_token_ids is not None else eos))
            for c in configs_padded
        ]
        stop_ids = np.full((width, max(1, max(len(s) for s in stop_sets))), -1, np.int32)
        for row, ids in enumerate(stop_sets):
            stop_ids[row, : len(ids)] = sorted(ids)
        buffer = _bucket(max(c.max_new_tokens for c in configs), 16)
        sampling = SamplingParams.from_configs(configs_padded, model.config.vocab_size)
        flags = SamplingFlags.from_configs(configs_padded, model.config.vocab_size)
        prompt_ids = np.zeros((width, max(len(p) for p in padded)), np.int32)
        for row, ids in enumerate(padded):
            prompt_ids[row, : len(ids)] = ids
        state = DecodeState(
            logits=logits,
            positions=lengths,
            step=jnp.asarray(0, jnp.int32),
            finished=jnp.asarray([row >= real for row in range(width)]),
            tokens=jnp.zeros((width, buffer), jnp.int32),
            logprobs=jnp.zeros((width, buffer), jnp.float32),
            row_keys=make_row_keys([c.seed for c in configs_padded]),
            penalties=(
                init_penalty_state(jnp.asarray(prompt_ids), lengths, model.config.vocab_size) if flags.penalties else None
            ),
            max_new_tokens=jnp.asarray([c.max_new_tokens for c in configs_padded], jnp.int32),
            stop_ids=jnp.asarray(stop_ids),
        )
        rows = [
            _RowText(model.tokenizer.incremental_decoder(skip_special_tokens=True), c.stop, stop_sets[i])
            for i, c in enumerate(configs)
        ]
        return _Batch(prompts, configs, rows, cache, state, sampling, flags, prefill_s)

    def _decode(self, batch: _Batch, *, stream: bool) -> Iterator[list[str]]:
        """Advance the batch to completion; yields the new text of each row after every host sync."""
        max_new = max(c.max_new_tokens for c in batch.configs)
        needs_host = stream or any(c.stop for c in batch.configs)
        interval = self.sync_interval if needs_host else max_new
        if self.host_sampler is not None:
            yield from self._decode_host_sampled(batch)
            return
        seen = 0
        while True:
            stop_at = min(seen + interval, max_new)
            batch.state, batch.cache = self.model.plan.decode(
                self.model.params, batch.cache, batch.state, batch.sampling, stop_at, batch.flags
            )
            # One device-to-host transfer per sync; slicing on the host compiles nothing.
            state = batch.state
            step_h, tokens_h, logprobs_h, device_finished = jax.device_get(
                (state.step, state.tokens, state.logprobs, state.finished)
            )
            step = int(step_h)
            pieces = self._absorb(batch, tokens_h[:, seen:step], logprobs_h[:, seen:step])
            seen = step
            finished = np.asarray(device_finished).copy()
            for row, text in enumerate(batch.rows):
                finished[row] |= text.done
            if finished.all() or step >= max_new:
                pieces = [p + r.finish() for p, r in zip(pieces, batch.rows, strict=True)]
                yield pieces
                return
            if not np.array_equal(finished, device_finished):
                # A stop string ended a row: stop spending the device loop on it.
                batch.state = replace(batch.state, finished=jnp.asarray(finished))
            yield pieces

    def _absorb(self, batch: _Batch, tokens: np.ndarray, logprobs: np.ndarray) -> list[str]:
        pieces: list[str] = []
        for row, text in enumerate(batch.rows):
            out: list[str] = []
            for token, logprob in zip(tokens[row], logprobs[row], strict=True):
                if text.done:
                    break
                out.append(text.push(int(token), float(logprob)))
                if len(text.tokens) >= batch.configs[row].max_new_tokens and not text.done:
                    out.append(text.finish())
            pieces.append("".join(out))
        return pieces

    def _decode_host_sampled(self, batch: _Batch) -> Iterator[list[str]]:
        """One forward per token with a Python sampler choosing each token (leaves the device loop)."""
        assert self.host_sampler is not None
        model = self.model
        vocab = model.config.vocab_size
        state = batch.state
        while not all(r.done for r in batch.rows):
            filtered = filter_logits(state.logits, batch.sampling, state.penalties, batch.flags)
            ids, probs = (np.asarray(a) for a in host_candidates(filtered, vocab))
            chosen = np.asarray([self.host_sampler(ids[row], probs[row]) for row in range(len(ids))], np.int32)
            if not ((chosen >= 0) & (chosen < vocab)).all():
                raise TokenIdError(f"the host sampler returned ids {chosen.tolist()} outside [0, {vocab})")
            logprob = np.asarray(jax.nn.log_softmax(state.logits, axis=-1))[np.arange(len(chosen)), chosen]
            pieces = self._absorb(batch, chosen[:, None], logprob[:, None])
            token = jnp.asarray(chosen)
            positions = np.asarray(state.positions).tolist()
            logits, batch.cache, _ = self._prefill(batch.cache, [[int(t)] for t in chosen], positions)
            penalties = state.penalties
            if penalties is not None:
                penalties = update_penalty_state(penalties, token, ~state.finished)
            state = replace(state, logits=logits, positions=state.positions + 1, step=state.step + 1, penalties=penalties)
            batch.state = state
            yield pieces

    def _results(self, batch: _Batch, decode_s: float, syncs: int) -> list[GenerationResult]:
        results: list[GenerationResult] = []
        reused = batch.reused or [0] * len(batch.prompts)
        for prompt, text, cached in zip(batch.prompts, batch.rows, reused, strict=True):
            results.append(
                GenerationResult(
                    text="".join(text.text),
                    token_ids=list(text.tokens),
                    prompt_token_ids=list(prompt),
                    logprobs=list(text.logprobs),
                    finish_reason=text.finish_reason,
                    usage=TokenUsage(len(prompt), len(text.tokens), cached),
                    timings=Timings(batch.prefill_s, decode_s, syncs),
                )
            )
        return results


class Session:
    """A conversation with its own KV cache, safe to use beside other sessions of one Generator.

    Each call takes the whole conversation (text, ids or chat messages); the longest prefix shared
    with the tokens already in this session's cache is not computed again.
    """

    def __init__(self, generator: Generator) -> None:
        self.generator = generator
        self._lock = threading.Lock()
        self._tokens: list[int] = []
        self._cache: KVState | None = None

    @property
    def token_ids(self) -> list[int]:
        return list(self._tokens)

    def generate(self, prompt: Prompt, sampling: SamplingConfig | None = None) -> GenerationResult:
        with self._lock:
            return self._generate(prompt, sampling or SamplingConfig())

    def reset(self) -> None:
        with self._lock:
            self._drop_cache()

    def _drop_cache(self) -> None:
        if self._cache is not None:
            self.generator.kv_backend.release(self._cache)
        self._tokens, self._cache = [], None

    def _generate(self, prompt: Prompt, sampling: SamplingConfig) -> GenerationResult:
        gen = self.generator
        ids = gen.encode_prompt(prompt)
        gen._check_fits(len(ids), sampling.max_new_tokens)
        if not isinstance(gen.kv_backend, DenseBackend):
            # Other backends lend one state at a time (paged) or keep lossy views: nothing is held
            # between turns; a paged backend with a prefix cache still skips the shared prefix.
            (result,) = gen.batch_generate([Request(ids, sampling)])
            self._tokens = ids + result.token_ids
            return result
        reused = _common_prefix(self._tokens, ids[:-1])  # the last prompt token must be fed for logits
        # The suffix is prefilled in a power-of-two bucket that must fit the cache too.
        needed = max(len(ids) + sampling.max_new_tokens, reused + _bucket(len(ids) - reused, 16))
        if self._cache is None or self._cache.capacity < needed or reused == 0:
            self._drop_cache()
            result_batch = gen._start([Request(ids, sampling)], [ids])
        else:
            result_batch = self._start_from_cache(ids, reused, sampling)
        decode_start = time.perf_counter()
        syncs = sum(1 for _ in gen._decode(result_batch, stream=False))
        (result,) = gen._results(result_batch, time.perf_counter() - decode_start, syncs)
        self._cache = result_batch.cache
        self._tokens = ids + result.token_ids
        return result

    def _start_from_cache(self, ids: list[int], reused: int, sampling: SamplingConfig) -> _Batch:
        """Prefill only the suffix after the reused prefix; positions continue where it ends."""
        gen = self.generator
        assert self._cache is not None
        logits, cache, prefill_s = gen._prefill(self._cache, [ids[reused:]], [reused])
        batch = gen._make_batch([ids], [sampling], [ids], logits, cache, prefill_s)
        batch.reused = [reused]
        return batch


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


__all__ = ["GenerationResult", "Generator", "Request", "Session", "Timings", "TokenUsage"]
