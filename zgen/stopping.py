"""Stop conditions: when generation ends, and where the returned text is cut.

Conditions compose with ``|`` ("stop at whichever comes first")::

    MaxNewTokens(128) | StopTokens([2]) | StopStrings(["\\n\\n", "User:"])
    # == StopCriteria(max_new_tokens=128, token_ids=frozenset({2}), strings=("\\n\\n", "User:"))

The token-id and length parts are checked on the device, inside the decode loop. Stop strings need
text, so they are checked on the host by :class:`StopStringMatcher`, fed with the detokenized text
piece by piece.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zgen.errors import ConfigError

if TYPE_CHECKING:
    from zgen.sampling import SamplingConfig

__all__ = [
    "MaxNewTokens",
    "StopCondition",
    "StopCriteria",
    "StopStringMatcher",
    "StopStrings",
    "StopTokens",
]


def _check_strings(strings: Iterable[str] | str, where: str) -> tuple[str, ...]:
    if isinstance(strings, str):
        strings = (strings,)
    out: list[str] = []
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ConfigError(f"{where}: stop strings must be non-empty strings, got {s!r}")
        if s not in out:
            out.append(s)
    return tuple(out)


def _check_ids(ids: Iterable[int] | int, where: str) -> frozenset[int]:
    if isinstance(ids, int):
        ids = (ids,)
    out: set[int] = set()
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConfigError(f"{where}: token ids must be integers >= 0, got {i!r}")
        out.add(int(i))
    return frozenset(out)


class StopCondition:
    """Base of the stop conditions; ``a | b`` stops at whichever of ``a`` and ``b`` fires first."""

    def criteria(self) -> StopCriteria:
        """This condition as one normalized :class:`StopCriteria`."""
        raise NotImplementedError

    def __or__(self, other: StopCondition) -> StopCriteria:
        if not isinstance(other, StopCondition):
            return NotImplemented
        a, b = self.criteria(), other.criteria()
        if a.max_new_tokens is None:
            n = b.max_new_tokens
        elif b.max_new_tokens is None:
            n = a.max_new_tokens
        else:
            n = min(a.max_new_tokens, b.max_new_tokens)
        return StopCriteria(
            max_new_tokens=n,
            token_ids=a.token_ids | b.token_ids,
            strings=a.strings + tuple(s for s in b.strings if s not in a.strings),
        )


@dataclass(frozen=True)
class StopCriteria(StopCondition):
    """The union of stop conditions, normalized.

    Attributes:
        max_new_tokens: stop after this many generated tokens (``None``: no limit of its own).
        token_ids: stop when one of these tokens is generated (the token is generated, its text is not
            part of the output; see the generator).
        strings: stop when one of these strings is completed; the output is cut before it.
    """

    max_new_tokens: int | None = None
    token_ids: frozenset[int] = field(default_factory=frozenset)
    strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"StopCriteria.max_new_tokens={n!r}: must be an integer >= 1 or None")
        object.__setattr__(self, "token_ids", _check_ids(self.token_ids, "StopCriteria.token_ids"))
        object.__setattr__(self, "strings", _check_strings(self.strings, "StopCriteria.strings"))

    def criteria(self) -> StopCriteria:
        return self

    def matcher(self) -> StopStringMatcher:
        """A fresh host-side matcher for this criteria's stop strings (one per generated sequence)."""
        return StopStringMatcher(self.strings)

    @staticmethod
    def from_sampling_config(config: SamplingConfig, eos_token_ids: Iterable[int]) -> StopCriteria:
        """The stop criteria a :class:`~zgen.sampling.SamplingConfig` asks for.

        Token ids: ``config.stop_token_ids`` when given, else the model's ``eos_token_ids`` unless
        ``config.ignore_eos`` (vLLM's rule: ``ignore_eos`` drops EOS, never explicit stop ids).
        """
        if config.stop_token_ids is not None:
            ids: Iterable[int] = config.stop_token_ids
        elif config.ignore_eos:
            ids = ()
        else:
            ids = eos_token_ids
        return StopCriteria(max_new_tokens=config.max_new_tokens, token_ids=frozenset(ids), strings=config.stop)


@dataclass(frozen=True)
class MaxNewTokens(StopCondition):
    """Stop after ``n`` generated tokens (n >= 1)."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"MaxNewTokens({self.n!r}): n must be an integer >= 1")

    def criteria(self) -> StopCriteria:
        return StopCriteria(max_new_tokens=self.n)


@dataclass(frozen=True)
class StopTokens(StopCondition):
    """Stop when any of these token ids is generated. Accepts any iterable of ints (or one int)."""

    ids: frozenset[int]

    def __init__(self, ids: Iterable[int] | int) -> None:
        object.__setattr__(self, "ids", _check_ids(ids, "StopTokens"))

    def criteria(self) -> StopCriteria:
        return StopCriteria(token_ids=self.ids)


@dataclass(frozen=True)
class StopStrings(StopCondition):
    """Stop when any of these strings is completed. Accepts any iterable of strings (or one string)."""

    strings: tuple[str, ...]

    def __init__(self, strings: Iterable[str] | str) -> None:
        object.__setattr__(self, "strings", _check_strings(strings, "StopStrings"))

    def criteria(self) -> StopCriteria:
        return StopCriteria(strings=self.strings)


class StopStringMatcher:
    """Finds stop strings in text that arrives in pieces, and decides what text may be emitted.

    Feed each newly decoded piece to :meth:`push`; emit what it returns. Text that could still be the
    start of a stop string is held back until the following text decides it; at the end of
    generation (without a stop) :meth:`flush` returns what is held.

    Which match counts: the first stop string to be *completed* while reading the text (the earliest
    end; among stop strings ending at the same character, the longest). The output is the text before
    that match; the match and everything after it are dropped. The result is the same however the text
    is split into pieces, and stop strings may span any number of pieces. Example: with stops
    ``("abc", "b")`` the text ``"xabc"`` gives ``"xa"`` (``"b"`` is complete before ``"abc"``).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops: tuple[str, ...] = _check_strings(stops, "StopStringMatcher")
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """The text received but not emitted yet (a possible start of a stop string)."""
        return self._held

    def push(self, text: str) -> tuple[str, bool]:
        """Feed newly decoded text; returns ``(text safe to emit now, stopped?)``.

        After a stop every further call returns ``("", True)``.
        """
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            end, neg_len, s = best
            self.stopped, self.matched, self._held = True, s, ""
            return buf[: end + neg_len], True
        hold = 0
        for n in range(min(len(buf), self._max_hold), 0, -1):
            if buf[-n:] in self._prefixes:
                hold = n
                break
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """At the end of generation: the held-back text (``""`` after a stop, which discards it)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
