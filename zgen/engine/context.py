"""Contexts: Pie's programmable unit of inference — fill, flush, fork, save, mask, drive token by token.

A :class:`Context` holds a token sequence and the KV pages (from its engine's shared pool) of all but
its last token: the last token is *pending*, fed by the next forward pass, whose logits then give the
next-token distribution. ``fill*`` appends pending tokens, ``flush`` feeds all but the last,
``generate`` decodes. Every long call has an ``*_async`` twin; run several contexts' async calls
concurrently (``asyncio.gather`` or :meth:`Engine.gather`) and their forward passes share batches.

Positions: token ``i`` is at position ``i`` for good — masking (``mask_token_range``) hides tokens from
attention without renumbering, and dropping masked pages frees their memory while later tokens keep
counting up (as StreamingLLM without position shifting). A context therefore holds at most the
model's context length of positions, however few pages it keeps.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from zgen.engine import stop as stops
from zgen.engine.drafter import Drafter
from zgen.engine.engine import ForwardRequest, ForwardResult, check_request
from zgen.engine.sampler import Sampler
from zgen.errors import CacheError, InputError, PromptTooLongError, TokenIdError

if TYPE_CHECKING:
    from zgen.cache.paged import PagedKVCache
    from zgen.engine.engine import Engine
    from zgen.engine.snapshot import ImportedKVState
    from zgen.model import Model

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class GenerateResult:
    """What ``generate`` produced: ``token_ids`` include a matched stop sequence, ``text`` does not."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


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
    """A token sequence with its KV pages in an engine's pool. Create with ``engine.create_context()``
    or ``model.create_context()``."""

    def __init__(self, engine: Engine, *, seed: int | None = None, cache: PagedKVCache | None = None) -> None:
        self.engine = engine
        self.cache = cache or engine.new_cache()
        self.seed = engine.next_seed() if seed is None else int(seed)
        self._ids: list[int] = []
        self._masked = np.zeros(0, bool)
        self._messages: list[dict[str, str]] = []
        self._awaiting_reply = False  # a chat turn was filled; generate adds the assistant header
        self._release = weakref.finalize(self, self.cache.release)

    # -- state -------------------------------------------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        """Every token of the context (the KV cache holds all but the pending ones)."""
        return list(self._ids)

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are in the pages."""
        return self.cache.seq_len

    @property
    def pending_ids(self) -> list[int]:
        return self._ids[self.kv_len :]

    @property
    def masked_positions(self) -> np.ndarray:
        return np.flatnonzero(self._masked)

    @property
    def pages_used(self) -> int:
        """Pages this context holds (shared ones included)."""
        return len(self.cache.owned_blocks())

    @property
    def pages_shared(self) -> int:
        """Pages this context shares with other contexts, exports or snapshots (copy-on-write)."""
        pool = self.engine.pool
        return sum(1 for b in self.cache.owned_blocks() if pool.refcount(b) > 1)

    @property
    def masked_flags(self) -> np.ndarray:
        """A copy of the per-token mask (``True`` = hidden from attention)."""
        return self._masked.copy()

    @property
    def text(self) -> str:
        """The context as text (its tokens decoded)."""
        return self.engine.model.tokenizer.decode(self._ids)

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat turns filled (and generated) so far."""
        return [dict(m) for m in self._messages]

    @property
    def awaiting_reply(self) -> bool:
        return self._awaiting_reply

    def tokens_between(self, start: int, end: int) -> list[int]:
        return self._ids[start:end]

    def append_sampled(self, token: int) -> None:
        """Append a token the engine sampled for this context (as pending)."""
        self._append([token])

    def release(self) -> None:
        """Give the pages back to the pool now (also happens when the context is garbage collected)."""
        self._release()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- filling -----------------------------------------------------------------------------------

    def fill(self, text: str) -> None:
        """Append ``text`` (tokenized; the tokenizer's BOS is added when the context is empty)."""
        ids = self.engine.model.tokenizer.encode(text, add_special_tokens=not self._ids)
        self._fill_checked(ids)

    def fill_tokens(self, ids: Iterable[int]) -> None:
        ids = [int(i) for i in ids]
        self._fill_checked(ids)

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

    def checked_ids(self, ids: list[int]) -> list[int]:
        vocab = self.engine.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise TokenIdError(f"token ids {bad[:5]} are outside [0, {vocab}) for this model's vocabulary")
        return ids

    def _fill_checked(self, ids: list[int]) -> None:
        self.checked_ids(ids)
        if len(self._ids) + len(ids) > self.engine.max_len:
            raise PromptTooLongError(
                f"{len(self._ids)} + {len(ids)} tokens exceed the model's context of {self.engine.max_len}"
            )
        self._append(ids)

    def _append(self, ids: Sequence[int]) -> None:
        self._ids.extend(ids)
        self._masked = np.concatenate([self._masked, np.zeros(len(ids), bool)])

    def _truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens; K/V past ``n - 1`` are rolled back so the last token is pending."""
        self._ids = self._ids[:n]
        self._masked = self._masked[:n]
        if self.kv_len > max(n - 1, 0):
            self.cache.truncate(max(n - 1, 0))

    def _ensure_pending(self) -> None:
        if not self._ids:
            raise InputError("the context is empty; fill it before generating or reading a distribution")
        if self.kv_len == len(self._ids):  # a forward pass fed every token: re-feed the last one
            self.cache.truncate(len(self._ids) - 1)

    # -- running the model -------------------------------------------------------------------------

    async def submit(self, request: ForwardRequest) -> ForwardResult:
        if not self._release.alive:
            raise CacheError("this context was released; fork or open a live one")
        check_request(self, request)
        return await self.engine.submit(self, request)

    async def flush_async(self) -> None:
        """Feed every pending token but the last (which the next forward pass feeds)."""
        if len(self._ids) - self.kv_len > 1:
            await self.submit(ForwardRequest(end=len(self._ids) - 1))

    def flush(self) -> None:
        self.engine.run(self.flush_async())

    async def generate_result_async(
        self, sampler: Sampler | None = None, stop: stops.StopCondition | None = None
    ) -> GenerateResult:
        """Decode until ``stop`` (default: the model's EOS ids or 256 tokens) with ``sampler``
        (default greedy). Generated tokens stay in the context; the last is pending."""
        sampler = sampler or Sampler.greedy()
        stop = stop or (stops.max_len(256) | stops.ends_with_any(self.engine.model.eos_token_ids))
        self._add_generation_prompt()
        self._ensure_pending()
        start = len(self._ids)
        # Multi-token stop sequences are checked on the host: come back every steps_per_sync tokens.
        host_checked = any(len(s) > 1 for s in stop.sequences)
        tokens: list[int] = []
        logprobs: list[float] = []
        while True:
            budget = (stop.max_tokens or self.engine.max_len) - len(tokens)
            budget = min(budget, self.engine.max_len - len(self._ids) + 1)
            if host_checked:
                budget = min(budget, self.engine.config.steps_per_sync)
            if budget < 1:
                break
            last = len(self._ids) - 1
            out = await self.submit(ForwardRequest(
                end=len(self._ids), sample_at=(last,), sampler=sampler,
                continue_steps=budget - 1, stop_token_ids=stop.device_token_ids,
            ))
            tokens += out.tokens
            logprobs += out.logprobs
            if stop.first_stop(tokens) is not None or len(self._ids) >= self.engine.max_len:
                break
        found = stop.first_stop(tokens)
        end, matched = found if found is not None else (len(tokens), 0)
        if end < len(tokens):
            self._truncate(start + end)  # tokens decoded past the stop are rolled back exactly
        kept = tokens[:end]
        text_ids = kept[: end - matched]
        text = self.engine.model.tokenizer.decode(text_ids)
        if self._messages:
            self._messages.append({"role": "assistant", "content": self.engine.model.tokenizer.decode(text_ids, skip_special_tokens=True)})
        return GenerateResult(text, kept, logprobs[:end], "stop" if matched else "length")

    async def generate_async(self, sampler: Sampler | None = None, stop: stops.StopCondition | None = None) -> str:
        return (await self.generate_result_async(sampler, stop)).text

    def generate(self, sampler: Sampler | None = None, stop: stops.StopCondition | None = None) -> str:
        return self.engine.run(self.generate_async(sampler, stop))

    def generate_result(self, sampler: Sampler | None = None, stop: stops.StopCondition | None = None) -> GenerateResult:
        return self.engine.run(self.generate_result_async(sampler, stop))

    async def decode_step_dist_async(self) -> Distribution:
        """The full distribution of the next token (after every token of the context)."""
        self._add_generation_prompt()
        self._ensure_pending()
        last = len(self._ids) - 1
        out = await self.submit(ForwardRequest(end=len(self._ids), logits_at=(last,)))
        self.cache.truncate(last)  # keep the last token pending, as every call leaves it
        logits = out.logits[last].astype(np.float64)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        return Distribution(order, probs[order])

    def decode_step_dist(self) -> Distribution:
        return self.engine.run(self.decode_step_dist_async())

    def forward(self) -> ForwardPass:
        """Build one forward pass over this context (the primitive every call above is made of)."""
        return ForwardPass(self)

    async def generate_with_drafter_async(
        self, drafter: Drafter, sampler: Sampler | None = None, stop: stops.StopCondition | None = None
    ) -> GenerateResult:
        """Speculative decoding: each step verifies the drafter's proposal in one forward pass.

        Produces exactly what :meth:`generate_result_async` produces with the same sampler and seed.
        """
        sampler = sampler or Sampler.greedy()
        stop = stop or (stops.max_len(256) | stops.ends_with_any(self.engine.model.eos_token_ids))
        self._add_generation_prompt()
        self._ensure_pending()
        start = len(self._ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        while stop.first_stop(tokens) is None and len(self._ids) < self.engine.max_len:
            drafter.update(self._ids)
            draft, positions = drafter.draft()
            if positions != list(range(len(self._ids), len(self._ids) + len(draft))):
                raise InputError(f"drafts must be a chain at positions {len(self._ids)}..., got {positions}")
            room = min((stop.max_tokens or self.engine.max_len) - len(tokens), self.engine.max_len - len(self._ids)) - 1
            draft = draft[: max(room, 0)]
            base = len(self._ids)  # the first draft token's position
            pending = len(self._ids) - self.kv_len
            out = await (
                self.forward().input_tokens(draft).sample(range(pending - 1, pending + len(draft)), sampler).execute_async()
            )
            accepted = 0
            while accepted < len(draft) and draft[accepted] == out.tokens[accepted]:
                accepted += 1
            self.keep_fed(base + accepted)
            new = draft[:accepted] + [out.tokens[accepted]]
            self.append_sampled(out.tokens[accepted])
            tokens += new
            logprobs += out.logprobs[: accepted + 1]
        found = stop.first_stop(tokens)
        end, matched = found if found is not None else (len(tokens), 0)
        if end < len(tokens):
            self._truncate(start + end)
        kept = tokens[:end]
        text = self.engine.model.tokenizer.decode(kept[: end - matched])
        return GenerateResult(text, kept, logprobs[:end], "stop" if matched else "length")

    def generate_with_drafter(
        self, drafter: Drafter, sampler: Sampler | None = None, stop: stops.StopCondition | None = None
    ) -> GenerateResult:
        return self.engine.run(self.generate_with_drafter_async(drafter, sampler, stop))

    def keep_fed(self, n: int) -> None:
        """Keep ``n`` tokens, all fed (a verified prefix); later K/V are rolled back."""
        self._ids = self._ids[:n]
        self._masked = self._masked[:n]
        if self.kv_len > n:
            self.cache.truncate(n)

    # -- forking, masking --------------------------------------------------------------------------

    def fork(self, *, seed: int | None = None) -> Context:
        """A context with the same tokens sharing every page (copy-on-write); O(pages) metadata.

        The fork samples with its own seed (``seed`` or a fresh one), so best-of-N branches differ.
        """
        if not self._release.alive:
            raise CacheError("this context was released; it cannot be forked")
        twin = Context(self.engine, seed=seed, cache=self.cache.fork())
        twin._ids, twin._masked = list(self._ids), self._masked.copy()
        twin._messages, twin._awaiting_reply = [dict(m) for m in self._messages], self._awaiting_reply
        return twin

    def mask_token_range(self, start: int, end: int, masked: bool = True) -> None:
        """Hide tokens ``[start, end)`` from attention (``masked=False`` shows them again).

        Positions are unchanged (see the module docstring). Tokens of dropped pages cannot be shown again.
        """
        if not 0 <= start <= end <= len(self._ids):
            raise InputError(f"token range [{start}, {end}) is outside the context's {len(self._ids)} tokens")
        if not masked:
            ps = self.engine.store.config.page_size
            table = self.cache.block_table[0]
            dropped = [i for i in range(start // ps, -(-end // ps)) if i * ps < self.kv_len and table[i] < 0]
            if dropped:
                raise CacheError(f"tokens in [{start}, {end}) lie on dropped pages {dropped}; their K/V are gone")
        self._masked[start:end] = masked

    def drop_masked_kv_pages(self) -> int:
        """Free every page whose tokens are all masked (and fed); returns the pages given back."""
        ps = self.engine.store.config.page_size
        full_pages = self.kv_len // ps
        table = self.cache.block_table[0]
        droppable = [
            i for i in range(full_pages) if table[i] >= 0 and self._masked[i * ps : (i + 1) * ps].all()
        ]
        return self.cache.drop_blocks(droppable) if droppable else 0

    # -- persistence -------------------------------------------------------------------------------

    def save(self, name: str) -> None:
        """Persist tokens, masks and K/V pages under ``name`` in the store directory (``ZGEN_STORE_DIR``)."""
        from zgen.engine.snapshot import save_context

        save_context(self, name)

    @classmethod
    def open(cls, model_or_engine: Model | Engine, name: str, *, seed: int | None = None) -> Context:
        """A live context from a snapshot ``save`` wrote (in this process or an earlier one)."""
        from zgen.engine.snapshot import open_context

        return open_context(_engine_of(model_or_engine), name, seed=seed)

    def export_kv_pages(self, name: str) -> None:
        """Publish this context's pages under ``name`` in its engine (shared by reference, no copy)."""
        from zgen.engine.snapshot import export_pages

        export_pages(self, name)

    @classmethod
    def from_imported_state(cls, engine: Engine, state: ImportedKVState, *, seed: int | None = None) -> Context:
        """A context over pages another context exported (see ``Engine.import_kv_pages``)."""
        from zgen.engine.snapshot import context_from_import

        return context_from_import(engine, state, seed=seed)

    def restore(
        self, ids: Sequence[int], masked: np.ndarray, messages: Sequence[tuple[str, str]], awaiting_reply: bool
    ) -> None:
        """Set the token bookkeeping of a context whose pages were just injected (snapshots, imports)."""
        self._ids, self._masked = list(ids), np.asarray(masked, bool).copy()
        self._messages = [{"role": r, "content": c} for r, c in messages]
        self._awaiting_reply = awaiting_reply


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
        self._sampler: Sampler | None = None
        self._mask: np.ndarray | None = None

    @property
    def fed_tokens(self) -> list[int]:
        return self.ctx.pending_ids + self._inputs

    def input_tokens(self, ids: Iterable[int], positions: Iterable[int] | None = None) -> ForwardPass:
        """Tokens to feed after the pending ones. ``positions``, if given, must continue the context
        (token ``i`` is always at position ``i``)."""
        ids = [int(i) for i in ids]
        if positions is not None:
            first = self.ctx.num_tokens + len(self._inputs)
            if list(positions) != list(range(first, first + len(ids))):
                raise InputError(f"positions must continue the context from {first} (token i sits at position i)")
        self._inputs += self.ctx.checked_ids(ids)
        return self

    def attention_mask(self, mask: np.ndarray | Sequence[Sequence[bool]]) -> ForwardPass:
        """Override causal attention: bool ``[len(fed_tokens), kv_len + len(fed_tokens)]``, row ``i``
        says which tokens fed token ``i`` sees (masked tokens stay hidden regardless)."""
        self._mask = np.asarray(mask, bool)
        return self

    def sample(self, indices: Iterable[int], sampler: Sampler) -> ForwardPass:
        self._sample += list(indices)
        self._sampler = sampler
        return self

    def output_logits(self, indices: Iterable[int]) -> ForwardPass:
        self._logits += list(indices)
        return self

    async def execute_async(self) -> ForwardOutput:
        ctx = self.ctx
        start = ctx.kv_len
        n = len(self.fed_tokens)
        for i in (*self._sample, *self._logits):
            if not 0 <= i < n:
                raise InputError(f"index {i} is outside the {n} tokens this pass feeds")
        if n == 0:
            raise InputError("this forward pass feeds no tokens; add input_tokens or fill the context")
        before = ctx.num_tokens
        ctx.fill_tokens(self._inputs)
        request = ForwardRequest(
            end=start + n,
            sample_at=tuple(sorted({start + i for i in self._sample})),
            logits_at=tuple(sorted({start + i for i in self._logits})),
            sampler=self._sampler,
            attention_mask=self._mask,
        )
        try:
            out = await ctx.submit(request)
        except BaseException:
            ctx.keep_fed(before)
            raise
        return ForwardOutput(out.tokens, out.logprobs, {p - start: v for p, v in out.logits.items()})

    def execute(self) -> ForwardOutput:
        return self.ctx.engine.run(self.execute_async())


def _engine_of(model_or_engine: Model | Engine) -> Engine:
    from zgen.engine.engine import Engine

    if isinstance(model_or_engine, Engine):
        return model_or_engine
    return model_or_engine.engine


__all__ = ["Context", "Distribution", "ForwardOutput", "ForwardPass", "GenerateResult"]
