"""Tests of zgen.stopping: stop strings over arbitrarily split text, and composing stop conditions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zgen.errors import ConfigError
from zgen.sampling import SamplingConfig
from zgen.stopping import MaxNewTokens, StopCriteria, StopStringMatcher, StopStrings, StopTokens


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
    c = MaxNewTokens(10) | StopTokens([1, 2]) | StopStrings(["x", "y"])
    assert c == StopCriteria(max_new_tokens=10, token_ids=frozenset({1, 2}), strings=("x", "y"))
    assert (StopStrings("x") | StopTokens(3)).max_new_tokens is None
    assert (MaxNewTokens(10) | MaxNewTokens(4)).max_new_tokens == 4  # whichever comes first
    a = StopTokens([1]) | StopStrings(["x"])
    b = StopTokens([1, 5]) | StopStrings(["y", "x"])
    assert (a | b) == StopCriteria(token_ids=frozenset({1, 5}), strings=("x", "y"))
    assert ((a | b) | MaxNewTokens(3)) == (a | (b | MaxNewTokens(3)))  # associative
    assert StopTokens([4]).criteria() == StopCriteria(token_ids=frozenset({4}))
    assert c.matcher().stops == ("x", "y")
    hash(c)


@pytest.mark.parametrize(
    "make",
    [
        lambda: MaxNewTokens(0),
        lambda: MaxNewTokens(True),
        lambda: StopTokens([-1]),
        lambda: StopTokens(["3"]),  # type: ignore[list-item]
        lambda: StopStrings([""]),
        lambda: StopCriteria(max_new_tokens=-2),
    ],
)
def test_invalid_stop_conditions_raise(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_criteria_from_sampling_config() -> None:
    eos = [2, 7]
    c = StopCriteria.from_sampling_config(SamplingConfig(max_new_tokens=12, stop=("##",)), eos)
    assert c == StopCriteria(max_new_tokens=12, token_ids=frozenset(eos), strings=("##",))
    assert StopCriteria.from_sampling_config(SamplingConfig(ignore_eos=True), eos).token_ids == frozenset()
    c = StopCriteria.from_sampling_config(SamplingConfig(stop_token_ids=(9,), ignore_eos=True), eos)
    assert c.token_ids == frozenset({9})
