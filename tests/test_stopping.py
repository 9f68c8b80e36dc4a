"""Tests of zgen.stopping: stop strings over arbitrarily split text, and composing stop conditions."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zgen.errors import ConfigError
from zgen.runtime import stop
from zgen.runtime.sampling import SamplingConfig
from zgen.runtime.stop import StopCondition, StopStringMatcher, TextStream
from zgen.tokenizer import Tokenizer


def reference_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Text before the first stop string to be completed (earliest end; at equal ends the longest)."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
            best = (i + len(s), -len(s), s)
    if best is None:
        return text, None
    return text[: best[0] + best[1]], best[2]


def feed(stops: list[str], pieces: list[str]) -> tuple[str, bool, StopStringMatcher]:
    """Feed pieces until the matcher stops; returns (all emitted text, stopped, matcher)."""
    m = StopStringMatcher(stops)
    out: list[str] = []
    fed = ""
    for piece in pieces:
        fed += piece
        emitted, stopped = m.push(piece)
        out.append(emitted)
        if stopped:
            return "".join(out), True, m
        # nothing is held back that could not start a stop string, and nothing is lost
        assert "".join(out) + m.held == fed
        assert len(m.held) < max((len(s) for s in stops), default=1)
    out.append(m.flush())
    return "".join(out), False, m


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(text[last:p])
        last = p
    pieces.append(text[last:])
    return pieces


alphabet = st.sampled_from("ab c\n")
texts = st.text(alphabet, max_size=40)
stop_sets = st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=4)


@settings(max_examples=300, deadline=None)
@given(text=texts, stops=stop_sets, cuts=st.lists(st.integers(0, 40), max_size=12))
def test_emitted_text_is_text_before_first_match(text: str, stops: list[str], cuts: list[int]) -> None:
    want, match = reference_cut(text, stops)
    got, stopped, m = feed(stops, split(text, cuts))
    assert got == want
    assert stopped == (match is not None)
    assert m.matched == match


@settings(max_examples=150, deadline=None)
@given(text=texts, stops=stop_sets, cuts=st.lists(st.integers(0, 40), max_size=12))
def test_held_text_is_the_longest_possible_stop_start(text: str, stops: list[str], cuts: list[int]) -> None:
    m = StopStringMatcher(stops)
    fed = ""
    for piece in split(text, cuts):
        fed += piece
        _, stopped = m.push(piece)
        if stopped:
            break
        # held == the longest suffix of the text so far that is a proper prefix of a stop string
        longest = max(
            (n for n in range(1, len(fed) + 1) for s in stops if len(s) > n and s.startswith(fed[-n:])),
            default=0,
        )
        assert m.held == fed[len(fed) - longest :]


def test_stop_string_spanning_pieces() -> None:
    m = StopStringMatcher(["</s>"])
    assert m.push("Hello <") == ("Hello ", False)
    assert m.held == "<"
    assert m.push("/") == ("", False)
    assert m.push("s") == ("", False)
    assert m.push("> trailing") == ("", True)
    assert m.matched == "</s>"
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_false_start_is_released() -> None:
    m = StopStringMatcher(["</s>"])
    assert m.push("a </") == ("a ", False)
    assert m.push("b>") == ("</b>", False)
    assert m.push("<") == ("", False)
    assert m.flush() == "<"


def test_overlapping_stop_strings() -> None:
    # "b" is complete (at char 3) before "abc" (at char 4)
    assert feed(["abc", "b"], ["x", "a", "b", "c"])[0] == "xa"
    assert feed(["abc", "b"], ["xabc"])[0] == "xa"
    # at the same end the longer one wins: it starts earlier
    out, _, m = feed(["b", "ab"], ["xa", "b"])
    assert (out, m.matched) == ("x", "ab")
    # "abcd" and "bcx": the second completes first in "abcx"
    assert feed(["abcd", "bcx"], ["ab", "c", "x"])[0] == "a"
    # a stop string that overlaps itself
    assert feed(["aab"], ["a", "a", "a", "a", "b", "!"])[0] == "aa"


def test_no_stops_passes_text_through() -> None:
    m = StopStringMatcher([])
    assert m.push("anything") == ("anything", False)
    assert m.flush() == ""


def test_matcher_rejects_empty_stop_string() -> None:
    with pytest.raises(ConfigError):
        StopStringMatcher(["ok", ""])


def test_composition_with_or() -> None:
    c = stop.max_len(10) | stop.ends_with_any([1, 2]) | stop.ends_with_text("x") | stop.ends_with_text("y")
    assert c == StopCondition(max_tokens=10, sequences=((1,), (2,)), strings=("x", "y"))
    assert (stop.ends_with_text("x") | stop.ends_with(3)).max_tokens is None
    assert (stop.max_len(10) | stop.max_len(4)).max_tokens == 4  # whichever comes first
    a = stop.ends_with(1) | stop.ends_with_text("x")
    b = stop.ends_with_any([1, [5, 6]]) | stop.ends_with_text("y") | stop.ends_with_text("x")
    assert (a | b) == StopCondition(sequences=((1,), (5, 6)), strings=("x", "y"))  # duplicates merged
    assert ((a | b) | stop.max_len(3)) == (a | (b | stop.max_len(3)))  # associative
    assert (a | b).device_token_ids == (1,) and (a | b).needs_host
    assert not stop.ends_with_any([4, 5]).needs_host
    hash(c)


@pytest.mark.parametrize(
    "make",
    [
        lambda: stop.max_len(0),
        lambda: stop.max_len(True),  # type: ignore[arg-type]
        lambda: stop.ends_with(-1),
        lambda: stop.ends_with(2**40),  # ids live in int32 on the device
        lambda: stop.ends_with(["3"]),  # type: ignore[list-item]
        lambda: stop.ends_with([]),
        lambda: stop.ends_with_any([]),
        lambda: stop.ends_with_text(""),
        lambda: StopCondition(max_tokens=-2),
    ],
)
def test_invalid_stop_conditions_raise(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_condition_from_sampling_config() -> None:
    eos = [2, 7]
    c = StopCondition.from_sampling(SamplingConfig(max_new_tokens=12, stop=("##",)), eos)
    assert c == StopCondition(max_tokens=12, sequences=((2,), (7,)), strings=("##",))
    assert StopCondition.from_sampling(SamplingConfig(ignore_eos=True), eos).sequences == ()
    c = StopCondition.from_sampling(SamplingConfig(stop_token_ids=(9,), ignore_eos=True), eos)
    assert c.device_token_ids == (9,)


# -- TextStream: the tokens and text one generation emits -------------------------------------------


@pytest.fixture(scope="module")
def letters() -> Tokenizer:
    """A word-level tokenizer whose token i decodes to one letter (so text positions are token positions)."""
    import tokenizers
    from tokenizers.models import WordLevel

    vocab = {chr(ord("a") + i): i for i in range(26)}
    backend = tokenizers.Tokenizer(WordLevel(vocab, unk_token="a"))
    backend.decoder = tokenizers.decoders.Fuse()
    return Tokenizer(backend=backend, bos_id=None, eos_ids=(25,))


def _run(tokenizer: Tokenizer, condition: StopCondition, tokens: list[int], incremental: bool = True) -> tuple[TextStream, str]:
    """Push ``tokens`` one by one until the stream stops; the text pieces it released, joined."""
    text = TextStream(tokenizer, condition, incremental=incremental)
    out = ""
    for token in tokens:
        out += text.push(token)
        if text.done:
            break
    out += text.finish()
    return text, out


def test_text_stream_cuts_token_sequences_and_strings(letters: Tokenizer) -> None:
    abc = [0, 1, 2, 3, 4]  # "abcde"
    text, out = _run(letters, stop.ends_with([2, 3]), abc)
    assert (text.tokens, out, text.text, text.finish_reason) == ([0, 1, 2, 3], "ab", "ab", "stop")
    text, out = _run(letters, stop.ends_with_text("cd"), abc)
    assert (text.tokens, out, text.finish_reason) == ([0, 1, 2, 3], "ab", "stop")
    text, out = _run(letters, stop.max_len(3), abc)
    assert (text.tokens, out, text.finish_reason) == ([0, 1, 2], "abc", "length")
    # A false start of a sequence is released once the next token decides it.
    text, out = _run(letters, stop.ends_with([2, 9]), abc)
    assert (out, text.finish_reason) == ("abcde", "length")
    # Tokens held for one sequence are released when another sequence completes after them.
    text, out = _run(letters, stop.ends_with([0, 9]) | stop.ends_with(1), abc)
    assert (text.tokens, out, text.finish_reason) == ([0, 1], "a", "stop")


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    sequences=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=2),
    strings=st.lists(st.text(alphabet="abcdef", min_size=1, max_size=3), max_size=2),
)
@example(tokens=[1, 0], sequences=[[0], [1, 0]], strings=[])  # two sequences end together: the longer goes
def test_text_stream_equals_the_text_of_the_kept_tokens(tokens: list[int], sequences: list[list[int]], strings: list[str]) -> None:
    """Whatever the stops, the streamed text is the decoded kept tokens, minus a completed sequence,
    cut before the first stop string."""
    import tokenizers
    from tokenizers.models import WordLevel

    backend = tokenizers.Tokenizer(WordLevel({chr(ord("a") + i): i for i in range(26)}, unk_token="a"))
    backend.decoder = tokenizers.decoders.Fuse()
    tokenizer = Tokenizer(backend=backend, bos_id=None, eos_ids=())
    condition = StopCondition(sequences=tuple(tuple(s) for s in sequences), strings=tuple(strings))
    text, out = _run(tokenizer, condition, tokens)
    kept = text.tokens
    assert kept == tokens[: len(kept)]
    body = kept
    ended = [s for s in condition.sequences if tuple(kept[-len(s) :]) == s and len(kept) >= len(s)]
    matched = max(ended, key=len) if ended else None  # the longest of the sequences ending together
    if matched is not None and text.finish_reason == "stop":
        body = kept[: len(kept) - len(matched)]
    decoded = "".join(chr(ord("a") + t) for t in body)
    # The first string completed wins (earliest end, the longest at a tie); the text stops before it.
    ends = [(decoded.index(s) + len(s), -len(s)) for s in strings if s in decoded]
    cut = min(ends)[0] + min(ends)[1] if ends else len(decoded)
    assert out == text.text == decoded[:cut]
    once, _ = _run(tokenizer, condition, tokens, incremental=False)  # decoded once at the end instead
    assert (once.tokens, once.text, once.finish_reason) == (text.tokens, text.text, text.finish_reason)
