"""Grammar-constrained decoding, pipelined from the host.

A constrained row's next draw needs a token mask only the host can compute: llguidance advances the
row's grammar by the token just drawn, then says what may follow. Rather than stop the device for it,
the host drives the decode loop's body — :func:`~zgen.runtime.step.decode_feed` (the forward pass)
and :func:`~zgen.runtime.step.decode_draw`, compiled apart (:meth:`~zgen.runtime.runner.Runner.decode_steps`)
— and JAX's asynchronous dispatch keeps the device busy. For each token ``t`` the host

1. dispatches ``draw_t(logits_t, mask_t)``: the tokens ``t`` stay on the device;
2. dispatches ``feed_{t+1}`` on those tokens, device to device (unless no row draws again);
3. only then fetches the tokens — ready once ``draw_t`` is done, while the device runs ``feed_{t+1}`` —
   advances the grammars by them (:func:`~zgen.runtime.grammar.consume_all`), computes
   ``mask_{t+1}`` (:func:`~zgen.runtime.grammar.fill_masks`) and puts it on the device.

So the device waits for the host only where the host's turn (the grammar work and two dispatches)
outlasts a forward pass. Rows without a grammar decode in the same steps (their masks allow every
token). Draws are the on-device loop's (same function, same per-position keys): a row gets the same
tokens from either loop, alone or batched.

A row whose grammar completes (or fails) with token ``t`` gets an empty ``mask_{t+1}`` and draws
nothing more. ``feed_{t+1}`` has already written the K/V of its token ``t`` at the next position: inside
the room the row reserved, and the K/V the row's next step would write anyway; the engine truncates
the sequence to what it keeps, as after the on-device loop (whose finished rows go on feeding too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import jax
import numpy as np

from zgen.cache.base import KVState
from zgen.errors import GrammarError
from zgen.lora.bank import LoraBank
from zgen.runtime.grammar import GrammarMatcher, consume_all, fill_masks, mask_words
from zgen.runtime.runner import Runner
from zgen.runtime.sampling import SamplingFlags, SamplingParams
from zgen.runtime.step import DecodeLoop, loop_goes_on

S = TypeVar("S", bound=KVState)

__all__ = ["ConstrainedRows", "constrained_decode"]


class ConstrainedRows:
    """The host's side of a constrained loop: the grammars of its rows (``(matcher, row index)`` of a
    batch ``width`` wide), the token masks they give and the rows whose grammar failed."""

    def __init__(self, rows: Sequence[tuple[GrammarMatcher, int]], width: int, vocab_size: int) -> None:
        self.rows = list(rows)
        self.failures: dict[int, GrammarError] = {}
        self.ended = np.zeros(width, bool)  # the grammar completed or failed with the row's last draw
        self._shape = (width, mask_words(vocab_size))

    def first_masks(self) -> np.ndarray:
        """The masks of the loop's first draw (a row whose grammar fails already draws nothing)."""
        return self._masks(self.rows)

    def take(self, drawn: np.ndarray) -> None:
        """Advance each grammar by its row's draw (``-1``: the row drew nothing)."""
        draws = [(m, int(drawn[i]), i) for m, i in self.rows if drawn[i] >= 0 and i not in self.failures]
        self.failures.update(consume_all(draws))
        self.ended[:] = False
        for m, _, i in draws:
            self.ended[i] = m.complete or i in self.failures

    def next_masks(self, done: np.ndarray) -> np.ndarray:
        """The masks of the next draw, for the rows that draw again (not ``done``, grammar going on)."""
        return self._masks([(m, i) for m, i in self.rows if not (done[i] or self.ended[i] or i in self.failures)])

    def _masks(self, going: list[tuple[GrammarMatcher, int]]) -> np.ndarray:
        masks = np.full(self._shape, -1, np.int32)  # rows without a grammar (or done) may draw anything
        failed = fill_masks(going, masks)
        self.failures.update(failed)
        self.ended[list(failed)] = True
        masks[self.ended] = 0  # allows nothing: the row ends (decode_draw)
        return masks


def constrained_decode(
    runner: Runner, kv: S, loop: DecodeLoop, sampling: SamplingParams, rows: Sequence[tuple[GrammarMatcher, int]], *,
    flags: SamplingFlags, adapters: LoraBank | None = None,
) -> tuple[DecodeLoop, S, dict[int, GrammarError]]:
    """Run the decode loop ``loop`` (built for :func:`~zgen.runtime.step.decode_loop`, its counters on
    the host) whose ``rows`` are constrained, from the host (see the module docstring). Returns the
    loop as it ended (``step``: the draws made), the cache, and the rows whose grammar failed, with why."""
    done = np.asarray(loop.done)
    live_steps = np.asarray(loop.last_step)[~done]
    # Draws past every row's last allowed one, or past max_steps, are never made: no forward is dispatched for them.
    limit = np.int32(min(int(loop.max_steps), int(live_steps.max()) + 1 if live_steps.size else 0))
    if limit == 0:
        return loop, kv, {}
    exit_on_finish, done_at_start = np.bool_(loop.exit_on_finish), np.int32(loop.done_at_start)
    host = ConstrainedRows(rows, done.shape[0], runner.model.config.vocab_size)
    steps = runner.decode_steps(kv, loop, sampling, flags=flags, adapters=adapters)
    loop = jax.device_put(loop)  # once: the first forward pass and draw share it
    logits, kv = steps.feed(kv, loop)
    masks = host.first_masks()  # while the first forward pass runs
    done_at_start += np.int32(np.count_nonzero(host.ended & ~done))  # rows failed already: they draw nothing
    step = np.int32(0)
    while True:
        loop, drawn = steps.draw(logits, loop, jax.device_put(masks))
        step += 1
        if step < limit:
            logits, kv = steps.feed(kv, loop)
        drawn_now, done = jax.device_get((drawn, loop.done))
        host.take(drawn_now)
        if not loop_goes_on(step, limit, done | host.ended, exit_on_finish, done_at_start):
            return loop, kv, host.failures
        masks = host.next_masks(done)
