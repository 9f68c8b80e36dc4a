"""Drafters for speculative decoding: guess the next tokens cheaply, let one forward pass verify them.

``Context.generate_with_drafter`` feeds the context's pending token plus the draft through the model
in one pass, samples at every position, keeps the draft's longest prefix that matches what was
sampled (plus the one sampled token after it) and rolls the rest back exactly. The output is what
plain ``generate`` produces with the same sampler and seed: every kept token was sampled from the
model given an accepted prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from zgen.errors import ConfigError


class Drafter(Protocol):
    """Pie's drafter interface: see the context's tokens, propose a continuation."""

    def update(self, context_ids: Sequence[int]) -> None:
        """Every token of the context so far (called before each ``draft``)."""
        ...

    def draft(self) -> tuple[list[int], list[int]]:
        """Proposed tokens and their positions: ``positions[i] == len(context_ids) + i`` (a chain)."""
        ...


class NgramDrafter:
    """Prompt-lookup decoding: find the last ``n``-gram earlier in the context, propose what followed.

    Tries ``max_ngram`` down to ``min_ngram`` tokens and takes the most recent earlier match; proposes
    up to ``max_draft`` tokens (none when nothing matches).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 8) -> None:
        if not 1 <= min_ngram <= max_ngram or max_draft < 1:
            raise ConfigError(
                f"NgramDrafter needs 1 <= min_ngram <= max_ngram and max_draft >= 1, "
                f"got min_ngram={min_ngram}, max_ngram={max_ngram}, max_draft={max_draft}"
            )
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft
        self._ids: list[int] = []

    def update(self, context_ids: Sequence[int]) -> None:
        self._ids = list(context_ids)

    def draft(self) -> tuple[list[int], list[int]]:
        ids = self._ids
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):  # most recent earlier occurrence first
                if ids[start : start + n] == tail:
                    follow = ids[start + n : start + n + self.max_draft]
                    return follow, list(range(len(ids), len(ids) + len(follow)))
        return [], []
