"""Prompt lookup: draft what followed the last n-gram the last time it occurred, on the device."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Int

from zgen.errors import ConfigError
from zgen.model import Model
from zgen.runtime.speculation import MAX_DRAFT_TOKENS, DraftInput, Proposal


def check_num_tokens(owner: str, num_tokens: object) -> int:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"{owner} num_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {num_tokens!r}")
    return num_tokens


class PromptLookup:
    """Prompt-lookup decoding: find the most recent earlier occurrence of the last ``max_ngram`` tokens
    (then ``max_ngram - 1`` ... down to ``min_ngram``: the longest match wins, the latest of its length)
    in the prompt and the generated text, and propose the ``num_tokens`` tokens that followed it (where
    they run into the tail, the text is taken to repeat with the period the match shows, as a loop
    does). Deterministic drafts: the output is exactly plain decoding's, greedy or sampled. Pays on text
    that repeats its context (summaries, code edits, quotes).
    """

    def __init__(self, max_ngram: int = 3, num_tokens: int = 8, *, min_ngram: int = 1) -> None:
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PromptLookup {name} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ConfigError(f"PromptLookup needs min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._num_tokens = check_num_tokens("PromptLookup", num_tokens)

    def __repr__(self) -> str:
        return f"PromptLookup(max_ngram={self.max_ngram}, num_tokens={self._num_tokens}, min_ngram={self.min_ngram})"

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def adaptive(self) -> bool:
        return False  # a miss drafts nothing and costs a plain step

    def cache_key(self) -> Hashable:
        return ("prompt-lookup", self.max_ngram, self.min_ngram, self._num_tokens)

    def check_target(self, model: Model) -> None:
        del model  # drafts are the context's own tokens: any model

    def device_params(self) -> Any:
        return ()

    def start(self, params: Any, history: Int[Array, "B L"], length: Int[Array, " B"]) -> Any:
        del params, history, length
        return ()

    def advance(self, state: Any, kept: Int[Array, " B"]) -> Any:
        del kept
        return state

    def propose(self, params: Any, state: Any, draft: DraftInput) -> tuple[Proposal, Any]:
        del params
        history, length = draft.history, draft.length
        b, width = history.shape
        k = self._num_tokens
        starts = jnp.arange(width)[None, :]
        found = jnp.full((b,), -1, jnp.int32)  # where the continuation starts (-1: no match yet)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            # An earlier occurrence at s: history[s : s + n] equals the last n tokens, s + n < length.
            match = (starts + n < length[:, None]) & (length[:, None] >= n + 1)
            for j in range(n):
                tail = jnp.take_along_axis(history, jnp.clip(length - n + j, 0, width - 1)[:, None], axis=1)
                shifted = jnp.concatenate([history[:, j:], jnp.full((b, j), -1, history.dtype)], axis=1)
                match &= shifted == tail
            latest = jnp.max(jnp.where(match, starts, -1), axis=1)
            found = jnp.where((found < 0) & (latest >= 0), latest + n, found)
        # The tokens after the match, up to the pending one; a match that overlaps the tail (a loop)
        # continues with the period it shows: ``length - found`` tokens repeat.
        period = jnp.maximum(length - found, 1)
        count = jnp.where(draft.active & (found >= 0), jnp.minimum(draft.num_tokens, k), 0)
        index = jnp.clip(found[:, None] + jnp.arange(k)[None, :] % period[:, None], 0, width - 1)
        tokens = jnp.take_along_axis(history, index, axis=1)
        return Proposal(tokens.astype(jnp.int32), count.astype(jnp.int32), None), state
