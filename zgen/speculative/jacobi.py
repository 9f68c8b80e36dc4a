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
* the **pool**: n-grams ``(before, token) -> next``, seeded with the context's last tokens and fed by
  every pass — the verified continuation and the draws the target made after guessed tokens.

A draft is built token by token: the pool's continuation of the last two tokens, else the window's
guess for that position, else the pool's most recent continuation of the last token alone, else the
last token again (a filler the next pass refines). Drafts are deterministic (``Proposal.probs is
None``): a draft is accepted iff it equals the target's own draw, so the output is exactly plain
decoding's, greedy or sampled. Sampled rows learn from the sampled draws, which use the same noise
(row key, position) the next pass draws with: a converged window is accepted under sampling too.
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

#: Pool fields: the token before, the token, the token that followed.
BEFORE, TOKEN, NEXT = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class JacobiState:
    """Per row: the Jacobi window and the n-gram pool (carried through the loop's passes)."""

    guesses: Int[Array, "B W"]  # the target's draws for positions guess_from .. guess_from + W - 1 (-1: none)
    guess_from: Int[Array, " B"]
    pool: Int[Array, "B P 3"]  # (before, token, next) n-grams (-1: an empty slot)
    stamp: Int[Array, "B P"]  # when each n-gram was last seen: the newest wins a lookup, the oldest is replaced
    clock: Int[Array, ""]


class Jacobi:
    """Jacobi (lookahead) decoding: up to ``num_tokens`` tokens drafted a pass from the target's own
    earlier predictions (see the module docstring); ``pool_size`` n-grams kept per row.

    ``adaptive``: grow the draft after full acceptance, shrink it after rejections, and decode plainly
    while fewer than 40 % of the drafts are accepted (probing again later); see
    :mod:`zgen.runtime.speculation`. Off, every pass verifies ``num_tokens`` guesses, which costs
    little more than one token where decoding is bound by memory bandwidth (small batches on a GPU).
    """

    def __init__(self, num_tokens: int = 8, *, pool_size: int = 256, adaptive: bool = True) -> None:
        self._num_tokens = check_num_tokens("Jacobi", num_tokens)
        least = 2 * (num_tokens + 1)
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < least:
            raise ConfigError(f"Jacobi pool_size must be an integer >= {least} (twice the n-grams one pass adds), got {pool_size!r}")
        if not isinstance(adaptive, bool):
            raise ConfigError(f"Jacobi adaptive must be a bool, got {adaptive!r}")
        self.pool_size = pool_size
        self._adaptive = adaptive

    def __repr__(self) -> str:
        return f"Jacobi(num_tokens={self._num_tokens}, pool_size={self.pool_size}, adaptive={self._adaptive})"

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def adaptive(self) -> bool:
        return self._adaptive

    def cache_key(self) -> Hashable:
        return ("jacobi", self._num_tokens, self.pool_size, self._adaptive)

    def check_target(self, model: Model) -> None:
        del model  # drafts are the target's own tokens: any model

    def device_params(self) -> Any:
        return ()

    def start(self, params: Any, history: Int[Array, "B L"], length: Int[Array, " B"]) -> JacobiState:
        """The pool holds the n-grams ending at the context's last ``pool_size`` tokens; no guesses yet."""
        del params
        b, width = history.shape
        size = self.pool_size
        at = length[:, None] - size + jnp.arange(size)[None, :]  # the position of each n-gram's next token
        valid = at >= 1

        def token(offset: int) -> Array:
            where = at - offset
            got = jnp.take_along_axis(history, jnp.clip(where, 0, width - 1), axis=1)
            return jnp.where(valid & (where >= 0), got, -1)

        pool = jnp.stack([token(2), token(1), token(0)], axis=-1).astype(jnp.int32)
        stamp = jnp.where(valid, jnp.arange(size)[None, :], -1).astype(jnp.int32)
        guesses = jnp.full((b, self._num_tokens + 1), -1, jnp.int32)
        return JacobiState(guesses, jnp.zeros(b, jnp.int32), pool, stamp, jnp.asarray(size, jnp.int32))

    def advance(self, state: JacobiState, kept: Int[Array, " B"]) -> JacobiState:
        del kept  # guesses are kept by position: those before the next pending token are never read
        return state

    def propose(self, params: Any, state: JacobiState, draft: DraftInput) -> tuple[Proposal, JacobiState]:
        del params
        history, length = draft.history, draft.length
        width = history.shape[1]
        p = length - 1
        before = jnp.take_along_axis(history, jnp.maximum(p - 1, 0)[:, None], axis=1)[:, 0]
        before = jnp.where(p >= 1, before, -1)
        pending = jnp.take_along_axis(history, jnp.clip(p, 0, width - 1)[:, None], axis=1)[:, 0]
        pool, stamp = state.pool, state.stamp
        window = state.guesses.shape[1]

        def next_token(carry: tuple[Array, Array], i: Array) -> tuple[tuple[Array, Array], Array]:
            prev, last = carry
            same_token = pool[..., TOKEN] == last[:, None]
            exact = same_token & (pool[..., BEFORE] == prev[:, None])
            from_exact, has_exact = _newest(pool, stamp, exact)
            from_token, has_token = _newest(pool, stamp, same_token)
            at = p + i - state.guess_from
            guess = jnp.take_along_axis(state.guesses, jnp.clip(at, 0, window - 1)[:, None], axis=1)[:, 0]
            has_guess = (at >= 0) & (at < window) & (guess >= 0)
            token = jnp.where(has_exact, from_exact, jnp.where(has_guess, guess, jnp.where(has_token, from_token, last)))
            return (last, token), token

        steps = jnp.arange(1, self._num_tokens + 1, dtype=jnp.int32)
        _, tokens = jax.lax.scan(next_token, (before, pending), steps)
        count = jnp.where(draft.active, draft.num_tokens, 0).astype(jnp.int32)
        return Proposal(tokens.T.astype(jnp.int32), count, None), state

    def observe(
        self, state: JacobiState, draft: DraftInput, proposal: Proposal, count: Int[Array, " B"], draws: Int[Array, "B T"]
    ) -> JacobiState:
        """The draws become the window, and ``(token before, token fed) -> draw`` joins the pool for
        every checked position (the verified prefix's n-grams and the guessed ones' alike)."""
        history, length = draft.history, draft.length
        b, t = draws.shape
        width = history.shape[1]
        p = length - 1
        before = jnp.where((p >= 1)[:, None], jnp.take_along_axis(history, jnp.maximum(p - 1, 0)[:, None], axis=1), -1)
        pending = jnp.take_along_axis(history, jnp.clip(p, 0, width - 1)[:, None], axis=1)
        fed = jnp.concatenate([before, pending, proposal.tokens], axis=1)  # [B, T + 1]: fed[j + 1] is read at p + j
        grams = jnp.stack([fed[:, :-1], fed[:, 1:], draws], axis=-1)  # [B, T, 3]
        checked = draft.active[:, None] & (jnp.arange(t)[None, :] <= count[:, None])
        pool, stamp = _insert(state.pool, state.stamp, grams, checked, state.clock)
        rows = draft.active[:, None]
        return JacobiState(
            guesses=jnp.where(rows, jnp.where(checked, draws, -1), state.guesses),
            guess_from=jnp.where(draft.active, length, state.guess_from),
            pool=pool,
            stamp=stamp,
            clock=state.clock + t,
        )


def _newest(pool: Int[Array, "B P 3"], stamp: Int[Array, "B P"], match: Bool[Array, "B P"]) -> tuple[Int[Array, " B"], Bool[Array, " B"]]:
    """The next token of the most recently seen matching n-gram per row, and whether one matched."""
    best = jnp.argmax(jnp.where(match, stamp, -1), axis=1)
    token = jnp.take_along_axis(pool[..., NEXT], best[:, None], axis=1)[:, 0]
    return token, jnp.any(match, axis=1)


def _insert(
    pool: Int[Array, "B P 3"], stamp: Int[Array, "B P"], grams: Int[Array, "B T 3"], valid: Bool[Array, "B T"], clock: Int[Array, ""]
) -> tuple[Int[Array, "B P 3"], Int[Array, "B P"]]:
    """Add ``grams`` (later ones stamped newer): an n-gram whose ``(before, token)`` the pool holds
    replaces that entry's next token, any other takes the slot seen longest ago."""
    b, size = stamp.shape
    t = grams.shape[1]
    key = grams[..., :NEXT]
    # Of new n-grams with the same (before, token) only the last counts.
    same = jnp.all(key[:, :, None, :] == key[:, None, :, :], axis=-1)  # [B, T, T]
    later = jnp.triu(jnp.ones((t, t), bool), k=1)[None]
    valid = valid & ~jnp.any(same & later & valid[:, None, :], axis=2)
    held = jnp.all(pool[:, None, :, :NEXT] == key[:, :, None, :], axis=-1) & (stamp >= 0)[:, None, :]  # [B, T, P]
    has = jnp.any(held, axis=2) & valid
    matched_slot = jnp.argmax(jnp.where(held, stamp[:, None, :], -2), axis=2)
    # Fresh n-grams take the oldest slots no updated n-gram uses (the pool holds at least 2T slots).
    taken = jnp.any(has[:, :, None] & (matched_slot[:, :, None] == jnp.arange(size)[None, None, :]), axis=1)
    _, oldest = jax.lax.top_k(-jnp.where(taken, jnp.iinfo(jnp.int32).max, stamp), t)
    fresh = valid & ~has
    rank = jnp.cumsum(fresh, axis=1) - 1
    slot = jnp.where(has, matched_slot, jnp.take_along_axis(oldest, jnp.clip(rank, 0, t - 1), axis=1))
    slot = jnp.where(valid, slot, size)  # size: dropped
    rows = jnp.arange(b)[:, None]
    pool = pool.at[rows, slot].set(grams, mode="drop")
    stamp = stamp.at[rows, slot].set(clock + jnp.arange(t, dtype=jnp.int32)[None, :], mode="drop")
    return pool, stamp
