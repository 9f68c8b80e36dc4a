"""Stop conditions — when generation ends, and where its text is cut — and the text a generation emits.

One vocabulary for every front end, composed with ``|`` ("stop at whichever comes first")::

    from zgen import stop
    stop.max_len(64) | stop.ends_with_any(model.eos_token_ids) | stop.ends_with_text("\\n\\n")

* ``max_len(n)``: stop after ``n`` generated tokens (finish reason ``"length"``);
* ``ends_with(ids)`` / ``ends_with_any([...])``: stop once the generated tokens end with a token
  sequence (an EOS id is a one-token sequence);
* ``ends_with_text(s)``: stop once the generated text contains ``s``, matched across token boundaries.

The tokens that complete a stop are generated (they stay in ``token_ids`` and in a context); the stop
itself is left out of the text, and so is everything after a stop string. One-token sequences are
checked on the device, inside the decode loop; longer sequences and strings on the host after each
sync, and tokens decoded past them are rolled back exactly. ``SamplingConfig``'s ``max_new_tokens``,
``stop``, ``stop_token_ids`` and ``ignore_eos`` are a shorthand for the same thing
(:meth:`StopCondition.from_sampling`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zgen.errors import ConfigError

if TYPE_CHECKING:
    from zgen.runtime.sampling import SamplingConfig
    from zgen.tokenizer import Tokenizer

__all__ = [
    "StopCondition",
    "StopStringMatcher",
    "TextStream",
    "ends_with",
    "ends_with_any",
    "ends_with_text",
    "max_len",
]

MAX_TOKEN_ID = 2**31 - 1  # ids live in int32 arrays on the device


def _token_sequence(ids: int | Iterable[int]) -> tuple[int, ...]:
    seq = (ids,) if isinstance(ids, int) else tuple(ids)
    if not seq or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_TOKEN_ID for i in seq):
        raise ConfigError(f"a stop sequence must be a non-empty sequence of token ids in [0, 2**31), got {ids!r}")
    return seq


def _strings(strings: Iterable[str] | str) -> tuple[str, ...]:
    items = (strings,) if isinstance(strings, str) else tuple(strings)
    for s in items:
        if not isinstance(s, str) or not s:
            raise ConfigError(f"stop strings must be non-empty strings, got {s!r}")
    return tuple(dict.fromkeys(items))


@dataclass(frozen=True)
class StopCondition:
    """Stop after ``max_tokens`` generated tokens, or once the output ends with a token sequence or
    contains a string (see the module docstring)."""

    max_tokens: int | None = None
    sequences: tuple[tuple[int, ...], ...] = ()
    strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = self.max_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"max_len takes an integer >= 1, got {n!r}")
        object.__setattr__(self, "sequences", tuple(dict.fromkeys(_token_sequence(s) for s in self.sequences)))
        object.__setattr__(self, "strings", _strings(self.strings))

    def __or__(self, other: StopCondition) -> StopCondition:
        if not isinstance(other, StopCondition):
            return NotImplemented
        limits = [n for n in (self.max_tokens, other.max_tokens) if n is not None]
        return StopCondition(
            max_tokens=min(limits) if limits else None,
            sequences=self.sequences + other.sequences,
            strings=self.strings + other.strings,
        )

    @staticmethod
    def from_sampling(config: SamplingConfig, eos_token_ids: Iterable[int]) -> StopCondition:
        """What a :class:`~zgen.runtime.sampling.SamplingConfig` asks for: ``max_new_tokens``, its stop
        strings, and ``stop_token_ids`` when given, else the model's EOS ids unless ``ignore_eos``
        (vLLM's rule: ``ignore_eos`` drops EOS, never explicit stop ids)."""
        if config.stop_token_ids is not None:
            ids: Iterable[int] = config.stop_token_ids
        elif config.ignore_eos:
            ids = ()
        else:
            ids = eos_token_ids
        return StopCondition(config.max_new_tokens, tuple((i,) for i in ids), config.stop)

    @property
    def device_token_ids(self) -> tuple[int, ...]:
        """The one-token stop sequences (the decode loop checks these itself)."""
        return tuple(s[0] for s in self.sequences if len(s) == 1)

    @property
    def needs_host(self) -> bool:
        """Whether some stop can only be seen on the host (a longer sequence or a string)."""
        return bool(self.strings) or any(len(s) > 1 for s in self.sequences)


def max_len(n: int) -> StopCondition:
    """Stop after ``n`` generated tokens."""
    return StopCondition(max_tokens=n)


def ends_with(ids: int | Iterable[int]) -> StopCondition:
    """Stop once the generated tokens end with ``ids`` (left out of the text)."""
    return StopCondition(sequences=(_token_sequence(ids),))


def ends_with_any(sequences: Iterable[int | Iterable[int]]) -> StopCondition:
    """Stop at the first of several sequences (an int is a one-token sequence, e.g. an EOS id)."""
    seqs = tuple(_token_sequence(s) for s in sequences)
    if not seqs:
        raise ConfigError("ends_with_any needs at least one stop sequence")
    return StopCondition(sequences=seqs)


def ends_with_text(text: str) -> StopCondition:
    """Stop once the generated text contains ``text``; it and what follows are left out of the text."""
    return StopCondition(strings=(text,))


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
        self.stops: tuple[str, ...] = _strings(stops)
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


class TextStream:
    """The tokens and text one generation emits, stop rules applied as tokens arrive.

    :meth:`push` takes each generated token. A completed stop sequence is kept in :attr:`tokens` but
    never becomes text; a stop string cuts the text where it starts. With ``incremental`` (streaming),
    or when there are stop strings to find, each token is detokenized as it comes and :meth:`push`
    returns the text it releases — tokens that might begin a multi-token stop sequence are held back
    until the next tokens decide — and everything :meth:`push` and :meth:`finish` return adds up to
    :attr:`text`, however the tokens were batched. Otherwise the text is decoded once, at the end.
    """

    def __init__(self, tokenizer: Tokenizer, stop: StopCondition, *, incremental: bool = True) -> None:
        self.stop = stop
        self._tokenizer = tokenizer
        self._incremental = incremental or bool(stop.strings)
        self._decoder = tokenizer.incremental_decoder(skip_special_tokens=True)
        self._strings = StopStringMatcher(stop.strings)
        self._single = frozenset(s[0] for s in stop.sequences if len(s) == 1)
        self._multi = tuple(s for s in stop.sequences if len(s) > 1)
        self._prefixes = frozenset(s[:i] for s in self._multi for i in range(1, len(s)))
        self._longest_prefix = max((len(p) for p in self._prefixes), default=0)
        self.tokens: list[int] = []
        self._held: list[int] = []  # incremental: a tail of tokens that may begin a stop sequence
        self._pieces: list[str] = []
        self.done = False
        self.finish_reason = "length"

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def push(self, token: int) -> str:
        """Take one generated token (ignored once done); returns the text it releases (incremental)."""
        if self.done:
            return ""
        self.tokens.append(token)
        matched = self._completed_sequence()
        if not self._incremental:
            if matched:
                return self._end("stop", len(matched))
            return self._end("length") if self._at_limit() else ""
        self._held.append(token)
        if matched:  # its first tokens were held as prefixes, so it ends the held tail
            del self._held[len(self._held) - len(matched) :]
            return self._end("stop")
        keep = next(
            (n for n in range(min(len(self._held), self._longest_prefix), 0, -1) if tuple(self._held[-n:]) in self._prefixes), 0
        )
        released, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        out = self._emit("".join(self._decoder.push(t) for t in released))
        if self._strings.stopped:
            self.done, self.finish_reason = True, "stop"
        elif self._at_limit():
            out += self._end("length")
        return out

    def finish(self, reason: str = "length") -> str:
        """End without a stop (length limit, context full): release what is held."""
        return "" if self.done else self._end(reason)

    def _completed_sequence(self) -> tuple[int, ...]:
        """The stop sequence the last token completed; the longest where several end together (as
        for stop strings), so the text leaves out all of it."""
        if self._multi:  # checked per token: most streams have none
            multi = max((s for s in self._multi if tuple(self.tokens[-len(s) :]) == s), key=len, default=())
            if multi:
                return multi
        return (self.tokens[-1],) if self.tokens[-1] in self._single else ()

    def _at_limit(self) -> bool:
        return self.stop.max_tokens is not None and len(self.tokens) >= self.stop.max_tokens

    def _end(self, reason: str, matched: int = 0) -> str:
        self.done = True
        self.finish_reason = reason
        if not self._incremental:  # the text, decoded once, without the stop sequence
            body = self.tokens[: len(self.tokens) - matched]
            self._pieces = [self._tokenizer.decode(body, skip_special_tokens=True)]
            return ""
        released = "".join(self._decoder.push(t) for t in self._held) + self._decoder.flush()
        self._held = []
        out = self._emit(released)
        if self._strings.stopped:
            self.finish_reason = "stop"
        else:
            tail = self._strings.flush()
            self._pieces.append(tail)
            out += tail
        return out

    def _emit(self, text: str) -> str:
        out, _ = self._strings.push(text)
        self._pieces.append(out)
        return out
