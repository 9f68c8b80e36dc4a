"""Structured output: grammars that constrain generation, through ``llguidance``.

A :class:`Grammar` (``Grammar.json_schema(schema)``, ``Grammar.regex(r)``, ``Grammar.lark(g)``) is
checked when it is made: a malformed one raises :class:`~zgen.errors.GrammarError` before any compute.
Put it in a ``SamplingConfig(grammar=...)``; the engine then gives the request a
:class:`GrammarMatcher` (llguidance's parser over the model's vocabulary) and, at every draw of that
request, a packed bitmask of the tokens the grammar allows next. The mask is applied on the device
(:func:`allowed_tokens`: disallowed logits become ``-inf`` before the draw), so the draw itself, its
noise and its filters stay the one sampler's. EOS is allowed only where the grammar may end; when the
grammar can take nothing more the generation stops there (finish reason ``"stop"``).

The masks of one step are computed on the host by llguidance's thread pool
(:func:`fill_masks`, the GIL released) while the device runs that step's forward pass: in an engine
step the forward is dispatched first; in the on-device decode loop a host worker
(:class:`GrammarLoop`) takes each draw and computes the next masks while the loop runs the next
forward pass. On a CUDA GPU the loop hands draws and masks over through
:mod:`zgen.runtime.exchange` (copies and a stream wait; no Python in the loop); elsewhere through two
host callbacks per iteration.
"""

from __future__ import annotations

import functools
import json
import queue
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jaxtyping import Array, Bool, Int

from zgen.errors import ConfigError, GrammarError
from zgen.model import Model, attached
from zgen.runtime import exchange

if TYPE_CHECKING:
    import llguidance

GrammarKind = Literal["json_schema", "regex", "lark"]

__all__ = ["Grammar", "GrammarDrafts", "GrammarLoop", "GrammarMatcher", "allowed_tokens", "fill_masks", "mask_words"]


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ConfigError("structured output needs the llguidance package: pip install 'zgen[grammar]'") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a generation must match, compiled for llguidance (see the module docstring).

    ``kind`` and ``source`` say what the user gave (a schema as canonical JSON text); ``definition`` is
    llguidance's grammar. Equal grammars compare and hash equal, so a ``SamplingConfig`` stays hashable.
    """

    kind: GrammarKind
    source: str
    definition: str = field(repr=False)

    @staticmethod
    def json_schema(schema: Mapping[str, Any] | str | bool, *, compact: bool = False) -> Grammar:
        """Output is one JSON value valid under ``schema`` (a dict or its JSON text). ``compact``:
        no whitespace between tokens (JSON's optional whitespace is otherwise the model's choice)."""
        llg = _llguidance()
        try:
            text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
            parsed = json.loads(text)
        except (TypeError, ValueError) as err:
            raise GrammarError(f"the JSON schema is not valid JSON ({err}); pass a dict or its JSON text") from None
        if not isinstance(parsed, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object (or true/false), got {type(parsed).__name__}")
        try:
            definition = llg.LLMatcher.grammar_from_json_schema(
                text, overrides={"whitespace_flexible": False} if compact else None
            )
        except ValueError as err:
            raise GrammarError(f"the JSON schema cannot be read: {err}") from None
        return Grammar._checked("json_schema", text, definition)

    @staticmethod
    def regex(pattern: str) -> Grammar:
        """Output matches ``pattern`` as a whole (Rust ``regex`` syntax, close to Python's ``re``)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"a regex grammar needs a non-empty pattern string, got {pattern!r}")
        return Grammar._checked("regex", pattern, _llguidance().LLMatcher.grammar_from_regex(pattern))

    @staticmethod
    def lark(grammar: str) -> Grammar:
        """Output is derived from the rule ``start`` of a Lark grammar (llguidance's Lark dialect:
        ``%json {...}`` embeds a JSON schema, ``/.../`` are regexes)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError(f"a Lark grammar needs a non-empty grammar text, got {grammar!r}")
        return Grammar._checked("lark", grammar, _llguidance().LLMatcher.grammar_from_lark(grammar))

    @staticmethod
    def _checked(kind: GrammarKind, source: str, definition: str) -> Grammar:
        message = _llguidance().LLMatcher.validate_grammar(definition)
        if message and not message.startswith("WARNING"):
            raise GrammarError(f"the {kind.replace('_', ' ')} grammar is malformed: {message.strip()}")
        return Grammar(kind, source, definition)


def mask_words(vocab_size: int) -> int:
    """Width of a packed token mask: one bit per token id in int32 words."""
    return (vocab_size + 31) // 32


def allowed_tokens(mask: Int[Array, "N W"], vocab_size: int) -> Bool[Array, "N V"]:
    """Unpack a bitmask (bit ``i % 32`` of word ``i // 32`` = token ``i`` allowed) on the device."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=mask.dtype)[None, None, :]) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].astype(jnp.bool_)


def grammar_tokenizer(model: Model) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary (made once per model: about 0.2 s for 49k tokens)."""

    def make() -> llguidance.LLTokenizer:
        llg = _llguidance()
        eos = list(model.eos_token_ids)
        try:
            return llg.LLTokenizer(
                model.tokenizer.backend.to_str(), n_vocab=model.config.vocab_size, eos_token=eos or None
            )
        except Exception as err:  # llguidance reports an unusable tokenizer as a bare exception
            raise GrammarError(f"llguidance cannot read this model's tokenizer ({err}); grammars are unavailable") from err

    return attached(model, "grammar_tokenizer", make)


def _word_bits(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token ids as mask words and, per word, the bits of those ids in it (``int32``)."""
    words, inverse = np.unique(ids // 32, return_inverse=True)
    bits = np.zeros(len(words), np.int32)
    np.bitwise_or.at(bits, inverse, np.left_shift(np.int32(1), (ids % 32).astype(np.int32)))
    return words, bits


class _EndTokens:
    """A generation's end in mask bits: the tokenizer's EOS bits are dropped from every mask and, in
    rows where one was allowed (the grammar may end there), the generation's stop ids are allowed."""

    def __init__(self, eos: tuple[int, ...], stop_ids: tuple[int, ...]) -> None:
        eos_ids = np.asarray(eos, np.int64)
        self.eos_words, self.eos_shifts = eos_ids // 32, (eos_ids % 32).astype(np.int32)
        self.clear_words, self.clear_bits = _word_bits(eos_ids)
        self.stop_words, self.stop_bits = _word_bits(np.asarray(stop_ids, np.int64))

    @staticmethod
    @functools.cache
    def of(eos: tuple[int, ...], stop_ids: tuple[int, ...]) -> _EndTokens:
        return _EndTokens(eos, stop_ids)

    def apply(self, masks: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Swap the end bits of ``rows`` (indices) of ``masks [n, W]`` in place, touching only the
        words of those bits. Returns per row whether the generation may end there, and whether the
        row allows any token at all."""
        may_end = np.asarray(((masks[rows[:, None], self.eos_words] >> self.eos_shifts) & 1).any(axis=1))
        masks[rows[:, None], self.clear_words] &= ~self.clear_bits
        if self.stop_words.size:
            masks[rows[may_end][:, None], self.stop_words] |= self.stop_bits
        return may_end, np.asarray(masks.any(axis=1))[rows]


_NOTHING_ALLOWED = "the grammar allows no next token, and this generation has no stop token to end it"


class GrammarMatcher:
    """One generation's grammar state: the tokens it allows next, and the tokens it took.

    ``stop_ids`` are the generation's one-token stops: where the grammar may end, they (and not the
    tokenizer's own EOS, unless it is one of them) are allowed.
    """

    def __init__(self, grammar: Grammar, model: Model, stop_ids: Sequence[int]) -> None:
        tokenizer = grammar_tokenizer(model)
        self.grammar = grammar
        self._matcher = _llguidance().LLMatcher(tokenizer, grammar.definition, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"the {grammar.kind.replace('_', ' ')} grammar cannot be used: {self._matcher.get_error()}")
        self._stop_ids = frozenset(int(i) for i in stop_ids)
        self._end = _EndTokens.of(tuple(tokenizer.eos_tokens), tuple(sorted(self._stop_ids)))
        self._may_end = False

    @property
    def complete(self) -> bool:
        """The grammar can take no more tokens: the generation ends here."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def consume(self, token: int) -> None:
        """Advance past a drawn token (a stop id where the grammar may end ends the generation instead)."""
        if not self.ends_with(token) and not self._matcher.consume_token(token):
            raise self._refused(token)

    def ends_with(self, token: int) -> bool:
        """``token`` is a stop id drawn where the grammar may end: it ends the generation, unconsumed."""
        return self._may_end and token in self._stop_ids

    def _refused(self, token: int) -> GrammarError:
        return GrammarError(f"token {token} is not allowed by the grammar here: {self._matcher.get_error()}")

    def _failed(self) -> GrammarError | None:
        return GrammarError(f"the grammar failed: {self._matcher.get_error()}") if self._matcher.is_error() else None

    def _fix_end(self, row: np.ndarray) -> None:
        """Swap the tokenizer's EOS bits for this generation's stop ids; check something is allowed."""
        if failed := self._failed():
            raise failed
        self._may_end = self._end_bits(row)

    def _end_bits(self, row: np.ndarray) -> bool:
        """:meth:`_fix_end` on a mask of any state (one along a draft): whether the generation may end there."""
        may_end, allowed = self._end.apply(row[None], np.zeros(1, np.intp))
        if not allowed[0]:
            raise GrammarError(_NOTHING_ALLOWED)
        return bool(may_end[0])


@functools.cache
def _executor() -> Any:
    return _llguidance().LLExecutor()


def consume_all(draws: Sequence[tuple[GrammarMatcher, int, int]]) -> dict[int, GrammarError]:
    """Advance each matcher past its drawn token (``(matcher, token, row)``), in parallel on
    llguidance's threads (one by one costs ~0.1-0.3 ms a row). Returns the rows whose grammar refused
    its token, with why."""
    taken = [(m, token, i) for m, token, i in draws if not m.ends_with(token)]
    if not taken:
        return {}
    accepted = _executor().consume_token_par([(m._matcher, token) for m, token, _ in taken])
    return {i: m._refused(token) for (m, token, i), ok in zip(taken, accepted, strict=True) if not ok}


def fill_masks(matchers: Sequence[tuple[GrammarMatcher, int]], masks: np.ndarray) -> dict[int, GrammarError]:
    """Write each matcher's next-token mask into row ``i`` of ``masks`` (int32 ``[B, W]``), in
    parallel on llguidance's threads, then swap their end bits (all rows with the same end tokens at
    once: per row, that work cost more than llguidance's). Returns the rows whose grammar failed, with why."""
    from llguidance.numpy import fill_next_token_bitmask_par

    if not matchers:
        return {}  # llguidance refuses an empty batch
    fill_next_token_bitmask_par(_executor(), [(m._matcher, i) for m, i in matchers], masks)
    failed: dict[int, GrammarError] = {}
    alike: dict[int, list[tuple[GrammarMatcher, int]]] = {}
    for matcher, i in matchers:
        if error := matcher._failed():
            failed[i] = error
        else:
            alike.setdefault(id(matcher._end), []).append((matcher, i))
    for group in alike.values():
        may_end, allowed = group[0][0]._end.apply(masks, np.asarray([i for _, i in group]))
        for (matcher, i), end, ok in zip(group, may_end.tolist(), allowed.tolist(), strict=True):
            matcher._may_end = end
            if not ok:
                failed[i] = GrammarError(_NOTHING_ALLOWED)
    return failed


#: How long a grammar loop's exchange thread waits for the next loop before it ends.
SERVER_IDLE_S = 1.0


@functools.cache
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="zgen-grammar")


class GrammarLoop:
    """The constrained rows of a decode loop (:func:`~zgen.runtime.step.decode_loop`) and the hand-overs
    between the loop and a host worker, which let the host work overlap the device's:

    * :meth:`device_submit` — right after a draw: hands the drawn tokens to the host worker and goes
      on. The worker's grammars take them, then llguidance computes what may follow, while the device
      runs the next forward pass (which needs no mask);
    * :meth:`device_masks` — after that forward pass, right before its draw: the masks, once the
      worker has them, and the rows whose grammar completed (or failed) with the previous draw. Such
      a row draws nothing more: the loop ends it there, one iteration after the draw that completed it.

    On a CUDA GPU with :mod:`zgen.runtime.exchange` the two are copies through pinned memory and a
    stream wait, served by a host thread (:meth:`_serve`); elsewhere they are host callbacks
    (:meth:`submit`, :meth:`wait`), each of which synchronises the host with the device and enters
    Python (on an NVIDIA H200 the pair cost ~0.4 ms a token at SmolLM2's size, the exchange ~0.03).

    The first draw's masks are computed before the loop (:meth:`start`); after it, :meth:`finish`
    waits for the worker's last turn (the grammars then hold every kept token). One object serves an
    engine's loops, so the compiled loop that calls it stays the same; so does its exchange thread,
    which waits for the next loop until it has been idle :data:`SERVER_IDLE_S` seconds (starting a
    thread per loop cost ~0.2 ms, against ~0.5 ms a token at SmolLM2's size).
    """

    def __init__(self, vocab_size: int, *, one_device: bool = True) -> None:
        self.words = mask_words(vocab_size)
        self.one_device = one_device  # a loop split over several devices would run the exchange on each
        self.rows: list[tuple[GrammarMatcher, int]] = []
        self.failures: dict[int, GrammarError] = {}
        self._pending: Future[tuple[np.ndarray, np.ndarray]] | None = None
        self._channels: dict[int, exchange.Channel] = {}  # per loop width, made when a loop is traced
        self._loops: queue.SimpleQueue[tuple[exchange.Channel, int]] = queue.SimpleQueue()  # for the exchange thread
        self._server: threading.Thread | None = None  # the exchange thread, while it waits for or serves loops
        self._server_lock = threading.Lock()
        self._serving = False  # a loop of the exchange thread is under way (start() until finish())
        self._stop = threading.Event()  # the loop is over: its last draw is all the thread still takes
        self._served = threading.Event()  # ... and the thread took it
        self._server_error: BaseException | None = None

    @functools.cached_property
    def exchanges(self) -> bool:
        """Whether loops hand draws and masks over through :mod:`zgen.runtime.exchange` (one CUDA GPU)."""
        return self.one_device and exchange.available()

    def start(self, rows: Sequence[tuple[GrammarMatcher, int]], width: int) -> dict[int, GrammarError]:
        """The next loop's constrained rows (``(matcher, row index)`` of ``width``) and their first
        masks. Returns the rows whose grammar failed already (they must not run)."""
        masks = np.full((width, self.words), -1, np.int32)
        self.rows, self.failures = list(rows), fill_masks(rows, masks)
        ended = np.zeros(width, bool)
        if self.exchanges:
            channel = self._channel(width)
            channel.reset(0)  # the loop's draws send their step counts, 1, 2, ...
            self._answer(channel, masks, ended)
            self._stop.clear()
            self._served.clear()
            self._serving = True
            with self._server_lock:
                self._loops.put((channel, width))
                if self._server is None:
                    self._server = threading.Thread(target=self._serve_loops, name="zgen-grammar-exchange", daemon=True)
                    self._server.start()
        else:
            self._pending = Future()
            self._pending.set_result((masks, ended))
        return dict(self.failures)

    def finish(self) -> dict[int, GrammarError]:
        """After the loop: wait for the worker, then the rows whose grammar failed in the loop, with why."""
        if self._serving:
            self._stop.set()
            for channel in self._channels.values():
                channel.wake()
            self._served.wait()
            self._serving, error, self._server_error = False, self._server_error, None
            if error is not None:
                raise error  # a bug in the worker (grammars' refusals are failures): the step fails
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # raises only a bug (grammars' refusals are failures): the step fails
        failures = self.failures
        self.rows, self.failures = [], {}
        return failures

    # -- on the device (traced into the loop) -----------------------------------------------------

    def device_masks(
        self, after: Array, ticket: Int[Array, ""], width: int
    ) -> tuple[Int[Array, "B W"], Bool[Array, " B"]]:
        """The masks of this iteration's draw and the rows whose grammar ended with the last one, once
        ``after`` (a value of the forward pass) is computed and the hand-over that gave ``ticket``
        (:meth:`device_submit`'s, or :meth:`first_ticket` before the loop's first draw) is done."""
        if self.exchanges:
            answer = exchange.receive(self._channel(width), after, ticket, (width * (self.words + 1),))
            return answer[: width * self.words].reshape(width, self.words), answer[width * self.words :] != 0
        shapes = (jax.ShapeDtypeStruct((width, self.words), jnp.int32), jax.ShapeDtypeStruct((width,), jnp.bool_))
        mask, ended = io_callback(self.wait, shapes, after.reshape(-1)[0], ordered=True)
        return mask, ended

    def device_submit(
        self, drawn: Int[Array, " B"], live: Bool[Array, " B"], masks_wanted: Bool[Array, " B"], step: Int[Array, ""]
    ) -> Int[Array, ""]:
        """Hand a draw to the host worker (``step``: the draws so far in this loop, 1 after the first).
        Returns the ticket the next :meth:`device_masks` takes."""
        if self.exchanges:
            payload = jnp.concatenate([drawn, live.astype(jnp.int32), masks_wanted.astype(jnp.int32)])
            return exchange.send(self._channel(drawn.shape[0]), payload, step)
        io_callback(self.submit, None, drawn, live, masks_wanted, ordered=True)  # ordered: no ticket needed
        return self.first_ticket()

    @staticmethod
    def first_ticket() -> Int[Array, ""]:
        """The ticket of a loop's first draw (its masks come from :meth:`start`)."""
        return jnp.zeros((), jnp.int32)

    # -- host callbacks (no exchange) -------------------------------------------------------------

    def submit(self, drawn: np.ndarray, live: np.ndarray, masks_wanted: np.ndarray) -> None:
        """Callback after a draw: the grammars of the ``live`` rows take their ``drawn`` tokens, then
        the rows in ``masks_wanted`` (those that draw again in this loop) get their next masks."""
        self._pending = _worker().submit(self._advance, np.array(drawn), np.array(live), np.array(masks_wanted))

    def wait(self, after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Callback before a draw: ``(masks [B, W], grammar ended [B])`` of the last :meth:`submit`.
        ``after`` is any value of the forward pass, so that XLA schedules this wait after it."""
        assert self._pending is not None, "a grammar loop waited with nothing submitted"
        return self._pending.result()

    # -- the host worker ----------------------------------------------------------------------------

    def _channel(self, width: int) -> exchange.Channel:
        if width not in self._channels:
            self._channels[width] = exchange.Channel(3 * width, width * (self.words + 1))
        return self._channels[width]

    def _answer(self, channel: exchange.Channel, masks: np.ndarray, ended: np.ndarray) -> None:
        width = len(ended)
        channel.outbox[: width * self.words] = masks.reshape(-1)
        channel.outbox[width * self.words : width * (self.words + 1)] = ended
        channel.answer()

    def _serve_loops(self) -> None:
        """The exchange's host thread: serves each loop :meth:`start` hands it, then waits for the
        next one; returns once it has waited :data:`SERVER_IDLE_S` seconds for nothing."""
        while True:
            try:
                channel, width = self._loops.get(timeout=SERVER_IDLE_S)
            except queue.Empty:
                with self._server_lock:  # start() hands a loop over under this lock: none may be missed
                    if self._loops.empty():
                        self._server = None
                        return
                continue
            try:
                self._serve(channel, width)
            except BaseException as err:  # noqa: BLE001 - reported by finish(), which must not wait forever
                self._server_error = self._server_error or err
            finally:
                self._served.set()

    def _serve(self, channel: exchange.Channel, width: int) -> None:
        """One loop of the exchange's host thread: each draw the device sends gets the next masks.
        Every send is answered, also after an error (then every row ends), so the device never waits
        for nothing; after :meth:`finish` asks it to stop, it takes the loop's last draw and returns."""
        last, stopping = 0, False
        while True:
            sent = channel.wait(last, 0.0 if stopping else 0.05)
            if sent == last:
                if stopping:
                    return
                stopping = self._stop.is_set()  # the loop is over: one last look for its final draw
                continue
            last = sent
            drawn, live, wanted = channel.inbox[: 3 * width].reshape(3, width).copy()
            try:
                masks, ended = self._advance(drawn, live != 0, wanted != 0)
            except BaseException as err:  # noqa: BLE001 - reported by finish(); the device must still go on
                self._server_error = self._server_error or err
                masks, ended = np.zeros((width, self.words), np.int32), np.ones(width, bool)
            self._answer(channel, masks, ended)

    def _advance(self, drawn: np.ndarray, live: np.ndarray, masks_wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The worker's turn: the grammars take a draw, then the next masks: ``(masks, grammar ended)``."""
        masks = np.full((len(drawn), self.words), -1, np.int32)
        ended = np.zeros(len(drawn), bool)
        draws = [(m, int(drawn[i]), i) for m, i in self.rows if live[i] and i not in self.failures]
        self.failures.update(consume_all(draws))
        going = [(m, i) for m, _, i in draws if masks_wanted[i] and i not in self.failures and not m.complete]
        self.failures.update(fill_masks(going, masks))
        for m, _, i in draws:  # the row ends here (a failed one fails after the loop)
            ended[i] = m.complete or i in self.failures
        return masks, ended


class GrammarDrafts:
    """The constrained rows of a speculative loop (:mod:`zgen.runtime.speculation`) and its two host
    callbacks per pass:

    * :meth:`draft_masks` — after drafting: each row's token mask at every position the pass verifies
      (its pending token, then each drafted token), computed along the draft by llguidance's threads,
      which roll the grammars back after (they are unchanged);
    * :meth:`take` — after acceptance: each grammar takes the tokens its row keeps, one depth at a time
      over all rows; a row keeps nothing past the token that completes (or breaks) its grammar.

    A drafted token the grammar refuses needs no check of its own: the mask before it excludes it, so
    the target's masked draw never equals it and rejection sampling never accepts it. Past such a token,
    or past the grammar's end, positions have no mask (every token allowed), and :meth:`take` keeps no
    token drawn there. One object serves an engine's loops (:meth:`start` / :meth:`finish` around each),
    so the compiled loop that calls it stays the same.
    """

    def __init__(self, vocab_size: int) -> None:
        self.words = mask_words(vocab_size)
        self.rows: list[tuple[GrammarMatcher, int]] = []
        self.failures: dict[int, GrammarError] = {}
        self._may_end: dict[int, list[bool]] = {}  # per row: may the generation end, at each masked position

    def start(self, rows: Sequence[tuple[GrammarMatcher, int]]) -> None:
        """The next loop's constrained rows: ``(matcher, row index)``."""
        self.rows, self.failures, self._may_end = list(rows), {}, {}

    def finish(self) -> dict[int, GrammarError]:
        """After the loop: the rows whose grammar failed in it, with why."""
        failures = self.failures
        self.rows, self.failures, self._may_end = [], {}, {}
        return failures

    def draft_masks(self, drafts: np.ndarray, count: np.ndarray, active: np.ndarray) -> np.ndarray:
        """Masks ``[B, K + 1, W]``: row ``i``'s at position ``j`` says what may follow its first ``j``
        drafted tokens (of ``count[i]``); -1 (all allowed) where no grammar or no mask applies."""
        from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        drafts, count, active = np.asarray(drafts), np.asarray(count), np.asarray(active)
        b, k = drafts.shape
        masks = np.zeros((b, k + 1, self.words), np.int32)
        flat = masks.reshape(b * (k + 1), self.words)
        going = [(m, i) for m, i in self.rows if active[i] and i not in self.failures]
        along = [(m._matcher, i * (k + 1), drafts[i, : count[i]].tolist()) for m, i in going if count[i] > 0]
        if along:
            fill_next_token_bitmask_par_with_draft_tokens(_executor(), along, flat)
        if alone := [(m._matcher, i * (k + 1)) for m, i in going if count[i] <= 0]:  # llguidance wants a draft above
            fill_next_token_bitmask_par(_executor(), alone, flat)
        known = np.zeros((b, k + 1), bool)
        self._may_end = {}
        for m, i in going:
            try:
                m._fix_end(masks[i, 0])
            except GrammarError as err:
                self.failures[i] = err
                continue
            may_end = [m._may_end]
            for j in range(1, int(count[i]) + 1):
                if not masks[i, j].any():
                    break  # the draft left the grammar (a refused token, or its end): no mask from here
                try:
                    may_end.append(m._end_bits(masks[i, j]))
                except GrammarError:
                    break  # nothing may follow here: a row that keeps the token before fails in take()
            self._may_end[i] = may_end
            known[i, : len(may_end)] = True
        masks[~known] = -1
        return masks

    def take(self, produced: np.ndarray, keep: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each constrained row's grammar takes its first ``keep`` tokens of ``produced [B, K + 1]``.
        Returns how many each row keeps (fewer where its grammar completes or fails within them) and the
        rows that end here (grammar complete, or failed: :meth:`finish` says why)."""
        produced, keep, active = np.asarray(produced), np.array(keep, np.int32), np.asarray(active)
        ends = np.zeros(len(keep), bool)
        going: list[tuple[GrammarMatcher, int]] = []
        for m, i in self.rows:
            if active[i] and i in self.failures:
                keep[i], ends[i] = 0, True
            elif active[i]:
                going.append((m, i))
        depth = 0
        while going:
            draws: list[tuple[GrammarMatcher, int, int]] = []
            for m, i in going:
                if depth >= keep[i]:
                    continue
                may_end = self._may_end[i]
                if depth >= len(may_end):
                    # Drawn where no mask was known: the grammar (neither complete nor refusing the
                    # token before) allows nothing here. Keep up to here; the true mask says why.
                    keep[i] = depth
                    failed = fill_masks([(m, 0)], np.zeros((1, self.words), np.int32))
                    if failed:
                        self.failures[i], ends[i] = failed[0], True
                    continue
                m._may_end = may_end[depth]
                token = int(produced[i, depth])
                if not m.ends_with(token):  # a stop id where the grammar may end: the loop's stop rule ends the row
                    draws.append((m, token, i))
            refused = consume_all(draws)
            going = []
            for m, _, i in draws:
                if i in refused or m.complete:
                    keep[i], ends[i] = depth + 1, True
                    if i in refused:
                        self.failures[i] = refused[i]
                else:
                    going.append((m, i))
            depth += 1
        return keep, ends
