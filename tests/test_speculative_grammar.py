"""Speculative decoding under grammars: drafts are checked against each row's grammar, so constrained
rows give plain constrained decoding's tokens (greedy, and sampling with deterministic drafts) or its
distribution (sampled drafts), and every output matches its grammar."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_grammar import SCHEMAS, assert_valid, tiny  # noqa: F401 - the tiny model with a real vocabulary
from test_speculative import _assert_follows
from zgen import Context, Engine, Generator, Grammar, Request, SamplingConfig
from zgen.cache.factory import paged_kv
from zgen.errors import GrammarError, InputError
from zgen.model import Model
from zgen.runtime.grammar import allowed_tokens
from zgen.runtime.sampling import SamplingFlags, SamplingParams, filter_logits
from zgen.runtime.speculation import Proposal, verify
from zgen.speculative import DraftModel, Jacobi, PromptLookup

REGEXES = {  # prompts that repeat what the grammar asks for: prompt lookup drafts it
    r"(abc ){6}": "abc abc abc",
    r"(yes|no)!": "yes! yes! yes!",
    r"[0-9]{3}-[a-z]{2,4}": "go",
}

def _requests(temperature: float) -> list[Request]:
    """Constrained rows and an unconstrained one."""
    def config(grammar: Grammar, seed: int) -> SamplingConfig:
        return SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=40, grammar=grammar)

    requests = [Request("hello", config(Grammar.json_schema(schema, compact=True), n)) for n, schema in enumerate(SCHEMAS.values())]
    requests += [Request(prompt, config(Grammar.regex(pattern), 7)) for pattern, prompt in REGEXES.items()]
    return [*requests, Request("w x y", SamplingConfig(temperature=temperature, seed=3, max_new_tokens=12, ignore_eos=True))]


def _assert_match(results: list, requests: list[Request]) -> None:
    for result, request in zip(results, requests, strict=True):
        grammar = request.sampling.grammar
        if grammar is None:
            continue
        assert result.finish_reason == "stop", result.text  # the grammar ended it, complete
        if grammar.kind == "json_schema":
            assert_valid(result.text, next(s for s in SCHEMAS.values() if Grammar.json_schema(s, compact=True) == grammar))
        else:
            assert re.fullmatch(grammar.source, result.text), (grammar.source, result.text)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_constrained_rows_speculate_to_plain_constrained_tokens(tiny: Model, temperature: float) -> None:  # noqa: F811
    requests = _requests(temperature)
    plain = Generator(tiny, max_batch_size=16).batch_generate(requests)
    _assert_match(plain, requests)
    for speculator in (PromptLookup(2, 4), DraftModel.early_exit(tiny, layers=1, num_tokens=3), Jacobi(4)):
        out = Generator(tiny, max_batch_size=16, speculative=speculator).batch_generate(requests)
        _assert_match(out, requests)
        stats = [r.speculative for r in out]
        assert sum(s.steps for s in stats if s is not None) > 0, speculator  # (rows done in one token have none)
        # Deterministic drafts (prompt lookup, Jacobi) and greedy rows give plain decoding's exact
        # tokens; a sampled draft model follows the same (masked) distribution, checked on verify() below.
        if temperature == 0.0 or not isinstance(speculator, DraftModel):
            assert [r.token_ids for r in out] == [r.token_ids for r in plain], speculator


def test_prompt_lookup_drafts_are_accepted_and_cut_where_the_grammar_ends(tiny: Model) -> None:  # noqa: F811
    """The prompt repeats what the grammar forces: the drafts are accepted, several tokens a pass, and
    a draft running past the grammar's end is cut there (the generation stops with the grammar)."""
    gen = Generator(tiny)
    spec = Generator(tiny, speculative=PromptLookup(2, 6))
    stats = []
    for pattern, prompt in ((r"(abc ){8}", "abc abc abc abc"), (r"abc( abc){3}", "abc abc abc abc abc abc")):
        config = SamplingConfig(temperature=0.0, max_new_tokens=40, grammar=Grammar.regex(pattern))
        result = spec.generate(prompt, config)
        assert result.token_ids == gen.generate(prompt, config).token_ids
        assert re.fullmatch(pattern, result.text) and result.finish_reason == "stop"
        assert result.speculative is not None and result.speculative.accepted_tokens > 0, result.speculative
        stats.append(result.speculative)
    assert stats[0].mean_accepted_per_step > 1.0
    # One pass drafts " abc" x6: the grammar ends after the third, where the pass is cut.
    assert (stats[1].draft_tokens, stats[1].accepted_tokens, stats[1].steps) == (6, 3, 1)


def test_many_constrained_rows_speculate_together_to_plain_tokens(tiny: Model) -> None:  # noqa: F811
    """Many constrained rows (no row limit) speculate in one loop: plain constrained decoding's tokens."""
    config = SamplingConfig(temperature=0.0, max_new_tokens=12, grammar=Grammar.regex(r"[a-c]{2}-[0-9]{2}"))
    requests = [Request(f"p{n}", config) for n in range(9)]
    plain = Generator(tiny, max_batch_size=16).batch_generate(requests)
    out = Generator(tiny, max_batch_size=16, speculative=PromptLookup(2, 4)).batch_generate(requests)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert all(re.fullmatch(r"[a-c]{2}-[0-9]{2}", r.text) for r in out)


def test_bad_grammars_fail_before_compute_with_a_speculator(tiny: Model) -> None:  # noqa: F811
    engine = Engine(tiny, paged_kv(8))
    ctx = Context(engine)
    ctx.fill("hello")
    gen = Generator(tiny, speculative=PromptLookup())
    with pytest.raises(GrammarError):
        gen.generate("hello", SamplingConfig(grammar=Grammar.json_schema({"type": "foo"})))
    with pytest.raises(InputError, match="grammar"):
        ctx.forward().sample([0], SamplingConfig(grammar=Grammar.regex("[0-9]"))).execute()
    assert engine.stats.steps == 0 and gen.engine.stats.steps == 0


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 4)])
def test_rejection_sampling_keeps_the_masked_target_distribution(temperature: float, top_k: int) -> None:
    """verify() with a grammar's masks, vocabulary 6: drafts from a distribution that puts mass on
    refused tokens; the produced tokens follow the target's distribution within the mask at each
    position (chi-square, as in test_speculative) and are never refused tokens."""
    rows, vocab, k = 40_000, 6, 2
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(1, k + 1, vocab)) * 1.5, jnp.float32)
    allow = np.array([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
    packed = jnp.asarray((allow.astype(np.int32) << np.arange(vocab)).sum(axis=1, keepdims=True), jnp.int32)
    allowed = allowed_tokens(packed, vocab)
    assert np.array_equal(np.asarray(allowed), allow)
    q = rng.dirichlet(np.ones(vocab), size=k).astype(np.float32)
    drafts = np.stack([rng.choice(vocab, size=rows, p=q[i] / q[i].sum()) for i in range(k)], axis=1)
    config = SamplingConfig(temperature=temperature, top_k=top_k)
    sampling = SamplingParams.from_configs([config] * rows, vocab)
    flags = SamplingFlags.from_configs([config], vocab)
    keys = jnp.asarray(rng.integers(0, 2**32, size=(rows, 2), dtype=np.uint32))
    proposal = Proposal(jnp.asarray(drafts, jnp.int32), jnp.full(rows, k, jnp.int32), jnp.broadcast_to(jnp.asarray(q), (rows, k, vocab)))
    tokens, _, accepted = jax.jit(verify, static_argnames="flags")(
        jnp.broadcast_to(logits, (rows, k + 1, vocab)), proposal, proposal.count, jnp.zeros(rows, jnp.int32), sampling, keys,
        flags=flags, allowed=jnp.broadcast_to(allowed, (rows, k + 1, vocab)),
    )
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    one = jax.tree_util.tree_map(lambda x: jnp.repeat(x, k + 1), SamplingParams.from_configs([config], vocab))
    masked = jnp.where(allowed, logits[0], -jnp.inf)
    target = np.asarray(jax.nn.softmax(filter_logits(masked, one, None, flags)))
    assert 0.05 < accepted.mean() < 1.95  # both rejections and acceptances happen
    assert not np.any(accepted[drafts[:, 0] == 1] >= 1)  # a refused draft is never accepted
    _assert_follows(tokens[:, 0], target[0])
    _assert_follows(tokens[accepted >= 1, 1], target[1])


def test_sampled_draft_model_outputs_are_valid(tiny: Model) -> None:  # noqa: F811
    """A sampled draft of other weights (rejections and corrections under the mask): outputs match."""
    draft = dataclasses.replace(tiny, params={n: x * 0.5 for n, x in tiny.params.items()}, attachments={})
    requests = [r for r in _requests(1.0) if r.sampling.grammar is not None][::2]
    out = Generator(tiny, max_batch_size=16, speculative=DraftModel(draft, 3, adaptive=False)).batch_generate(requests)
    _assert_match(out, requests)
    stats = [r.speculative for r in out if r.speculative is not None]
    assert sum(s.draft_tokens for s in stats) > sum(s.accepted_tokens for s in stats) > 0


def test_contexts_and_streams_speculate_under_a_grammar(tiny: Model) -> None:  # noqa: F811
    schema = SCHEMAS["array"]
    config = SamplingConfig(temperature=0.8, seed=4, max_new_tokens=40, grammar=Grammar.json_schema(schema, compact=True))
    engine = Engine(tiny, paged_kv(8))

    def context() -> Context:
        ctx = Context(engine, seed=2)
        ctx.fill("[1,2,3] [1,2,3] [1,2,")
        return ctx

    plain = context().generate_result(config)
    ctx = context()
    result = ctx.generate_result(config, speculative=PromptLookup(2, 4))
    assert result.token_ids == plain.token_ids and result.speculative is not None
    assert_valid(result.text, schema)
    assert ctx.token_ids[-len(result.token_ids) :] == result.token_ids and ctx.kv_len == ctx.num_tokens - 1
    # A stream (the loop returns to the host every few passes) gives the same text.
    gen = Generator(tiny, speculative=PromptLookup(2, 4), sync_interval=2)
    assert "".join(gen.generate_stream("[1,2,3] [1,2,", config)) == Generator(tiny).generate("[1,2,3] [1,2,", config).text


def test_masks_along_drafts_are_the_stepwise_masks_and_grammars_take_only_kept_tokens(tiny: Model) -> None:  # noqa: F811
    """GrammarDrafts on its own: the masks it gives along a draft are those of consuming the draft one
    token at a time; past a refused token there is none; take() leaves each grammar as if it had
    consumed only the kept tokens, and cuts a row where its grammar completes."""
    from zgen.runtime.grammar import GrammarDrafts, GrammarMatcher, fill_masks, mask_words

    grammar, eos = Grammar.regex(r"(yes|no)! ok"), tiny.eos_token_ids[0]
    yes, bang, ok = tiny.tokenizer.encode("yes! ok")
    (zebra,) = tiny.tokenizer.encode(" zebra")
    words = mask_words(tiny.config.vocab_size)

    def stepwise(tokens: list[int]) -> list[np.ndarray]:
        matcher, masks = GrammarMatcher(grammar, tiny, (eos,)), []
        for token in [*tokens, None]:
            mask = np.zeros((1, words), np.int32)
            assert not fill_masks([(matcher, 0)], mask)
            masks.append(mask[0])
            if token is not None:
                matcher.consume(token)
        return masks

    matchers = [GrammarMatcher(grammar, tiny, (eos,)) for _ in range(3)]
    drafts = GrammarDrafts(tiny.config.vocab_size)
    drafts.start([(matchers[0], 0), (matchers[1], 1), (matchers[2], 3)])  # row 2 is unconstrained
    proposed = np.array([[yes, bang, ok, eos], [yes, zebra, bang, ok], [yes, bang, ok, ok], [yes, bang, 0, 0]], np.int32)
    masks = drafts.draft_masks(proposed, np.array([4, 4, 4, 2], np.int32), np.ones(4, bool))
    full = stepwise([yes, bang, ok])
    np.testing.assert_array_equal(masks[0, :4], full)  # after " ok": the grammar's end (the stop id only)
    np.testing.assert_array_equal(masks[1, :2], full[:2])
    np.testing.assert_array_equal(masks[3, :3], full[:3])
    # None past the refused " zebra", past the grammar's end, past the draft, or without a grammar.
    assert (masks[1, 2:] == -1).all() and (masks[0, 4] == -1).all() and (masks[3, 3:] == -1).all() and (masks[2] == -1).all()

    produced = np.array([[yes, bang, ok, eos, 0], [yes, bang, 0, 0, 0], [0] * 5, [yes, 0, 0, 0, 0]], np.int32)
    keep, ends = drafts.take(produced, np.array([5, 2, 5, 1], np.int32), np.ones(4, bool))
    assert keep.tolist() == [3, 2, 5, 1] and ends.tolist() == [True, False, False, False]
    assert not drafts.finish()
    for matcher, taken in ((matchers[1], [yes, bang]), (matchers[2], [yes])):  # nothing else consumed
        mask = np.zeros((1, words), np.int32)
        assert not fill_masks([(matcher, 0)], mask)
        np.testing.assert_array_equal(mask[0], stepwise(taken)[-1])
    assert matchers[0].complete
