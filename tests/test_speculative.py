"""Speculative decoding: lossless through every front end and cache kind, typed refusals, and the
rejection-sampling rule's output distribution."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_reference import hf_teacher_forced
from zgen import Generator, SamplingConfig
from zgen.cache.factory import CacheOption, compressed_kv, flat_kv, kv_dtype, paged_kv, tiered_kv
from zgen.config import ModelConfig
from zgen.contexts import Context, NgramDrafter
from zgen.errors import ConfigError
from zgen.model import Model, random_model
from zgen.runtime.engine import Engine
from zgen.runtime.runner import runner_for
from zgen.runtime.sampling import SamplingFlags, SamplingParams, filter_logits
from zgen.runtime.speculation import (
    PROBE_AFTER, TIMING_DRAWS, WINDOW, DraftControl, DraftInput, LoopTimes, Proposal, draft_cost, loop_key, pass_pays, probes, update_control,
    verify,
)
from zgen.runtime.stop import StopCondition
from zgen.speculative import DraftModel, Jacobi, PromptLookup

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)
# Repetitive prompts (prompt lookup finds matches) of different lengths (rows of a batch differ).
PROMPTS = ["w5 w9 w12 w5 w9 w12 w5 w9 w3", "w7 w8 w7 w8 w7", "w20 w21 w22 w23 w24 w25 w20 w21 w22 w30 w31"]


def _other_weights(model: Model, seed: int) -> Model:
    """The same shape and tokenizer with other random weights: a draft that guesses badly."""
    key = jax.random.key(seed)
    params = {name: jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype) * 0.3 for i, (name, x) in enumerate(model.params.items())}
    return dataclasses.replace(model, params=params, attachments={})


def _ids(results: Sequence[Any]) -> list[list[int]]:
    return [r.token_ids for r in results]


def test_greedy_equals_plain_and_hf_with_every_speculator(tiny_llama: Model, tiny_llama_checkpoint: tuple[Path, Any]) -> None:
    plain = Generator(tiny_llama).batch_generate([_request(p) for p in PROMPTS])
    hf = tiny_llama_checkpoint[1]
    for result in plain:
        chosen, _ = hf_teacher_forced(hf, result.prompt_token_ids, result.token_ids)
        assert chosen == result.token_ids  # plain greedy is HF's greedy in float32
    for speculator in (PromptLookup(3, 4), DraftModel.early_exit(tiny_llama, layers=1, num_tokens=3)):
        spec = Generator(tiny_llama, speculative=speculator).batch_generate([_request(p) for p in PROMPTS])
        assert _ids(spec) == _ids(plain), speculator
        for result, reference in zip(spec, plain, strict=True):
            assert result.speculative is not None and result.speculative.steps > 0
            assert result.logprobs == pytest.approx(reference.logprobs, abs=1e-4)


def _request(prompt: str, sampling: SamplingConfig = GREEDY) -> Any:
    from zgen.generator import Request

    return Request(prompt, sampling)


# Every KV format's write-then-roll-back exactness: property_tests/test_speculative_rollback.py; here the
# cache kinds end to end, with one coded format (q4: keys coded before they are stored).
@pytest.mark.parametrize(
    "options",
    [(flat_kv(),), (paged_kv(4),), (paged_kv(4), kv_dtype("q4")), (tiered_kv(),)],
    ids=["flat", "paged", "paged-q4", "tiered"],
)
def test_greedy_equals_plain_on_every_cache_kind(tiny_llama: Model, options: tuple[CacheOption, ...]) -> None:
    """A draft of other weights (kept drafting: not adaptive) has most drafts rejected and rolled back."""
    plain = Generator(tiny_llama, *options).batch_generate([_request(p) for p in PROMPTS])
    speculator = DraftModel(_other_weights(tiny_llama, 3), 4, adaptive=False)
    spec = Generator(tiny_llama, *options, speculative=speculator).batch_generate([_request(p) for p in PROMPTS])
    assert _ids(spec) == _ids(plain)
    stats = [r.speculative for r in spec if r.speculative is not None]
    assert sum(s.draft_tokens for s in stats) > sum(s.accepted_tokens for s in stats)


def test_a_draft_equal_to_the_target_is_always_accepted(tiny_llama: Model) -> None:
    """The draft's K/V stay in step with the target's, also after fully accepted drafts (whose last
    token the draft never fed): every draft of the target itself is accepted."""
    result = Generator(tiny_llama, speculative=DraftModel(tiny_llama, 4, adaptive=False)).generate(PROMPTS[0], GREEDY)
    stats = result.speculative
    assert stats is not None and stats.acceptance_rate == 1.0
    assert stats.mean_accepted_per_step >= 3.0  # every pass accepts all 4 but the last, cut by the budget


def test_sampling_is_exact_with_prompt_lookup_and_with_a_perfect_draft(tiny_llama: Model) -> None:
    sampled = SamplingConfig(temperature=0.9, top_k=30, seed=5, max_new_tokens=24, ignore_eos=True)
    plain = Generator(tiny_llama).generate(PROMPTS[0], sampled).token_ids
    assert Generator(tiny_llama, speculative=PromptLookup(2, 4)).generate(PROMPTS[0], sampled).token_ids == plain
    # The draft draws with the row's own noise: a draft equal to the target reproduces plain sampling.
    assert Generator(tiny_llama, speculative=DraftModel(tiny_llama, 4, adaptive=False)).generate(PROMPTS[0], sampled).token_ids == plain


def test_streams_sessions_and_stop_ids_with_a_speculator(tiny_llama: Model) -> None:
    plain = Generator(tiny_llama, paged_kv(4))
    spec = Generator(tiny_llama, paged_kv(4), speculative=PromptLookup(3, 4), sync_interval=4)
    assert "".join(spec.generate_stream(PROMPTS[1], GREEDY)) == plain.generate(PROMPTS[1], GREEDY).text
    free = plain.generate(PROMPTS[2], GREEDY).token_ids
    stopping = dataclasses.replace(GREEDY, stop_token_ids=(free[9],))
    out = spec.generate(PROMPTS[2], stopping)
    assert out.token_ids == free[: free.index(free[9]) + 1] and out.finish_reason == "stop"
    session = spec.new_session()
    first = session.generate(PROMPTS[0], GREEDY)
    assert first.token_ids == plain.generate(PROMPTS[0], GREEDY).token_ids


def test_a_bad_draft_falls_back_to_plain_decoding(tiny_llama: Model) -> None:
    long = dataclasses.replace(GREEDY, max_new_tokens=64)
    plain = Generator(tiny_llama).generate(PROMPTS[2], long)
    result = Generator(tiny_llama, speculative=DraftModel(_other_weights(tiny_llama, 7), 4)).generate(PROMPTS[2], long)
    assert result.token_ids == plain.token_ids
    stats = result.speculative
    assert stats is not None and stats.acceptance_rate < 0.4
    # A window of poor passes (shrinking drafts), then plain steps with a one-token probe every PROBE_AFTER.
    assert stats.steps <= WINDOW + 64 // PROBE_AFTER and stats.draft_tokens <= 4 * WINDOW


def test_a_draft_model_goes_on_from_its_last_loop(tiny_llama: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model's cache outlives its loop: the next loop over the same rows resumes it (its rows
    catch up on the tokens decoded in between) instead of prefilling the context again, and drafts
    exactly what a fresh start drafts, greedy and sampled (same tokens, same figures)."""
    sampled = SamplingConfig(temperature=0.9, top_k=20, max_new_tokens=48, ignore_eos=True, seed=3)
    requests = [[_request(p, sampling) for p in PROMPTS] for sampling in (dataclasses.replace(GREEDY, max_new_tokens=48), sampled)]
    plain = Generator(tiny_llama).batch_generate(requests[0])

    engine_module = sys.modules[Engine.__module__]
    original = engine_module._carried
    draft = DraftModel.early_exit(tiny_llama, layers=1, num_tokens=3)  # one draft: both runs share its compiled loops

    def run(resume: bool) -> tuple[list[list[Any]], list[bool]]:
        resumed: list[bool] = []

        def carried(*args: Any) -> Any:
            state = original(*args) if resume else None
            resumed.append(state is not None)
            return state

        with monkeypatch.context() as patch:
            patch.setattr(engine_module, "_carried", carried)
            # Costs never measured: the static rule decides alike in both runs (and every loop returns
            # after a window of passes), so their figures can be compared whatever this machine's timings.
            patch.setattr(LoopTimes, "pass_cost", lambda self, width, speculator: 0.0)
            generator = Generator(tiny_llama, speculative=draft)
            return [generator.batch_generate(batch) for batch in requests], resumed

    fresh, never = run(resume=False)
    kept, resumed = run(resume=True)
    assert not any(never) and any(resumed)
    assert _ids(kept[0]) == _ids(fresh[0]) == _ids(plain)  # greedy
    assert _ids(kept[1]) == _ids(fresh[1])  # sampled: a draft unlike the target draws other (equally distributed) tokens
    for spec, again in zip(kept, fresh, strict=True):
        assert [r.speculative for r in spec] == [r.speculative for r in again]


def test_short_and_long_answers_share_one_compiled_loop(tiny_llama: Model) -> None:
    """Loops of up to 64 draws (a short answer, a sync interval's steps, what is left after timing
    draws) are one executable, plain and speculative alike. Answers of 8 and 20 tokens after a
    25-token prompt: loops of 16 and 64 steps whose rows' histories fit the same width."""
    model = dataclasses.replace(tiny_llama, attachments={})  # its own runner: nothing compiled yet
    for speculative in (None, PromptLookup(3, 4)):
        generator = Generator(model, speculative=speculative)
        for n in (8, 20):
            generator.generate(" ".join(PROMPTS), dataclasses.replace(GREEDY, max_new_tokens=n))
    loops = [key[0] for key in runner_for(model)._executables if key[0] in ("decode", "speculate")]  # pyright: ignore[reportPrivateUsage]
    assert sorted(loops) == ["decode", "speculate"]


def test_a_carried_draft_state_needs_the_same_rows_and_tokens() -> None:
    from zgen.runtime.engine import _carried, _DraftCarry  # pyright: ignore[reportPrivateUsage]

    speculator = PromptLookup(3, 4)
    a: Any = object()  # two sequences
    b: Any = object()
    history = np.array([[5, 6, 7, 8, 0], [9, 9, 9, 0, 0]], np.int32)
    carry = _DraftCarry(((0, a), (1, b)), speculator, "state", history, np.array([4, 3], np.int32))
    grown, cut = history.copy(), history.copy()
    grown[1, 3] = 4  # a token decoded since
    cut[0, 2] = 1  # a token that differs from the one the state holds
    assert _carried(carry, ((0, a), (1, b)), speculator, grown, np.array([4, 4], np.int32)) == "state"
    assert _carried(carry, ((0, a), (1, b)), speculator, history, np.array([2, 3], np.int32)) == "state"  # rolled back
    assert _carried(carry, ((0, a), (1, b)), speculator, cut, np.array([4, 3], np.int32)) is None
    assert _carried(carry, ((1, a), (0, b)), speculator, history, np.array([4, 3], np.int32)) is None  # rows swapped
    assert _carried(carry, ((0, a), (1, b)), PromptLookup(3, 4), history, np.array([4, 3], np.int32)) is None  # another speculator
    assert _carried(carry, ((0, a), (1, b)), speculator, np.zeros((2, 8), np.int32), np.array([4, 3], np.int32)) is None


def test_a_batch_in_fallback_takes_plain_steps(tiny_llama: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts that are always wrong: once every row is in fallback the speculative loop takes plain
    decode steps (greedy and sampled tokens unchanged), then probes; the next requests start in
    fallback. The pass cost is left unmeasured, so the decisions (full windows, probes that always run)
    do not depend on this machine's timings."""
    monkeypatch.setattr(LoopTimes, "pass_cost", lambda self, width, speculator: 0.0)
    class Wrong(PromptLookup):
        def propose(self, params: Any, state: Any, draft: DraftInput) -> tuple[Proposal, Any]:
            proposal, state = super().propose(params, state, draft)
            b, k = proposal.tokens.shape
            count = jnp.where(draft.active, jnp.minimum(draft.num_tokens, k), 0)
            return Proposal(jnp.full((b, k), -1, jnp.int32), count.astype(jnp.int32), None), state

        @property
        def adaptive(self) -> bool:
            return True

    sampled = SamplingConfig(temperature=0.9, top_k=20, max_new_tokens=96, ignore_eos=True, seed=3)
    for sampling in (dataclasses.replace(GREEDY, max_new_tokens=96), sampled):
        requests = [_request(p, sampling) for p in PROMPTS]
        plain = Generator(tiny_llama).batch_generate(requests)
        generator = Generator(tiny_llama, speculative=Wrong(3, 4))
        spec = generator.batch_generate(requests)
        assert _ids(spec) == _ids(plain)
        stats = generator.engine.stats
        assert stats.fallback_steps >= 16 + 32  # after the first window, and again after a failed probe
        for result in spec:
            assert result.speculative is not None and result.speculative.accepted_tokens == 0
            # A window of drafting passes, then one-token probes after 16, 32, 64 ... plain draws.
            assert WINDOW + 1 <= result.speculative.steps <= WINDOW + 3
        # New requests start where the last ones left off: in fallback, their first probe after the
        # wait those misses give, and once that wait outlasts an answer, the plain decode loop alone.
        again = generator.batch_generate(requests)
        assert _ids(again) == _ids(plain)
        assert all(r.speculative is not None and 0 < r.speculative.steps <= 2 for r in again)
        with monkeypatch.context() as patch:
            patch.setattr(Engine, "_run_speculative", lambda *args, **kwargs: pytest.fail("no probe falls due: plain decoding"))
            third = generator.batch_generate(requests)
            steps = generator.engine.stats.steps
            streamed = "".join(generator.generate_stream(PROMPTS[0], sampling, per_token=True))
        assert _ids(third) == _ids(plain)
        assert streamed == plain[0].text and generator.engine.stats.steps - steps >= sampling.max_new_tokens  # a step a token
        assert all(r.speculative is not None and r.speculative.steps == 0 for r in third)


def test_a_draft_that_cannot_pay_is_never_run(tiny_llama: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass measured at 50 plain steps: no row's draft can pay for it, so an adaptive draft model
    is not run at all (every iteration a plain step, its rows in fallback), and the tokens are plain's."""
    monkeypatch.setattr(LoopTimes, "pass_cost", lambda self, width, speculator: 50.0)
    requests = [_request(p) for p in PROMPTS]
    plain = Generator(tiny_llama).batch_generate(requests)
    generator = Generator(tiny_llama, speculative=DraftModel.early_exit(tiny_llama, layers=1, num_tokens=3))
    spec = generator.batch_generate(requests)
    assert _ids(spec) == _ids(plain)
    assert generator.engine.stats.fallback_steps > 0
    assert all(r.speculative is not None and r.speculative.draft_tokens == 0 for r in spec)


def test_a_batch_that_ends_with_its_last_row_drafts_only_where_that_row_pays(tiny_llama: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests and no third waiting: the loop lasts as long as its last row, so a pass (measured
    at 1.5 plain steps) must pay for the rows with the most tokens left. One row drafts, the other never
    does: no pass is ever taken (summed over rows, the drafting row's whole draft would have paid),
    and the tokens are plain's. With a third request waiting, finished rows are replaced and the sum
    decides: the drafting row's passes are taken."""
    monkeypatch.setattr(LoopTimes, "pass_cost", lambda self, width, speculator: 1.5)

    class FirstRowOnly(PromptLookup):
        def propose(self, params: Any, state: Any, draft: DraftInput) -> tuple[Proposal, Any]:
            proposal, state = super().propose(params, state, draft)
            first = jnp.arange(proposal.count.shape[0]) == 0
            return Proposal(proposal.tokens, jnp.where(first, proposal.count, 0), None), state

    requests = [_request(PROMPTS[0]), _request(PROMPTS[0])]
    generator = Generator(tiny_llama, max_batch_size=2, speculative=FirstRowOnly(3, 4, adaptive=True))
    spec = generator.batch_generate(requests)
    assert _ids(spec) == _ids(Generator(tiny_llama).batch_generate(requests))
    assert all(r.speculative is not None and r.speculative.draft_tokens == 0 for r in spec)
    spec = generator.batch_generate([*requests, _request(PROMPTS[0])])  # one waits: rows are replaced
    assert sum(r.speculative.draft_tokens for r in spec if r.speculative is not None) > 0


def test_a_pass_with_nothing_drafted_is_a_plain_step(tiny_llama: Model) -> None:
    """A lookup that never finds a match: every iteration of the loop is a plain decode step (no
    verification pass), the tokens are plain decoding's, and no pass is timed."""
    class Empty(PromptLookup):
        def propose(self, params: Any, state: Any, draft: DraftInput) -> tuple[Proposal, Any]:
            proposal, state = super().propose(params, state, draft)
            return dataclasses.replace(proposal, count=jnp.zeros_like(proposal.count)), state

    assert loop_key(Empty(3, 4)) != loop_key(PromptLookup(3, 4))  # its own compiled loop: it drafts otherwise
    requests = [_request(p, dataclasses.replace(GREEDY, max_new_tokens=24)) for p in PROMPTS]
    plain = Generator(tiny_llama).batch_generate(requests)
    speculator = Empty(3, 4, adaptive=False)  # every step a pass of the loop, none taken by the fallback
    generator = Generator(tiny_llama, speculative=speculator)
    spec = generator.batch_generate(requests)
    assert _ids(spec) == _ids(plain)
    stats = generator.engine.stats
    assert stats.fallback_steps == 24 - 1  # every token after the prefill's first, the rows side by side
    for result in spec:
        assert result.speculative is not None and result.speculative.steps == 0 and result.speculative.draft_tokens == 0
    assert generator.engine.loop_times.per_iteration(("speculative", len(PROMPTS), loop_key(speculator))) is None


def test_contexts_take_the_same_speculators(tiny_llama: Model) -> None:
    engine = Engine(tiny_llama, paged_kv(4))
    limit = StopCondition.from_sampling(GREEDY, ())

    def context() -> Context:
        ctx = Context(engine, seed=1)
        ctx.fill(PROMPTS[0])
        return ctx

    plain = context().generate_result(None, limit)

    class Repeat:  # a host drafter: proposes the last two tokens again
        def update(self, context_ids: Sequence[int]) -> None:
            self.ids = list(context_ids)

        def draft(self) -> tuple[list[int], list[int]]:
            return self.ids[-2:], [len(self.ids), len(self.ids) + 1]

    for drafter in (NgramDrafter(max_draft=4), DraftModel(tiny_llama, 4, adaptive=False), Repeat()):
        ctx = context()
        out = ctx.generate_with_drafter(drafter, None, limit)  # type: ignore[arg-type]
        assert out.token_ids == plain.token_ids and out.speculative is not None
        assert ctx.kv_len == ctx.num_tokens - 1
    ctx = context()
    assert ctx.generate_result(None, limit, speculative=PromptLookup()).token_ids == plain.token_ids


def test_typed_refusals(tiny_llama: Model) -> None:
    other_vocab = random_model(
        ModelConfig(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64),
        dtype="float32",
    )
    with pytest.raises(ConfigError, match="vocabulary"):
        Generator(tiny_llama, speculative=DraftModel(other_vocab))
    for k in (0, 33, 2.5, True):
        with pytest.raises(ConfigError, match="num_tokens"):
            PromptLookup(num_tokens=k)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="num_tokens"):
            DraftModel(tiny_llama, num_tokens=k)  # type: ignore[arg-type]
    for layers in (0, tiny_llama.config.num_layers + 1):
        with pytest.raises(ConfigError, match="layers"):
            DraftModel.early_exit(tiny_llama, layers=layers)
    with pytest.raises(ConfigError, match="compressed cache"):
        Generator(tiny_llama, compressed_kv(), speculative=PromptLookup())
    with pytest.raises(ConfigError, match="min_ngram"):
        PromptLookup(max_ngram=2, min_ngram=3)


def test_every_speculator_takes_the_fallback_by_default(tiny_llama: Model) -> None:
    """Prompt lookup and Jacobi (and so --prompt-lookup and --jacobi) fall back to plain decoding where
    their passes do not pay, as the model drafters do; ``adaptive=False`` keeps every step a pass, in
    a loop of its own."""
    defaults = (PromptLookup(), Jacobi(), DraftModel(tiny_llama), DraftModel.early_exit(tiny_llama, layers=1))
    assert all(s.adaptive for s in defaults)
    for fixed, default in ((PromptLookup(adaptive=False), PromptLookup()), (Jacobi(adaptive=False), Jacobi())):
        assert not fixed.adaptive and loop_key(fixed) != loop_key(default)
    assert repr(PromptLookup(adaptive=False)).endswith("adaptive=False)") and "adaptive" not in repr(PromptLookup())


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 4)])
def test_rejection_sampling_keeps_the_target_distribution(temperature: float, top_k: int) -> None:
    """verify() on a vocabulary of 6 with fixed target logits and a fixed, different draft
    distribution, one row per seed: the first produced token follows the target's distribution at
    position 0 and, where the first draft was accepted, the second follows it at position 1
    (chi-square at a fixed seed, far below the 0.1 % critical value)."""
    rows, vocab, k = 40_000, 6, 2
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, k + 1, vocab)) * 1.5, jnp.float32)
    q = rng.dirichlet(np.ones(vocab), size=k).astype(np.float32)
    drafts = np.stack([rng.choice(vocab, size=rows, p=q[i] / q[i].sum()) for i in range(k)], axis=1)
    config = SamplingConfig(temperature=temperature, top_k=top_k)
    sampling = SamplingParams.from_configs([config] * rows, vocab)
    flags = SamplingFlags.from_configs([config], vocab)
    keys = jnp.asarray(rng.integers(0, 2**32, size=(rows, 2), dtype=np.uint32))
    proposal = Proposal(jnp.asarray(drafts, jnp.int32), jnp.full(rows, k, jnp.int32), jnp.broadcast_to(jnp.asarray(q), (rows, k, vocab)))
    tokens, _, accepted = jax.jit(verify, static_argnames="flags")(
        jnp.broadcast_to(logits, (rows, k + 1, vocab)), proposal, proposal.count, jnp.zeros(rows, jnp.int32), sampling, keys, flags=flags
    )
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    one = SamplingParams.from_configs([config], vocab)
    target = np.asarray(jax.nn.softmax(filter_logits(logits[0], jax.tree_util.tree_map(lambda x: jnp.repeat(x, k + 1), one), None, flags)))
    assert 0.05 < accepted.mean() < 1.95  # both rejections and acceptances happen
    _assert_follows(tokens[:, 0], target[0])
    _assert_follows(tokens[accepted >= 1, 1], target[1])


def _assert_follows(samples: np.ndarray, probs: np.ndarray) -> None:
    counts = np.bincount(samples, minlength=probs.size)
    assert counts[probs == 0].sum() == 0  # filtered tokens never appear
    kept = probs > 0
    expected = probs[kept] * samples.size
    chi2 = float((((counts[kept] - expected) ** 2) / expected).sum())
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[int(kept.sum()) - 1]  # chi-square 99.9 %
    assert chi2 < critical, (counts, expected)


def test_the_draft_model_state_after_rejections_and_plain_steps_is_a_fresh_prefill(tiny_llama: Model) -> None:
    """Carried through passes with rejections (kept < drafted), full acceptance (the last draft never
    fed) and plain steps (the draft lagging behind, caught up), the draft proposes exactly what a
    draft prefilled from scratch on the same tokens proposes, tokens and distributions: no off-by-one
    in its K/V."""
    draft = DraftModel(tiny_llama, 4, adaptive=False)
    params = draft.device_params()
    sampled = SamplingConfig(temperature=1.0)
    sampling, flags = SamplingParams.from_configs([sampled], 96), SamplingFlags.from_configs([sampled], 96)
    keys = jnp.zeros((1, 2), jnp.uint32)
    rng = np.random.default_rng(1)
    history = rng.integers(3, 96, size=(1, 80)).astype(np.int32)
    start = jax.jit(draft.start)

    @jax.jit
    def propose(state: Any, history: jax.Array, length: jax.Array) -> tuple[Proposal, Any]:
        given = DraftInput(history, length, jnp.asarray([4]), jnp.asarray([True]), keys, sampling, flags)
        return draft.propose(params, state, given)

    def drafts(state: Any, length: int) -> tuple[list[int], Any]:
        out, state = propose(state, jnp.asarray(history), jnp.asarray([length]))
        return np.asarray(out.tokens)[0].tolist(), state

    def distributions(state: Any, length: int) -> np.ndarray:
        out, _ = propose(state, jnp.asarray(history), jnp.asarray([length]))
        assert out.probs is not None
        return np.asarray(out.probs)[0]

    length = 10
    state = start(params, jnp.asarray(history), jnp.asarray([length]))
    # Per pass: drafts accepted (4 = all: the last one was never fed to the draft), then plain steps.
    for accepted, plain_steps in ((0, 0), (4, 0), (2, 0), (4, 0), (1, 7), (0, 20), (3, 0)):
        proposed, state = drafts(state, length)
        p = length - 1
        history[0, p + 1 : p + 1 + accepted] = proposed[:accepted]  # accepted drafts, then the target's token
        history[0, p + 1 + accepted] = (proposed[accepted] + 1) % 96 if accepted < 4 else history[0, p + 5]
        length += accepted + 1
        state = draft.advance(state, jnp.asarray([length - 1]))
        for _ in range(plain_steps):  # plain decode steps: the draft is not run
            length += 1
            state = draft.advance(state, jnp.asarray([length - 1]))
        fresh = start(params, jnp.asarray(history), jnp.asarray([length]))
        assert drafts(state, length)[0] == drafts(fresh, length)[0], (accepted, plain_steps)
        np.testing.assert_allclose(distributions(state, length), distributions(fresh, length), atol=1e-5, err_msg=f"{accepted, plain_steps}")


def test_a_draft_that_costs_more_than_it_yields_falls_back() -> None:
    """Half its drafts accepted passes the acceptance-rate rule, but a draft costing 0.9 of a target
    step per token (an early exit after 27 of 30 layers) loses: 1.5 tokens per pass for 2.8 steps.
    Falling back again after a successful probe doubles the wait; a window that pays starts it over."""

    def run(control: DraftControl, passes: int, drafted: int, accepted: int, cost: float) -> DraftControl:
        for _ in range(passes):
            control = update_control(
                control, jnp.asarray([drafted]), jnp.asarray([accepted]), jnp.asarray([True]), 4, cost
            )
        return control

    start = DraftControl(**{name: jnp.asarray(value) for name, value in DraftControl.initial(1, 4).items()})
    assert int(run(start, WINDOW, 2, 1, cost=0.0).length[0]) > 0  # free drafts at 50 %: keep drafting
    fell = run(start, WINDOW, 2, 1, cost=0.9)
    assert int(fell.length[0]) == 0 and int(fell.wait[0]) == PROBE_AFTER
    probe = run(fell, PROBE_AFTER, 0, 0, cost=0.9)  # plain steps until the probe
    assert int(probe.length[0]) == 1 and int(probe.wait[0]) == -1
    resumed = run(probe, 1, 1, 1, cost=0.9)
    assert int(resumed.length[0]) > 0
    again = run(resumed, WINDOW, 2, 1, cost=0.9)
    assert int(again.length[0]) == 0 and int(again.wait[0]) == 2 * PROBE_AFTER
    paying = run(run(run(again, 2 * PROBE_AFTER, 0, 0, 0.9), 1, 1, 1, 0.9), WINDOW, 2, 2, cost=0.9)
    assert int(paying.length[0]) > 0 and int(paying.misses[0]) == 0


def test_a_measured_pass_cost_decides_the_fallback() -> None:
    """Free drafts (lookups) accepting one token every other pass: a pass measured at 1.2 plain steps
    pays (1.5 tokens for 1.2 steps), one at 2 steps does not, judged on half a window (the cost is
    known); a probe resumes drafting when it pays its measured pass, all of its draft accepted or not."""

    def run(control: DraftControl, passes: int, drafted: int, accepted: int, pass_cost: float) -> DraftControl:
        for n in range(passes):
            control = update_control(
                control, jnp.asarray([drafted]), jnp.asarray([accepted if n % 2 else 0]), jnp.asarray([True]), 4, 0.0, pass_cost
            )
        return control

    start = DraftControl(**{name: jnp.asarray(value) for name, value in DraftControl.initial(1, 4).items()})
    assert int(run(start, WINDOW, 4, 1, pass_cost=1.2).length[0]) > 0
    assert int(run(start, WINDOW, 4, 1, pass_cost=0.0).length[0]) > 0  # not measured: a pass is one step
    assert int(run(start, WINDOW // 2 - 1, 4, 1, pass_cost=2.0).length[0]) > 0  # not judged yet
    fell = run(start, WINDOW // 2, 4, 1, pass_cost=2.0)
    assert int(fell.length[0]) == 0 and int(fell.wait[0]) == PROBE_AFTER
    probe = run(fell, PROBE_AFTER, 0, 0, pass_cost=2.0)
    assert int(probe.length[0]) == 1 and int(probe.wait[0]) == -1
    once = update_control(probe, jnp.asarray([1]), jnp.asarray([1]), jnp.asarray([True]), 4, 0.0, 2.5)  # 2 tokens for 2.5 steps
    assert int(once.length[0]) == 0 and int(once.wait[0]) == 2 * PROBE_AFTER
    again = update_control(probe, jnp.asarray([4]), jnp.asarray([2]), jnp.asarray([True]), 4, 0.0, 2.5)  # 3 tokens
    assert int(again.length[0]) > 0 and int(again.wait[0]) == 0


def test_a_pass_pays_for_the_whole_batch() -> None:
    """Four rows, a pass at 1.5 plain steps: it pays when the drafting rows are expected to accept more
    than 2 tokens between them (each row's window mean, at most its draft; no history: its draft)."""
    control = DraftControl(**DraftControl.initial(4, 4))
    drafted = jnp.zeros((4, WINDOW), jnp.int32).at[:, :2].set(4)
    accepted = jnp.zeros((4, WINDOW), jnp.int32).at[0, :2].set(3).at[1, :2].set(1)  # means 3, 1, 0, 0
    seen = dataclasses.replace(control, drafted=drafted, accepted=accepted)
    active = jnp.ones(4, bool)
    count = jnp.array([4, 4, 0, 0], jnp.int32)
    pays = lambda *args: bool(pass_pays(*args)[0])  # noqa: E731
    assert pays(seen, count, active, 1.5)  # 4 + 3 + 1 > 6
    assert not pays(seen, count.at[0].set(1), active, 1.5)  # 4 + 1 + 1 <= 6: a draft of 1 accepts 1 at most
    assert not pays(seen, jnp.array([0, 4, 4, 4], jnp.int32), active, 1.5)  # 4 + 1 + 0 + 0
    assert pays(control, jnp.array([0, 0, 0, 4], jnp.int32), active, 1.5)  # no history: its whole draft
    assert pays(seen, jnp.zeros(4, jnp.int32), active, 0.0)  # not measured yet
    # Below its share of the pass's extra cost (0.5 a row): rows 2 and 3 (means 0), not row 1 (mean 1).
    short = pass_pays(seen, jnp.array([0, 4, 4, 4], jnp.int32), active, 1.5)[1]
    assert short.tolist() == [False, False, True, True]
    assert not bool(jnp.any(pass_pays(seen, count, active, 0.0)[1]))  # nothing is short of an unmeasured cost


def test_a_pass_pays_for_the_last_rows_where_none_is_replaced() -> None:
    """Where the loop lasts as long as its last row, a pass must pay for the rows with the most tokens
    left (the least of their expectations against ``pass_cost - 1``); where it does not, every
    drafting row falls back."""
    control = DraftControl(**DraftControl.initial(4, 4))
    drafted = jnp.zeros((4, WINDOW), jnp.int32).at[:, :2].set(4)
    accepted = jnp.zeros((4, WINDOW), jnp.int32).at[0, :2].set(3).at[1, :2].set(1)  # means 3, 1, 0, 0
    seen = dataclasses.replace(control, drafted=drafted, accepted=accepted)
    active, count = jnp.ones(4, bool), jnp.array([4, 4, 0, 0], jnp.int32)
    assert bool(pass_pays(seen, count, active, 1.5)[0])  # by the sum: 4 + 3 + 1 > 6
    assert bool(pass_pays(seen, count, active, 1.5, jnp.array([True, False, False, False]))[0])  # 1 + 3 > 1.5
    pays, falls = pass_pays(seen, count, active, 1.5, jnp.array([True, True, False, False]))  # 1 + 1 > 1.5
    assert bool(pays) and falls.tolist() == [True, True, False, False]
    pays, falls = pass_pays(seen, count, active, 1.5, jnp.array([True, False, True, False]))  # row 2 drafts nothing
    assert not bool(pays) and falls.tolist() == [True, True, False, False]


def test_rows_of_a_pass_not_taken_fall_back() -> None:
    """A pass that does not pay updates no window: the drafting rows short of their share fall back
    (and probe after the wait) instead of waiting on a window that never changes."""
    control = DraftControl(**{name: jnp.asarray(value) for name, value in DraftControl.initial(2, 4).items()})
    nothing = jnp.zeros(2, jnp.int32)
    after = update_control(control, nothing, nothing, jnp.ones(2, bool), 4, 0.0, 1.5, jnp.array([True, False]))
    assert after.length.tolist() == [0, 4] and after.wait.tolist() == [PROBE_AFTER, 0] and after.misses.tolist() == [1, 0]


def test_rows_in_fallback_probe_together() -> None:
    """A row whose wait is over brings every row in fallback into its probe (one pass for all of
    them); rows still drafting, done or not in fallback are left alone."""
    resting = jnp.array([True, True, True, False])
    assert probes(resting, jnp.array([0, 5, 200, 0])).tolist() == [True, True, True, False]
    assert not bool(jnp.any(probes(resting, jnp.array([1, 5, 200, 0]))))
    control = DraftControl(**{name: jnp.asarray(value) for name, value in DraftControl.initial(3, 4).items()})
    control = dataclasses.replace(control, length=jnp.array([0, 0, 4]), wait=jnp.array([1, 9, 0]))
    nothing = jnp.zeros(3, jnp.int32)
    after = update_control(control, nothing, nothing, jnp.ones(3, bool), 4, 0.0, 1.5)  # row 0's wait ends
    assert after.wait.tolist() == [-1, -1, 0] and after.length.tolist() == [1, 1, 4]


def test_loop_times_give_a_pass_in_plain_steps() -> None:
    times, speculator = LoopTimes(), PromptLookup(3, 4, adaptive=True)
    assert times.pass_cost(2, speculator) == 0.0  # nothing timed yet
    times.record(("plain", 2), 0.4, 40)
    times.record(("speculative", 2, loop_key(speculator)), 0.6, 20)
    assert times.pass_cost(2, speculator) == pytest.approx(3.0) and times.pass_cost(4, speculator) == 0.0
    times.record(("speculative", 2, loop_key(speculator)), 0.01, 10)  # faster than a plain step: noise
    times.record(("speculative", 2, loop_key(speculator)), 0.0, 0)  # a loop that ran no pass: ignored
    assert times.pass_cost(2, speculator) == pytest.approx(0.61 / 30 / 0.01)
    for _ in range(100):  # recent calls weigh most: the plain step, 10 ms at first, now takes 5
        times.record(("plain", 2), 0.05, 10)
    assert times.per_iteration(("plain", 2)) == pytest.approx(0.005, rel=0.05)
    times.record(("speculative", 2, loop_key(speculator)), 0.0001, 256)
    assert times.pass_cost(2, speculator) == 1.0  # a pass does a plain step's work at least


def test_loop_times_take_out_the_fixed_cost_of_a_call() -> None:
    """A call costs 10 ms whatever it runs: a plain loop of 8 steps of 1 ms (18 ms) is 1 ms a step, and a
    speculative loop of 4 passes of 3 ms and 6 plain steps (28 ms) gives passes of 3 steps."""
    times, speculator = LoopTimes(), PromptLookup(3, 4, adaptive=True)
    for seconds in (0.012, 0.010, 0.011):  # calls that ran no iteration: the least is kept
        times.record_call(4, seconds)
    assert times.call_seconds(4) == pytest.approx(0.010) and times.call_seconds(2) is None
    times.record_plain(4, 0.018, 8)
    times.record_loop(4, speculator, 0.028, 10, 6)
    assert times.pass_cost(4, speculator) == 0.0  # the first to run passes and plain steps: its branches ran cold
    times.record_loop(4, speculator, 0.028, 10, 6)
    assert times.per_iteration(("plain", 4)) == pytest.approx(0.001)
    assert times.pass_cost(4, speculator) == pytest.approx(3.0)


def test_a_cold_loop_is_timed_only_until_a_warm_one_is() -> None:
    """A loop whose call compiled ran cold: a plain one's time stands until a warm plain loop replaces
    it, a speculative one's is not taken (it held every row in fallback on a GPU)."""
    times, speculator = LoopTimes(), PromptLookup(3, 4, adaptive=True)
    times.record_plain(2, 0.08, 8, warm=False)
    assert times.per_iteration(("plain", 2)) == pytest.approx(0.01) and not times.warm(("plain", 2))
    times.record_loop(2, speculator, 1.0, 8, 0, warm=False)
    assert times.pass_cost(2, speculator) == 0.0  # not measured: passes run, and are timed next call
    times.record_loop(2, speculator, 0.04, 8, 0)
    assert times.pass_cost(2, speculator) == 1.0  # 5 ms a pass against the cold 10 ms step: the floor
    times.record_loop(2, speculator, 1.0, 16, 8)  # its first plain steps (a branch run cold): not taken
    assert times.pass_cost(2, speculator) == 1.0
    times.record_plain(2, 0.008, 8)
    times.record_plain(2, 0.5, 8, warm=False)  # a cold loop after a warm one: ignored
    assert times.warm(("plain", 2)) and times.per_iteration(("plain", 2)) == pytest.approx(0.001)
    assert times.pass_cost(2, speculator) == pytest.approx(5.0)


def test_adaptive_prompt_lookup_times_plain_steps_first_and_equals_plain(tiny_llama: Model) -> None:
    """An adaptive speculator's first draws at a batch width are plain (they time the plain step), its
    first loops return after a window of passes (they time the pass, once a loop runs warm: compiled
    before its call); tokens are plain decoding's."""
    sampling = dataclasses.replace(GREEDY, max_new_tokens=40)
    requests = [_request(p, sampling) for p in PROMPTS]
    plain_generator = Generator(tiny_llama)
    plain = plain_generator.batch_generate(requests)
    speculator = PromptLookup(3, 4, adaptive=True)
    generator = Generator(tiny_llama, speculative=speculator)
    spec = generator.batch_generate(requests)
    assert _ids(spec) == _ids(plain)
    assert _ids(generator.batch_generate(requests)) == _ids(plain)  # its loops compiled: they run warm
    times = generator.engine.loop_times
    width = next(w for w in range(1, 257) if times.per_iteration(("plain", w)) is not None)
    assert times.pass_cost(width, speculator) >= 1.0 and times.warm(("plain", width))
    # The call's fixed cost is timed where a speculator's plain step is, not by engines that never speculate.
    assert times.call_seconds(width) is not None and plain_generator.engine.loop_times.call_seconds(width) is None
    for result in spec:
        assert result.speculative is not None and result.speculative.steps <= len(result.token_ids) - TIMING_DRAWS
    with pytest.raises(ConfigError, match="adaptive"):
        PromptLookup(adaptive=1)  # type: ignore[arg-type]
    # A stream taken a token at a time is not timed (a host round trip a pass) and gets no plain draws first.
    streamed = Generator(tiny_llama, speculative=PromptLookup(3, 4, adaptive=True))
    assert "".join(streamed.generate_stream(PROMPTS[0], sampling, per_token=True)) == plain[0].text
    assert all(streamed.engine.loop_times.per_iteration(("plain", w)) is None for w in range(1, 257))


def test_early_exits_share_a_graph_and_take_the_current_weights(tiny_llama: Model) -> None:
    """Two early exits of one model and depth share a graph (and so their compiled loops), and each
    takes the target's weights as they are when it is made (merged adapters included)."""
    m = tiny_llama
    target = Model(m.config, m.tokenizer, m.graph, dict(m.params), m.dtype, m.source, m.load_timings)  # weights of its own
    first = DraftModel.early_exit(target, layers=1)
    target.params["layers.0.qkv"] = 2 * target.params["layers.0.qkv"]
    second = DraftModel.early_exit(target, layers=1)
    assert second.model.graph is first.model.graph and second.cache_key() == first.cache_key()
    assert second.device_params()["layers.0.qkv"] is target.params["layers.0.qkv"] is not first.device_params()["layers.0.qkv"]
    assert DraftModel.early_exit(target, layers=2).model.graph is not first.model.graph


def test_draft_cost_is_the_share_of_weight_bytes(tiny_llama: Model) -> None:
    exit_early = DraftModel.early_exit(tiny_llama, layers=1)
    cost = draft_cost(exit_early.device_params(), tiny_llama.params)
    assert 0.0 < cost < 1.0 and draft_cost(None, tiny_llama.params) == 0.0
    assert draft_cost(DraftModel(tiny_llama, 4).device_params(), tiny_llama.params) == pytest.approx(1.0)
