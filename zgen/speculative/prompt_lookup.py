"""Prompt lookup: draft what followed the last n-gram the last time it occurred, on the device."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from zgen.errors import ConfigError
from zgen.model import Model
from zgen.runtime.speculation import MAX_DRAFT_TOKENS, DraftInput, Proposal
from zgen.speculative.tree import MAX_TREE_SIZE


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

    ``branches > 1``: propose what followed each of the ``branches`` best matches (longest, then latest)
    as one token tree, the continuations merged where they agree, verified in one pass
    (:mod:`zgen.runtime.tree`): a paraphrase that leaves the latest match still finds a quote that goes
    on elsewhere. Trees are refused on the coded KV formats, and rows under a grammar decode plainly.

    ``adaptive`` (the default): a row decodes plainly while its passes yield no more tokens than plain
    steps would in the time they take (the engine times both; :mod:`zgen.runtime.speculation`), probing
    again later. With ``adaptive=False`` every step is a pass, which costs more than a plain step where
    matches are rare (0.74x of plain decoding at batch 8 on an H200, real SmolLM2, mixed prompts).
    """

    def __init__(
        self, max_ngram: int = 3, num_tokens: int = 8, *, min_ngram: int = 1, branches: int = 1, adaptive: bool = True
    ) -> None:
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PromptLookup {name} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ConfigError(f"PromptLookup needs min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._num_tokens = check_num_tokens("PromptLookup", num_tokens)
        most = MAX_TREE_SIZE // self._num_tokens
        if isinstance(branches, bool) or not isinstance(branches, int) or not 1 <= branches <= most:
            raise ConfigError(
                f"PromptLookup branches must be an integer in [1, {most}] (at most {MAX_TREE_SIZE} tree nodes of "
                f"{self._num_tokens} tokens per branch), got {branches!r}"
            )
        self.branches = branches
        if not isinstance(adaptive, bool):
            raise ConfigError(f"PromptLookup adaptive must be a bool, got {adaptive!r}")
        self._adaptive = adaptive

    def __repr__(self) -> str:
        branches = "" if self.branches == 1 else f", branches={self.branches}"
        adaptive = "" if self._adaptive else ", adaptive=False"
        return f"PromptLookup(max_ngram={self.max_ngram}, num_tokens={self._num_tokens}, min_ngram={self.min_ngram}{branches}{adaptive})"

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def tree_size(self) -> int | None:
        """Nodes of each proposed tree (``None``: chains)."""
        return None if self.branches == 1 else self.branches * self._num_tokens

    @property
    def adaptive(self) -> bool:
        return self._adaptive

    def cache_key(self) -> Hashable:
        return ("prompt-lookup", self.max_ngram, self.min_ngram, self._num_tokens, self.branches, self._adaptive)

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
        # For each position c, the longest n whose earlier occurrence of the last n tokens ends right
        # before c (0: none): what follows it, from c on, is a candidate continuation.
        longest = jnp.zeros((b, width), jnp.int32)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            # An earlier occurrence at s: history[s : s + n] equals the last n tokens, s + n < length.
            match = (starts + n < length[:, None]) & (length[:, None] >= n + 1)
            for j in range(n):
                tail = jnp.take_along_axis(history, jnp.clip(length - n + j, 0, width - 1)[:, None], axis=1)
                shifted = jnp.concatenate([history[:, j:], jnp.full((b, j), -1, history.dtype)], axis=1)
                match &= shifted == tail
            follows = jnp.concatenate([jnp.zeros((b, n), bool), match[:, : width - n]], axis=1)
            longest = jnp.where((longest == 0) & follows, n, longest)
        # The best continuations: longest match first, then latest.
        score, found = jax.lax.top_k(jnp.where(longest > 0, longest * width + starts, -1), self.branches)
        found = found.astype(jnp.int32)
        # The tokens after each match, up to the pending one; a match that overlaps the tail (a loop)
        # continues with the period it shows: ``length - found`` tokens repeat.
        period = jnp.maximum(length[:, None] - found, 1)
        index = jnp.clip(found[:, :, None] + jnp.arange(k)[None, None, :] % period[:, :, None], 0, width - 1)
        tokens = jnp.take_along_axis(history, index.reshape(b, -1), axis=1).reshape(b, self.branches, k).astype(jnp.int32)
        if self.branches == 1:
            count = jnp.where(draft.active & (score[:, 0] >= 0), jnp.minimum(draft.num_tokens, k), 0)
            return Proposal(tokens[:, 0], count.astype(jnp.int32), None), state
        return _merged_tree(tokens, jnp.sum(score >= 0, axis=1), draft.active), state


def _merged_tree(tokens: Int[Array, "B R K"], branches: Int[Array, " B"], active: Bool[Array, " B"]) -> Proposal:
    """The first ``branches`` continuations of each row as one tree: node ``(r, i)`` (index ``r * K + i``,
    depth ``i + 1``) hangs below the first branch that agrees with branch ``r`` on tokens ``0 .. i - 1``,
    so continuations share their common prefix. A node equal to an earlier branch's stays in the tree
    but is never reached: acceptance follows the first child equal to the target's token."""
    b, r, k = tokens.shape
    agree = jnp.cumprod(tokens[:, :, None, :] == tokens[:, None, :, :], axis=-1).astype(bool)  # [B, R, R', K]: prefixes up to i equal
    first = jnp.argmax(agree, axis=2).astype(jnp.int32)  # [B, R, K]: the first branch agreeing up to token i
    depth = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None, None, :], (b, r, k))
    parents = jnp.concatenate([jnp.full((b, r, 1), -1, jnp.int32), first[:, :, :-1] * k + depth[:, :, :-1]], axis=2)
    count = jnp.where(active, branches * k, 0).astype(jnp.int32)
    return Proposal(tokens.reshape(b, r * k), count, None, parents=parents.reshape(b, r * k), depth=(depth + 1).reshape(b, r * k))
