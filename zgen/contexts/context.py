"""Contexts: Pie's programmable unit of inference — fill, flush, fork, save, mask, drive token by token.

A :class:`Context` is a front end of the runtime: it holds a :class:`~zgen.runtime.sequence.Sequence`
(token ids and the KV pages, in its engine's shared pool, of all but its last token, which is
*pending*) plus the chat turns filled so far. ``fill*`` appends pending tokens, ``flush`` feeds all but
the last, ``generate`` decodes. Every long call submits a request to the engine and waits for the steps
that serve it; each has an ``*_async`` twin, and several contexts' async calls run concurrently
(``asyncio.gather`` or :func:`gather`) share batches.

Positions: token ``i`` is at position ``i`` for good — masking (``mask_token_range``) hides tokens from
attention without renumbering, and dropping masked pages frees their memory while later tokens keep
counting up (as StreamingLLM without position shifting). A context therefore holds at most the
model's context length of positions, however few pages it keeps. Contexts need a paged cache
(``paged`` or ``tiered``): forks share pages and masks drop them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar, overload

import numpy as np

from zgen.cache.paged import PagedKVCache
from zgen.contexts import snapshot
from zgen.contexts.drafter import Drafter, HostDrafter
from zgen.contexts.snapshot import ImportedKVState
from zgen.errors import AdapterError, CacheError, ConfigError, InputError, PromptTooLongError
from zgen.lora.adapter import LoraAdapter, adapter_pairs, check_adapter
from zgen.model import Model, attached
from zgen.runtime.engine import GREEDY, Engine, ForwardRequest, ForwardResult, Job
from zgen.runtime.results import GenerationResult, Timings, TokenUsage
from zgen.runtime.sampling import SamplingConfig
from zgen.runtime.sequence import Sequence as TokenSequence
from zgen.runtime.speculation import Speculator
from zgen.runtime.stop import StopCondition


Role = Literal["system", "user", "assistant"]
T = TypeVar("T")
def default_engine(model: Model) -> Engine:
    """The model's default engine for contexts (paged, default settings; made on first use)."""
    return attached(model, "context_engine", lambda: Engine(model))


@overload
def gather(*awaitables: Awaitable[T], return_exceptions: Literal[False] = False) -> list[T]: ...
@overload
def gather(*awaitables: Awaitable[T], return_exceptions: Literal[True]) -> list[T | BaseException]: ...
def gather(*awaitables: Awaitable[T], return_exceptions: bool = False) -> list[T] | list[T | BaseException]:
    """Run several contexts' async calls concurrently from synchronous code (their forward passes
    share steps); results in order. With ``return_exceptions``, a call's error is its result (the
    others still finish), as in ``asyncio.gather``."""

    async def all_of() -> list[T | BaseException]:
        return list(await asyncio.gather(*awaitables, return_exceptions=return_exceptions))

    return asyncio.run(all_of())


@dataclass(frozen=True)
class Distribution:
    """A full next-token distribution, most probable first."""

    ids: np.ndarray  # int [V]
    probs: np.ndarray  # float [V], sums to 1


@dataclass(frozen=True)
class ForwardOutput:
    """``tokens``/``logprobs``: one per sampled index, in index order; ``logits``: raw float32 logits
    per requested index (``[vocab]`` each)."""

    tokens: list[int]
    logprobs: list[float]
    logits: dict[int, np.ndarray]


class Context:
    """A token sequence with its KV pages in an engine's pool: ``Context(model)`` (the model's default
    engine) or ``Context(engine)``; ``seed`` fixes its sampling where a config has no seed."""

    def __init__(self, model_or_engine: Model | Engine, *, seed: int | None = None) -> None:
        engine = model_or_engine if isinstance(model_or_engine, Engine) else default_engine(model_or_engine)
        _require_pages(engine)
        self._init(engine, engine.new_sequence(seed=seed))

    def _init(self, engine: Engine, seq: TokenSequence) -> None:
        self.engine = engine
        self.seq = seq
        self._messages: list[dict[str, str]] = []
        self._awaiting_reply = False  # a chat turn was filled; generate adds the assistant header
        self._reply_open = False  # the last message is a generated reply that no stop ended: generate continues it
        self._adapters: list[tuple[LoraAdapter, float]] = []  # LoRA stack of this context's forward passes
        self._release = weakref.finalize(self, engine.release, seq)

    @classmethod
    def _wrap(cls, engine: Engine, seq: TokenSequence) -> Context:
        ctx = cls.__new__(cls)
        ctx._init(engine, seq)
        return ctx

    # -- state -------------------------------------------------------------------------------------

    @property
    def seed(self) -> int:
        return self.seq.seed

    @property
    def cache(self) -> PagedKVCache:
        """The context's pages (its block table, shared and owned blocks)."""
        assert isinstance(self.seq.kv, PagedKVCache)
        return self.seq.kv

    @property
    def token_ids(self) -> list[int]:
        """Every token of the context (the KV cache holds all but the pending ones)."""
        return list(self.seq.tokens)

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are in the pages."""
        return self.seq.kv_len

    @property
    def pending_ids(self) -> list[int]:
        return self.seq.tokens[self.kv_len :]

    @property
    def masked_positions(self) -> np.ndarray:
        return np.flatnonzero(self.seq.masked)

    @property
    def masked_flags(self) -> np.ndarray:
        """A copy of the per-token mask (``True`` = hidden from attention)."""
        return self.seq.masked.copy()

    @property
    def pages_used(self) -> int:
        """Pages this context holds (shared ones included)."""
        return len(self.cache.owned_blocks())

    @property
    def pages_shared(self) -> int:
        """Pages this context shares with other contexts, exports, snapshots or the prefix cache."""
        pool = self.cache.pool
        return sum(1 for b in self.cache.owned_blocks() if pool.refcount(b) > 1)

    @property
    def text(self) -> str:
        """The context as text (its tokens decoded)."""
        return self.engine.model.tokenizer.decode(self.seq.tokens)

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat turns filled (and generated) so far."""
        return [dict(m) for m in self._messages]

    @property
    def awaiting_reply(self) -> bool:
        return self._awaiting_reply

    def release(self) -> None:
        """Give the pages back (its full pages go to the prefix cache, if the engine has one); also
        happens when the context is garbage collected."""
        self._release()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- filling -----------------------------------------------------------------------------------

    def fill(self, text: str) -> None:
        """Append ``text`` (tokenized; the tokenizer's BOS is added when the context is empty)."""
        self._fill_checked(self.engine.model.tokenizer.encode(text, add_special_tokens=not self.seq.tokens))

    def fill_tokens(self, ids: Iterable[int]) -> None:
        self._fill_checked(list(ids))

    def fill_system(self, text: str) -> None:
        self._fill_turn("system", text)

    def fill_user(self, text: str) -> None:
        self._fill_turn("user", text)

    def fill_assistant(self, text: str) -> None:
        self._fill_turn("assistant", text)

    def _fill_turn(self, role: Role, text: str) -> None:
        """Append one chat turn, rendered by the model's chat template as the suffix it adds."""
        tokenizer = self.engine.model.tokenizer
        messages = [*self._messages, {"role": role, "content": text}]
        full = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        text_so_far = self.text
        if full.startswith(text_so_far):
            suffix = full[len(text_so_far) :]
        else:  # the context holds text the template would render differently: add the turn's own part
            before = tokenizer.apply_chat_template(self._messages, add_generation_prompt=False) if self._messages else ""
            suffix = full[len(before) :]
        self._fill_checked(tokenizer.encode(suffix, add_special_tokens=False))
        self._messages = messages
        self._awaiting_reply = role != "assistant"

    def _add_generation_prompt(self) -> None:
        if not self._awaiting_reply:
            return
        tokenizer = self.engine.model.tokenizer
        header = tokenizer.apply_chat_template(self._messages, add_generation_prompt=True)[
            len(tokenizer.apply_chat_template(self._messages, add_generation_prompt=False)) :
        ]
        self._fill_checked(tokenizer.encode(header, add_special_tokens=False))
        self._awaiting_reply = False

    def _fill_checked(self, ids: list[int]) -> None:
        ids = self.engine.check_ids(ids)
        self._reply_open = False
        if self.seq.num_tokens + len(ids) > self.engine.max_len:
            raise PromptTooLongError(f"{self.seq.num_tokens} + {len(ids)} tokens exceed the model's context of {self.engine.max_len}")
        self.seq.append(ids)

    def _ensure_pending(self) -> None:
        if not self.seq.tokens:
            raise InputError("the context is empty; fill it before generating or reading a distribution")
        if self.kv_len == self.seq.num_tokens:  # a forward pass fed every token: re-feed the last one
            self.seq.kv.truncate(self.seq.num_tokens - 1)

    # -- running the model -------------------------------------------------------------------------

    def _submit(self, request: ForwardRequest) -> Job:
        if not self._release.alive:
            raise CacheError("this context was released; fork or open a live one")
        if self._adapters:
            request = replace(request, adapters=(*self._adapters, *request.adapters))
        return self.engine.submit(self.seq, request)

    def push_adapter(self, adapter: LoraAdapter, scale: float = 1.0) -> None:
        """Run this context's later forward passes with ``adapter`` (times ``scale``) too, on top of
        those pushed before (and the model's). K/V already computed stay as they were."""
        ((adapter, scale),) = adapter_pairs((adapter, scale))
        check_adapter(adapter, self.engine.model.config)
        self._adapters.append((adapter, scale))

    @property
    def adapters(self) -> tuple[tuple[LoraAdapter, float], ...]:
        """The context's adapter stack, (adapter, scale) in the order pushed."""
        return tuple(self._adapters)

    def pop_adapter(self) -> LoraAdapter:
        """Take the last adapter pushed on this context off its stack and return it."""
        if not self._adapters:
            raise AdapterError("no adapter was pushed on this context; nothing to pop")
        return self._adapters.pop()[0]

    def _run(self, job: Job, then: Callable[[ForwardResult], T]) -> T:
        return then(self.engine.wait(job))

    async def _run_async(self, job: Job, then: Callable[[ForwardResult], T]) -> T:
        return then(await self.engine.wait_async(job))

    def _flush(self) -> Job | None:
        if self.seq.num_tokens - self.kv_len > 1:
            return self._submit(ForwardRequest(end=self.seq.num_tokens - 1))
        return None

    async def flush_async(self) -> None:
        """Feed every pending token but the last (which the next forward pass feeds)."""
        job = self._flush()
        if job is not None:
            await self.engine.wait_async(job)

    def flush(self) -> None:
        job = self._flush()
        if job is not None:
            self.engine.wait(job)

    def _generation(
        self,
        sampler: SamplingConfig | None,
        stop: StopCondition | None,
        *,
        stream: bool = False,
        per_token: bool = False,
        speculative: Speculator | None = None,
    ) -> tuple[Job, Callable[[ForwardResult], GenerationResult]]:
        """Decode until ``stop`` (default: what ``sampler`` says — 256 tokens and the model's EOS ids)
        with ``sampler`` (default greedy), speculatively with ``speculative`` (:mod:`zgen.speculative`).
        Generated tokens stay in the context; the last is pending."""
        sampler = sampler or GREEDY
        stop = stop or StopCondition.from_sampling(sampler, self.engine.model.eos_token_ids)
        self._add_generation_prompt()
        self._ensure_pending()
        prompt = list(self.seq.tokens)
        end = len(prompt)
        job = self._submit(
            ForwardRequest(
                end=end, sample_at=(end - 1,), sampling=sampler, generate=stop, stream=stream, per_token=per_token,
                speculative=speculative,
            )
        )

        def finish(result: ForwardResult) -> GenerationResult:
            if self._messages and self._reply_open:
                self._messages[-1]["content"] += result.text  # the same assistant turn goes on
            elif self._messages:
                self._messages.append({"role": "assistant", "content": result.text})
            self._reply_open = bool(self._messages) and result.finish_reason != "stop"
            return GenerationResult(
                text=result.text,
                token_ids=list(result.tokens),
                prompt_token_ids=prompt,
                logprobs=list(result.logprobs),
                finish_reason=result.finish_reason,
                usage=TokenUsage(len(prompt), len(result.tokens), result.cached_tokens),
                timings=Timings(result.prefill_s, result.decode_s, result.steps),
                speculative=result.speculative,
            )

        return job, finish

    async def generate_result_async(
        self, sampler: SamplingConfig | None = None, stop: StopCondition | None = None, *, speculative: Speculator | None = None
    ) -> GenerationResult:
        return await self._run_async(*self._generation(sampler, stop, speculative=speculative))

    def generate_result(
        self, sampler: SamplingConfig | None = None, stop: StopCondition | None = None, *, speculative: Speculator | None = None
    ) -> GenerationResult:
        return self._run(*self._generation(sampler, stop, speculative=speculative))

    async def generate_async(
        self, sampler: SamplingConfig | None = None, stop: StopCondition | None = None, *, speculative: Speculator | None = None
    ) -> str:
        return (await self.generate_result_async(sampler, stop, speculative=speculative)).text

    def generate(
        self, sampler: SamplingConfig | None = None, stop: StopCondition | None = None, *, speculative: Speculator | None = None
    ) -> str:
        return self.generate_result(sampler, stop, speculative=speculative).text

    def generate_stream(
        self,
        sampler: SamplingConfig | None = None,
        stop: StopCondition | None = None,
        *,
        per_token: bool = False,
        speculative: Speculator | None = None,
    ) -> Iterator[str]:
        """:meth:`generate`, its text yielded in pieces as it is decoded (``per_token``: as each token
        is drawn, or each verification pass with a speculator); the pieces join to what :meth:`generate`
        returns and the context keeps the reply the same way. Closing the iterator early drops the
        unfinished reply (the context is as before)."""
        job, finish = self._generation(sampler, stop, stream=True, per_token=per_token, speculative=speculative)

        def pieces() -> Iterator[str]:
            yield from self.engine.stream(job)
            finish(job.future.result())

        return pieces()

    def _next_distribution(self) -> tuple[Job, Callable[[ForwardResult], Distribution]]:
        self._add_generation_prompt()
        self._ensure_pending()
        last = self.seq.num_tokens - 1
        job = self._submit(ForwardRequest(end=last + 1, logits_at=(last,)))

        def finish(result: ForwardResult) -> Distribution:
            self.seq.kv.truncate(last)  # keep the last token pending, as every call leaves it
            logits = result.logits[last].astype(np.float64)
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            order = np.argsort(-probs, kind="stable")
            return Distribution(order, probs[order])

        return job, finish

    async def decode_step_dist_async(self) -> Distribution:
        """The full distribution of the next token (after every token of the context)."""
        return await self._run_async(*self._next_distribution())

    def decode_step_dist(self) -> Distribution:
        return self._run(*self._next_distribution())

    def forward(self) -> ForwardPass:
        """Build one forward pass over this context (the primitive every call above is made of)."""
        return ForwardPass(self)

    async def generate_with_drafter_async(
        self, drafter: Drafter | Speculator, sampler: SamplingConfig | None = None, stop: StopCondition | None = None
    ) -> GenerationResult:
        """Speculative decoding with ``drafter``: a speculator (``PromptLookup``, ``NgramDrafter``,
        ``DraftModel``), or a host :class:`~zgen.contexts.drafter.Drafter` (asked on the host each pass).

        Same as :meth:`generate_result_async` with ``speculative=drafter``: greedy output (and sampled
        output with deterministic drafts) is exactly what plain ``generate`` gives with the same seed.
        """
        return await self.generate_result_async(sampler, stop, speculative=_speculator(drafter))

    def generate_with_drafter(
        self, drafter: Drafter | Speculator, sampler: SamplingConfig | None = None, stop: StopCondition | None = None
    ) -> GenerationResult:
        return self.generate_result(sampler, stop, speculative=_speculator(drafter))

    def keep_fed(self, n: int) -> None:
        """Keep ``n`` tokens, all fed (a verified prefix); later K/V are rolled back."""
        self.seq.keep(n)

    # -- forking, masking --------------------------------------------------------------------------

    def fork(self, *, seed: int | None = None) -> Context:
        """A context with the same tokens sharing every page (copy-on-write); O(pages) metadata.

        The fork samples with its own seed (``seed`` or a fresh one), so best-of-N branches differ.
        """
        if not self._release.alive:
            raise CacheError("this context was released; it cannot be forked")
        twin = Context._wrap(self.engine, self.engine.fork(self.seq, seed=seed))
        twin._messages, twin._awaiting_reply = [dict(m) for m in self._messages], self._awaiting_reply
        twin._reply_open = self._reply_open
        twin._adapters = list(self._adapters)
        return twin

    def mask_token_range(self, start: int, end: int, masked: bool = True) -> None:
        """Hide tokens ``[start, end)`` from attention (``masked=False`` shows them again).

        Positions are unchanged (see the module docstring). Tokens of dropped pages cannot be shown again.
        """
        if not 0 <= start <= end <= self.seq.num_tokens:
            raise InputError(f"token range [{start}, {end}) is outside the context's {self.seq.num_tokens} tokens")
        if not masked:
            ps = self.cache.store.config.page_size
            table = self.cache.block_table[0]
            dropped = [i for i in range(start // ps, -(-end // ps)) if i * ps < self.kv_len and table[i] < 0]
            if dropped:
                raise CacheError(f"tokens in [{start}, {end}) lie on dropped pages {dropped}; their K/V are gone")
        self.seq.masked[start:end] = masked

    def drop_masked_kv_pages(self) -> int:
        """Free every page whose tokens are all masked (and fed); returns the pages given back."""
        ps = self.cache.store.config.page_size
        table = self.cache.block_table[0]
        droppable = [
            i for i in range(self.kv_len // ps) if table[i] >= 0 and self.seq.masked[i * ps : (i + 1) * ps].all()
        ]
        return self.cache.drop_blocks(droppable) if droppable else 0

    # -- persistence -------------------------------------------------------------------------------

    def _state(self) -> ImportedKVState:
        messages = tuple((m["role"], m["content"]) for m in self._messages)
        return snapshot.capture(self.seq, messages, self._awaiting_reply, tuple(self._adapters))

    def _adopt(self, state: ImportedKVState) -> Context:
        self._messages = [{"role": r, "content": c} for r, c in state.messages]
        self._awaiting_reply = state.awaiting_reply
        self._adapters = list(state.adapters)
        return self

    def save(self, name: str) -> None:
        """Persist tokens, masks, chat turns, K/V pages and the adapter stack (each adapter's directory,
        fingerprint and scale; the model's own pushed adapters are not the context's and are not saved)
        under ``name`` in the store directory (``ZGEN_STORE_DIR``)."""
        snapshot.save_state(self.engine, self._state(), name)

    @classmethod
    def open(
        cls, model_or_engine: Model | Engine, name: str, *, seed: int | None = None, adapters: Sequence[LoraAdapter] = ()
    ) -> Context:
        """A live context from a snapshot ``save`` wrote (in this process or an earlier one), with the
        adapter stack it was saved with: each adapter is the one of ``adapters`` with the same weights
        (fingerprint), else reloaded from the directory it was loaded from. One that is neither (an
        in-memory adapter not passed, a directory gone or holding other weights) is refused with
        :class:`~zgen.errors.SnapshotError` naming it; nothing is changed then."""
        ctx = cls(model_or_engine, seed=seed)
        return ctx._adopt(snapshot.open_into(ctx.engine, name, ctx.seq, adapters))

    def export_kv_pages(self, name: str) -> None:
        """Publish this context's pages under ``name`` in its engine (shared by reference, no copy)."""
        snapshot.export_state(self.engine, self._state(), name)

    @classmethod
    def from_imported_state(cls, engine: Engine, state: ImportedKVState, *, seed: int | None = None) -> Context:
        """A context over pages another context exported (see :func:`~zgen.contexts.import_kv_pages`),
        with the exporter's adapter stack."""
        ctx = cls(engine, seed=seed)
        snapshot.inject(state, ctx.seq)
        return ctx._adopt(state)


class ForwardPass:
    """One forward pass, Pie's token-level primitive::

        out = ctx.forward().input_tokens(ids).sample([len(ids) - 1], Sampler.greedy()).execute()

    The pass feeds the context's pending tokens followed by ``input_tokens`` (indices below count over
    that whole fed list; ``fed_tokens`` shows it) and writes their K/V; the inputs join the context.
    Sampled tokens are returned, not appended.
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._inputs: list[int] = []
        self._sample: list[int] = []
        self._logits: list[int] = []
        self._sampler: SamplingConfig | None = None
        self._mask: np.ndarray | None = None

    @property
    def fed_tokens(self) -> list[int]:
        return self.ctx.pending_ids + self._inputs

    def input_tokens(self, ids: Iterable[int], positions: Iterable[int] | None = None) -> ForwardPass:
        """Tokens to feed after the pending ones. ``positions``, if given, must continue the context
        (token ``i`` is always at position ``i``)."""
        ids = self.ctx.engine.check_ids(list(ids))
        if positions is not None:
            first = self.ctx.num_tokens + len(self._inputs)
            if list(positions) != list(range(first, first + len(ids))):
                raise InputError(f"positions must continue the context from {first} (token i sits at position i)")
        self._inputs += ids
        return self

    def attention_mask(self, mask: np.ndarray | Sequence[Sequence[bool]]) -> ForwardPass:
        """Override causal attention: bool ``[len(fed_tokens), kv_len + len(fed_tokens)]``, row ``i``
        says which tokens fed token ``i`` sees (masked tokens stay hidden regardless)."""
        self._mask = np.asarray(mask, bool)
        return self

    def sample(self, indices: Iterable[int], sampler: SamplingConfig) -> ForwardPass:
        self._sample += list(indices)
        self._sampler = sampler
        return self

    def output_logits(self, indices: Iterable[int]) -> ForwardPass:
        self._logits += list(indices)
        return self

    def _submit(self) -> tuple[Job, Callable[[ForwardResult], ForwardOutput]]:
        ctx = self.ctx
        start = ctx.kv_len
        n = len(self.fed_tokens)
        if n == 0:
            raise InputError("this forward pass feeds no tokens; add input_tokens or fill the context")
        for i in (*self._sample, *self._logits):
            if not 0 <= i < n:
                raise InputError(f"index {i} is outside the {n} tokens this pass feeds")
        before = ctx.num_tokens
        ctx._fill_checked(self._inputs)
        request = ForwardRequest(
            end=start + n,
            sample_at=tuple(sorted({start + i for i in self._sample})),
            logits_at=tuple(sorted({start + i for i in self._logits})),
            sampling=self._sampler or GREEDY,
            attention_mask=self._mask,
        )
        try:
            job = ctx._submit(request)
        except BaseException:
            ctx.seq.keep(before)
            raise
        job.future.add_done_callback(lambda f: ctx.seq.keep(before) if f.exception() is not None else None)

        def finish(result: ForwardResult) -> ForwardOutput:
            return ForwardOutput(result.tokens, result.logprobs, {p - start: v for p, v in result.logits.items()})

        return job, finish

    async def execute_async(self) -> ForwardOutput:
        return await self.ctx._run_async(*self._submit())

    def execute(self) -> ForwardOutput:
        return self.ctx._run(*self._submit())


def _speculator(drafter: Drafter | Speculator) -> Speculator:
    """A speculator as it is; a host drafter (``update``/``draft``) asked from the device loop."""
    return drafter if isinstance(drafter, Speculator) else HostDrafter(drafter)


def _require_pages(engine: Engine) -> None:
    if not engine.kv.pages:
        raise ConfigError(
            f"contexts need a paged KV cache (paged or tiered) to fork and mask pages; this engine uses the "
            f"{engine.kv.kind} cache: build it with paged_kv(...) or tiered_kv(...)"
        )


__all__ = ["Context", "Distribution", "ForwardOutput", "ForwardPass", "default_engine", "gather"]
