"""Jacobi (lookahead) decoding: the target model drafts for itself, no draft model.

Jacobi decoding (Santilli et al. 2023) guesses a window of future tokens and refines every guess in
parallel with one forward pass of the target: the token the target predicts after guess ``j`` is the
new guess for position ``j + 1``, and once the window reaches the fixed point it is exactly what
greedy decoding gives. Lookahead decoding (Fu et al. 2024) keeps the n-grams these iterations produce
in a pool and drafts from it, since the right tokens often show up at the wrong positions first.

Here the verification pass of the speculative loop is the Jacobi iteration: it already computes the
target's own token after every drafted one (:class:`~zgen.runtime.speculation.Observer`). Per row the
speculator keeps

* the **window**: those draws from the last pass; where the draft was rejected, the draws past the
  rejection are the guesses for the positions after the new pending token (the Jacobi step);
* the **pool**: n-grams (``ngram - 1`` tokens of context, then the token that followed), seeded with
  the context's last tokens and fed by every pass — the verified continuation, and the draws the
  target made after guessed tokens (the Jacobi trajectory: the right tokens at the wrong positions).

A draft is built token by token: the pool's continuation of the tokens so far (of the n-grams that
share the longest tail with them, the one seen last), else the window's guess for that position, else
the last token again (a filler the next pass refines). Drafts are deterministic (``Proposal.probs is
None``): a draft is accepted iff it equals the target's own draw, so the output is exactly plain
decoding's, greedy or sampled. Sampled rows learn from the sampled draws, which use the same noise
(row key, position) the next pass draws with: a converged window is accepted under sampling too.

On SmolLM2-135M (float32, greedy, 64 new tokens; a chat answer, code, a summary) 8-token drafts
accept 16, 24 and 24 tokens, where prompt lookup accepts 3, 10 and 13 — as does this pool fed with
the verified text alone: the n-grams of guessed tokens make the difference. Drafting from the bare
window first (pure Jacobi iteration) accepts 2, 4 and 6, so the window is only the fallback.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from zgen.errors import ConfigError
from zgen.model import Model
from zgen.runtime.speculation import DraftInput, Proposal
from zgen.speculative.prompt_lookup import check_num_tokens


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class JacobiState:
    """Per row: the Jacobi window and the n-gram pool (carried through the loop's passes)."""

    guesses: Int[Array, "B W"]  # the target's draws for positions guess_from .. guess_from + W - 1 (-1: none)
    guess_from: Int[Array, " B"]
    pool: Int[Array, "B P N"]  # n-grams: N - 1 tokens of context, then the token that followed (-1: none)
    stamp: Int[Array, "B P"]  # when each n-gram was last seen (-1: an empty slot)
    clock: Int[Array, ""]


class Jacobi:
    """Jacobi (lookahead) decoding: up to ``num_tokens`` tokens drafted a pass from the target's own
    earlier predictions (see the module docstring); a pool of ``pool_size`` n-grams of ``ngram``
    tokens (``ngram - 1`` of context, then the token that followed) per row.

    Every pass verifies ``num_tokens`` guesses, which costs little more than one token where decoding
    is bound by memory bandwidth (small batches on a GPU), and several where it is bound by compute
    (large batches, the CPU). ``adaptive`` (the default) takes the fallback of
    :mod:`zgen.runtime.speculation`: a row decodes plainly while its passes yield no more tokens than
    plain steps would in the time they take (the engine times both), probing again later; with
    ``adaptive=False`` every step is a pass.
    """

    def __init__(self, num_tokens: int = 8, *, ngram: int = 4, pool_size: int = 256, adaptive: bool = True) -> None:
        self._num_tokens = check_num_tokens("Jacobi", num_tokens)
        if isinstance(ngram, bool) or not isinstance(ngram, int) or not 2 <= ngram <= 8:
            raise ConfigError(f"Jacobi ngram must be an integer in [2, 8] (context tokens + 1), got {ngram!r}")
        least = 2 * (num_tokens + 1)
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < least:
            raise ConfigError(f"Jacobi pool_size must be an integer >= {least} (twice the n-grams one pass adds), got {pool_size!r}")
        if not isinstance(adaptive, bool):
            raise ConfigError(f"Jacobi adaptive must be a bool, got {adaptive!r}")
        self.ngram, self.pool_size = ngram, pool_size
        self._adaptive = adaptive

    def __repr__(self) -> str:
        return f"Jacobi(num_tokens={self._num_tokens}, ngram={self.ngram}, pool_size={self.pool_size}, adaptive={self._adaptive})"

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def adaptive(self) -> bool:
        return self._adaptive

    def cache_key(self) -> Hashable:
        return ("jacobi", self._num_tokens, self.ngram, self.pool_size, self._adaptive)

    def check_target(self, model: Model) -> None:
        del model  # drafts are the target's own tokens: any model

    def device_params(self) -> Any:
        return ()

    def start(self, params: Any, history: Int[Array, "B L"], length: Int[Array, " B"]) -> JacobiState:
        """The pool holds the n-grams ending at the context's last ``pool_size`` tokens; no guesses yet."""
        del params
        b = history.shape[0]
        size = self.pool_size
        at = length[:, None] - size + jnp.arange(size)[None, :]  # where each n-gram's last token is
        valid = at >= 1
        pool = jnp.stack([_tokens_at(history, at - back) for back in range(self.ngram - 1, -1, -1)], axis=-1)
        pool = jnp.where(valid[..., None], pool, -1)
        stamp = jnp.where(valid, jnp.arange(size)[None, :], -1).astype(jnp.int32)
        guesses = jnp.full((b, self._num_tokens + 1), -1, jnp.int32)
        return JacobiState(guesses, jnp.zeros(b, jnp.int32), pool, stamp, jnp.asarray(size, jnp.int32))

    def advance(self, state: JacobiState, kept: Int[Array, " B"]) -> JacobiState:
        del kept  # guesses are kept by position: those before the next pending token are never read
        return state

    def propose(self, params: Any, state: JacobiState, draft: DraftInput) -> tuple[Proposal, JacobiState]:
        del params
        p = draft.length - 1
        context = _tokens_at(draft.history, p[:, None] + jnp.arange(2 - self.ngram, 1)[None, :])  # [B, N - 1], ends at pending
        window = state.guesses.shape[1]

        def next_token(context: Array, i: Array) -> tuple[Array, Array]:
            found, hit = _continue(state.pool, state.stamp, context)
            at = p + i - state.guess_from
            guess = jnp.take_along_axis(state.guesses, jnp.clip(at, 0, window - 1)[:, None], axis=1)[:, 0]
            has_guess = (at >= 0) & (at < window) & (guess >= 0)
            token = jnp.where(hit, found, jnp.where(has_guess, guess, context[:, -1]))
            return jnp.concatenate([context[:, 1:], token[:, None]], axis=1), token

        # Unrolled: k small steps, no inner device loop to launch and test per drafted token.
        _, tokens = jax.lax.scan(next_token, context, jnp.arange(1, self._num_tokens + 1, dtype=jnp.int32), unroll=True)
        count = jnp.where(draft.active, draft.num_tokens, 0).astype(jnp.int32)
        return Proposal(tokens.T.astype(jnp.int32), count, None), state

    def observe(
        self, state: JacobiState, draft: DraftInput, proposal: Proposal, count: Int[Array, " B"], draws: Int[Array, "B T"]
    ) -> JacobiState:
        """The draws become the window, and ``(tokens fed up to j) -> draw j`` joins the pool for every
        checked position ``j`` (the verified prefix's n-grams and the guessed ones' alike)."""
        t = draws.shape[1]
        p = draft.length - 1
        context = _tokens_at(draft.history, p[:, None] + jnp.arange(2 - self.ngram, 1)[None, :])
        fed = jnp.concatenate([context, proposal.tokens], axis=1)  # [B, N - 2 + T]: fed[N - 2 + j] is at p + j
        grams = jnp.stack([fed[:, c : c + t] for c in range(self.ngram - 1)] + [draws], axis=-1)  # [B, T, N]
        checked = draft.active[:, None] & (jnp.arange(t)[None, :] <= count[:, None])
        pool, stamp = _insert(state.pool, state.stamp, grams, checked, state.clock)
        # A plain step (no draft, one draw) leaves the rest of the window without guesses.
        window = jnp.full_like(state.guesses, -1).at[:, :t].set(jnp.where(checked, draws, -1))
        return JacobiState(
            guesses=jnp.where(draft.active[:, None], window, state.guesses),
            guess_from=jnp.where(draft.active, draft.length, state.guess_from),
            pool=pool,
            stamp=stamp,
            clock=state.clock + t,
        )


def _tokens_at(history: Int[Array, "B L"], at: Int[Array, "B M"]) -> Int[Array, "B M"]:
    """``history[b, at[b, m]]``, -1 before the first token."""
    got = jnp.take_along_axis(history, jnp.clip(at, 0, history.shape[1] - 1), axis=1)
    return jnp.where(at >= 0, got, -1).astype(jnp.int32)


def _continue(pool: Int[Array, "B P N"], stamp: Int[Array, "B P"], context: Int[Array, "B C"]) -> tuple[Int[Array, " B"], Bool[Array, " B"]]:
    """The token after ``context`` by the pool: of the n-grams sharing the longest tail with it, the
    one seen last; and whether any shares at least its last token."""
    same = (pool[..., :-1] == context[:, None, :]) & (stamp >= 0)[..., None]  # [B, P, C]
    shared = jnp.sum(jnp.cumprod(same[..., ::-1].astype(jnp.int32), axis=-1), axis=-1)  # matching tail length
    longest = jnp.max(shared, axis=1, keepdims=True)
    best = jnp.argmax(jnp.where(shared == longest, stamp, -1), axis=1)
    token = jnp.take_along_axis(pool[..., -1], best[:, None], axis=1)[:, 0]
    return token, longest[:, 0] > 0


def _insert(
    pool: Int[Array, "B P N"], stamp: Int[Array, "B P"], grams: Int[Array, "B T N"], valid: Bool[Array, "B T"], clock: Int[Array, ""]
) -> tuple[Int[Array, "B P N"], Int[Array, "B P"]]:
    """Add ``grams`` (later ones stamped newer): an n-gram whose context the pool holds replaces that
    entry's next token, any other takes the slot seen longest ago."""
    b, size = stamp.shape
    t = grams.shape[1]
    key = grams[..., :-1]
    # Of new n-grams with the same context only the last counts.
    same = jnp.all(key[:, :, None, :] == key[:, None, :, :], axis=-1)  # [B, T, T]
    later = jnp.triu(jnp.ones((t, t), bool), k=1)[None]
    valid = valid & ~jnp.any(same & later & valid[:, None, :], axis=2)
    held = jnp.all(pool[:, None, :, :-1] == key[:, :, None, :], axis=-1) & (stamp >= 0)[:, None, :]  # [B, T, P]
    has = jnp.any(held, axis=2) & valid
    matched_slot = jnp.argmax(jnp.where(held, stamp[:, None, :], -2), axis=2)
    # Fresh n-grams take the oldest slots no updated n-gram uses (the pool holds at least 2T slots).
    taken = jnp.any(has[:, :, None] & (matched_slot[:, :, None] == jnp.arange(size)[None, None, :]), axis=1)
    _, oldest = jax.lax.top_k(-jnp.where(taken, jnp.iinfo(jnp.int32).max, stamp), t)
    rank = jnp.cumsum(valid & ~has, axis=1) - 1
    slot = jnp.where(has, matched_slot, jnp.take_along_axis(oldest, jnp.clip(rank, 0, t - 1), axis=1))
    slot = jnp.where(valid, slot, size)  # size: dropped
    rows = jnp.arange(b)[:, None]
    pool = pool.at[rows, slot].set(grams, mode="drop")
    stamp = stamp.at[rows, slot].set(clock + jnp.arange(t, dtype=jnp.int32)[None, :], mode="drop")
    return pool, stamp
