"""A sequence: token ids and the KV that holds all but the pending ones — what every request and
context is to the runtime.

Token ``i`` sits at position ``i`` for good: masking hides tokens from attention without renumbering.
The KV handle holds the first ``kv_len`` tokens; the rest are *pending*, fed by the next step. After
a generation the last sampled token is pending, so the next call feeds it first.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from zgen.cache.base import KVHandle
from zgen.errors import CacheError


class Sequence:
    """Tokens, per-token masks, a KV handle and a sampling seed (see the module docstring)."""

    def __init__(self, kv: KVHandle, seed: int, tokens: Iterable[int] = ()) -> None:
        self.kv = kv
        self.seed = seed
        self.tokens: list[int] = list(tokens)
        self.masked = np.zeros(len(self.tokens), bool)
        # Some K/V were computed under masks or an attention override: they are not what a plain
        # prefill of these tokens gives, so they are never offered to a prefix cache.
        self.custom_attention = False
        self.busy = False  # a job is queued or running on it
        self.released = False
        self.last_step = 0  # the engine step that last served it (idle ones are preempted least recent first)

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are stored."""
        return self.kv.seq_len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def any_masked(self) -> bool:
        return bool(self.masked.any())

    def append(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        self.tokens.extend(ids)
        self.masked = np.concatenate([self.masked, np.zeros(len(ids), bool)])

    def keep(self, n: int) -> None:
        """Keep the first ``n`` tokens; K/V past them are rolled back exactly."""
        if not 0 <= n <= len(self.tokens):
            raise CacheError(f"cannot keep {n} of {len(self.tokens)} tokens")
        del self.tokens[n:]
        self.masked = self.masked[:n]
        if self.kv_len > n:
            self.kv.truncate(n)

    def keep_pending(self, n: int) -> None:
        """Keep the first ``n`` tokens with the last one pending (its K/V rolled back too)."""
        self.keep(n)
        if self.kv_len > max(n - 1, 0):
            self.kv.truncate(max(n - 1, 0))

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.kv.release()
