"""Each context example (examples/contexts/) runs and shows what it claims: on SmolLM2 where the claim
is about the text (the validated answer), else on the two-layer chat model (SmolLM2's tokenizer and
chat template, random weights): pages, passes, forks and orderings are the engine's, at a fraction of
the compile time."""

from __future__ import annotations

import os
import runpy
from pathlib import Path
from typing import Any

import pytest

from zgen.cache.paged_manager import PagedKVManager
from zgen.contexts import default_engine
from zgen.model import Model

EXAMPLES = Path(__file__).parents[2] / "examples" / "contexts"


def run(name: str, model: Model, **kw: Any) -> Any:
    return runpy.run_path(str(EXAMPLES / f"{name}.py"))["main"](model, **kw)


def test_prefix_caching(small_chat: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    monkeypatch.setenv("ZGEN_STORE_DIR", str(store))
    result = run("prefix_caching", small_chat)
    assert result.system_tokens > 80
    assert all(0 < fed < 30 for fed in result.fed_per_question)  # only the question, never the system prompt
    assert all(answer.strip() for answer in result.answers)
    # It saved into a temporary store of its own, deleted afterwards, and left the user's setting alone.
    assert os.environ["ZGEN_STORE_DIR"] == str(store) and not store.exists()


def test_parallel_forks(small_chat: Model) -> None:
    result = run("parallel_forks", small_chat)
    assert len(set(result.texts)) == 3
    assert result.forward_passes <= 30  # three 24-token endings, decoded together
    assert result.shared_pages == result.opening_pages >= 2  # every full page of the opening is shared
    # The opening's pages are held once, not once per context (root + 3 forks).
    assert result.pages_unshared - result.pages_held == 3 * result.opening_pages


def test_best_of_n(small_chat: Model) -> None:
    result = runpy.run_path(str(EXAMPLES / "best_of_n.py"))
    out = result["main"](small_chat)
    assert len(out.candidates) == 4 and len({tuple(c.token_ids) for c in out.candidates}) > 1
    assert out.best is max(out.candidates, key=result["mean_logprob"])


def test_tree_of_thought(small_chat: Model) -> None:
    kv = default_engine(small_chat).kv
    assert isinstance(kv, PagedKVManager)
    pool = kv.pool
    free = pool.num_free
    frontier = run("tree_of_thought", small_chat)
    assert len(frontier) == 2 and all(len(node.path) == 2 and all(node.path) for node in frontier)
    assert frontier[0].score >= frontier[1].score
    for node in frontier:
        node.ctx.release()
    assert pool.num_free == free  # expanded, pruned and finished branches gave every page back


def test_beam_search(small_chat: Model) -> None:
    beams = run("beam_search", small_chat, steps=5)  # also checks width 1 == greedy
    assert len(beams) == 3 and all(len(b.tokens) == 5 for b in beams)
    assert [b.logprob for b in beams] == sorted((b.logprob for b in beams), reverse=True)


def test_attention_sink(small_chat: Model) -> None:
    result = run("attention_sink", small_chat, window=32, total=96)  # 3x the window: pages are dropped twice over
    assert result.tokens >= 96 and result.max_pages <= result.bound_pages
    assert result.text.strip() and "<|" not in result.text  # clean text, no chat-template tokens


def test_output_validation(smollm2: Model) -> None:
    result = run("output_validation", smollm2)
    assert result.answer == max(result.probabilities, key=result.probabilities.get) == "Paris"
    assert 0 < sum(result.probabilities.values()) <= 1


def test_speculative_ngram(small_chat: Model) -> None:
    result = run("speculative_ngram", small_chat)  # also checks identical output
    assert result.drafted_passes < result.plain_passes
