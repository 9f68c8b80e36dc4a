"""EAGLE: exact greedy output with an untrained head on every cache layout, the head's state carried
through passes equal to a fresh start, drafts drawn from the distribution they report, training
(loss goes down, resumes, records its target), and the command line."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from hf_reference import save_random_checkpoint, small_configs
from test_speculative import _assert_follows
from zgen import Generator, SamplingConfig, load_model
from zgen.cache.factory import paged_kv
from zgen.cache.tensor import DenseKVState
from zgen.cli import app
from zgen.contexts import Context
from zgen.errors import CheckpointError, ConfigError
from zgen.generator import Request
from zgen.model import Model
from zgen.runtime.engine import Engine
from zgen.runtime.sampling import SamplingFlags, SamplingParams
from zgen.runtime.speculation import DraftInput, Proposal, observe_missing_features
from zgen.runtime.step import ModelSpec, forward_features
from zgen.runtime.stop import StopCondition
from zgen.speculative import DraftModel, Eagle, EagleHead, TreeShape
from zgen.speculative.eagle.head import HEAD_WINDOW, draft_step, fuse
from zgen.speculative.eagle.train import TrainConfig, chained_outputs, head_loss, target_outputs, train, training_sequences

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True)
PROMPTS = ["w5 w9 w12 w5 w9 w12 w5 w9 w3", "w7 w8 w7 w8 w7", "w20 w21 w22 w23 w24 w25 w20 w21 w22 w30 w31"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = tmp_path_factory.mktemp("tiny-eagle")
    save_random_checkpoint(small_configs()["llama_tied"], directory)
    return directory


@pytest.fixture(scope="module")
def tiny(checkpoint: Path) -> Model:
    return load_model(checkpoint, dtype="float32")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("eagle-data") / "text.txt"
    path.write_text("\n".join(f"w{i % 7} w{(3 * i) % 11} w{i % 5} w{(i + 2) % 9}" for i in range(120)), encoding="utf-8")
    return path


def _other_weights(model: Model) -> Model:
    params = {name: x * 1.5 if name == "embed" else x for name, x in model.params.items()}
    return dataclasses.replace(model, params=params, attachments={})


@pytest.mark.parametrize("layout,fused", [("dense", False), ("paged", False), ("dense", True)], ids=["dense", "paged", "dense-fused"])
def test_greedy_with_an_untrained_head_equals_plain(tiny: Model, layout: str, fused: bool) -> None:
    """Exactness does not depend on the head: a random one (drafts mostly rejected, kept drafting)."""
    options = (paged_kv(4),) if layout == "paged" else ()
    requests = [Request(p, GREEDY) for p in PROMPTS]
    plain = Generator(tiny, *options).batch_generate(requests)
    eagle = Eagle(EagleHead.init(tiny, 3, fused=fused), num_tokens=3, adaptive=False)
    spec = Generator(tiny, *options, speculative=eagle).batch_generate(requests)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    for result, reference in zip(spec, plain, strict=True):
        assert result.speculative is not None and result.speculative.draft_tokens > 0
        assert result.logprobs == pytest.approx(reference.logprobs, abs=1e-4)


def test_a_head_that_reproduces_the_target_is_always_accepted(tiny: Model) -> None:
    """A one-layer target and a head that ignores the feature (fc = [0 | I]) and runs the target's own
    layer: head row j sees the embeddings of tokens 1 .. j + 1 at positions shifted by one (RoPE is
    relative), so it computes the target's hidden state at j + 1 and drafts the target's own tokens.
    Every draft is accepted: the head's rows, tokens, positions and draw indices line up with the target's."""
    target = DraftModel.early_exit(tiny, layers=1).model
    hidden = target.config.hidden_size
    layer = {name: target.params[f"layers.0.{name}"] for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")}
    params = {f"eagle.layer.{name}": value for name, value in layer.items()}
    params["eagle.fc"] = jnp.concatenate([jnp.zeros((hidden, hidden)), jnp.eye(hidden)], axis=1).astype(target.dtype)
    eagle = Eagle(EagleHead(target, params, (0,)), num_tokens=4, adaptive=False)
    long = dataclasses.replace(GREEDY, max_new_tokens=40)
    plain = Generator(target).generate(PROMPTS[2], long)
    result = Generator(target, speculative=eagle).generate(PROMPTS[2], long)
    assert result.token_ids == plain.token_ids
    stats = result.speculative
    assert stats is not None and stats.acceptance_rate == 1.0 and stats.mean_accepted_per_step >= 3.0


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_trees_with_an_untrained_head_equal_plain_greedy_and_sampled(tiny: Model, layout: str) -> None:
    """EAGLE-2 trees from the head (rows in scratch slots, features of the accepted path after each
    tree pass): greedy and sampled tokens are plain decoding's (a tree is accepted by exact match).
    The dense run is adaptive: its rows fall back to plain decode steps and come back."""
    options = (paged_kv(4),) if layout == "paged" else ()
    sampled = SamplingConfig(temperature=0.8, top_k=8, max_new_tokens=40, ignore_eos=True, seed=5)
    greedy = dataclasses.replace(GREEDY, max_new_tokens=40)
    eagle = Eagle(EagleHead.init(tiny, 3, fused=True), num_tokens=3, adaptive=not options, tree=TreeShape(width=2, size=6))
    for sampling in (greedy, sampled):
        requests = [Request(p, sampling) for p in PROMPTS]
        plain = Generator(tiny, *options).batch_generate(requests)
        generator = Generator(tiny, *options, speculative=eagle)
        spec = generator.batch_generate(requests)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        for result in spec:
            assert result.speculative is not None and result.speculative.draft_tokens > 0
        assert (generator.engine.stats.fallback_steps > 0) == eagle.adaptive


def test_a_head_that_reproduces_the_target_drafts_trees_it_accepts(tiny: Model) -> None:
    """The reproducing head of the test above, drafting trees: the nodes' head rows, their parents'
    features and the target's features of each accepted path line up, so the target's own path is
    in nearly every tree and is accepted."""
    target = DraftModel.early_exit(tiny, layers=1).model
    hidden = target.config.hidden_size
    layer = {name: target.params[f"layers.0.{name}"] for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")}
    params = {f"eagle.layer.{name}": value for name, value in layer.items()}
    params["eagle.fc"] = jnp.concatenate([jnp.zeros((hidden, hidden)), jnp.eye(hidden)], axis=1).astype(target.dtype)
    long = dataclasses.replace(GREEDY, max_new_tokens=40)
    plain = Generator(target).generate(PROMPTS[2], long)
    # Width 1: the tree is the head's greedy chain, through the tree path (scratch rows, path features).
    # Width 3, 12 nodes: every node of depth 1 and 2, so the target's path of depth 2 is always there.
    for shape, accepted_per_pass in ((TreeShape(width=1, size=4), 3.0), (TreeShape(width=3, size=12), 2.0)):
        eagle = Eagle(EagleHead(target, params, (0,)), num_tokens=4, adaptive=False, tree=shape)
        result = Generator(target, speculative=eagle).generate(PROMPTS[2], long)
        assert result.token_ids == plain.token_ids
        stats = result.speculative
        assert stats is not None and stats.acceptance_rate == 1.0 and stats.mean_accepted_per_step >= accepted_per_pass


def test_contexts_take_an_eagle_head(tiny: Model) -> None:
    engine = Engine(tiny, paged_kv(4))
    limit = StopCondition.from_sampling(GREEDY, ())

    def context() -> Context:
        ctx = Context(engine, seed=1)
        ctx.fill(PROMPTS[2])
        return ctx

    plain = context().generate_result(None, limit)
    eagle = Eagle(EagleHead.init(tiny, 4), num_tokens=3)
    ctx = context()
    out = ctx.generate_result(None, limit, speculative=eagle)
    assert out.token_ids == plain.token_ids and out.speculative is not None and out.speculative.draft_tokens > 0
    assert ctx.kv_len == ctx.num_tokens - 1


def _prefilled(model: Model, eagle: Eagle, history: np.ndarray | jax.Array) -> tuple[jax.Array, DenseKVState]:
    """The target's features at every position of ``history``, and the cache holding its K/V."""
    c = model.config
    b, width = history.shape
    kv = DenseKVState.zeros(c.num_layers, b, width, c.num_kv_heads, c.head_dim, model.dtype)
    positions = jnp.broadcast_to(jnp.arange(width)[None, :], (b, width))
    spec = ModelSpec(model.graph, None)
    _, features, kv = forward_features(spec, model.params, kv, jnp.asarray(history), positions, jnp.zeros((b, 1), jnp.int32), eagle.feature_layers)
    return features, kv


def _target_features(model: Model, eagle: Eagle, history: np.ndarray | jax.Array) -> jax.Array:
    return _prefilled(model, eagle, history)[0]


def test_features_a_plain_stretch_left_out_are_read_back_before_drafting(tiny: Model) -> None:
    """After plain steps that observed nothing, the loop reads the missing features from the cache:
    a short gap in one chunk, a long one as the head's whole window (nothing earlier), none where
    nothing is missing; an inactive row is left as it was. They are the target's."""
    eagle = Eagle(EagleHead.init(tiny, 3), 3)
    params = eagle.device_params()
    history = jnp.asarray(np.random.default_rng(2).integers(3, 96, size=(3, 320)), jnp.int32)
    features, kv = _prefilled(tiny, eagle, history)
    spec = ModelSpec(tiny.graph, None)
    read = jax.jit(lambda state, length, active: observe_missing_features(spec, tiny.params, kv, eagle, state, history, length, active))
    window = HEAD_WINDOW
    # (lengths, where each row's features stop, active rows): a chunk's gap, a window's gap, none.
    for length, observed, active in (([40, 30, 50], [20, 29, 10], [True, True, False]), ([300, 30, 50], [0, 25, 10], [True, True, False])):
        state = eagle.start(params, history, jnp.asarray(length))
        start = state.observed
        known = jnp.where(jnp.arange(320)[None, :] < jnp.asarray(observed)[:, None], jnp.arange(320)[None, :], -1)
        known = jnp.where(known >= start[:, None], known, -1)
        state = eagle.observe_features(state, features, known)
        assert np.asarray(state.observed).tolist() == [max(o, s) for o, s in zip(observed, np.asarray(start).tolist(), strict=True)]
        after = read(state, jnp.asarray(length), jnp.asarray(active))
        for row, (n, on) in enumerate(zip(length, active, strict=True)):
            p = n - 1
            if not on:
                assert int(after.observed[row]) == observed[row]
                np.testing.assert_array_equal(np.asarray(after.features[row]), np.asarray(state.features[row]))
                continue
            assert int(after.observed[row]) == p
            needed = slice(max(p - window, 0), p)
            np.testing.assert_allclose(np.asarray(after.features[row, needed]), np.asarray(features[row, needed]), rtol=1e-4, atol=1e-4)
        again = read(after, jnp.asarray(length), jnp.asarray(active))
        np.testing.assert_array_equal(np.asarray(again.features), np.asarray(after.features))


def test_the_head_state_after_passes_and_plain_steps_is_a_fresh_start(tiny: Model) -> None:
    """Carried through passes that keep 1 .. k+1 tokens (the features past the kept ones are the
    rejected drafts': noise here) and plain steps (the head lagging, caught up), the head proposes
    what a head started from scratch on the same tokens proposes: tokens and distributions."""
    eagle = Eagle(EagleHead.init(tiny, 5), 4, adaptive=False)
    params = eagle.device_params()
    sampled = SamplingConfig(temperature=1.0)
    sampling, flags = SamplingParams.from_configs([sampled], 96), SamplingFlags.from_configs([sampled], 96)
    keys = jnp.zeros((1, 2), jnp.uint32)
    history = np.random.default_rng(1).integers(3, 96, size=(1, 96)).astype(np.int32)
    features = _target_features(tiny, eagle, history)
    start = jax.jit(eagle.start)

    @jax.jit
    def propose(state: Any, length: jax.Array) -> tuple[Proposal, Any]:
        given = DraftInput(jnp.asarray(history), length, jnp.asarray([4]), jnp.asarray([True]), keys, sampling, flags)
        return eagle.propose(params, state, given)

    observe = jax.jit(eagle.observe_features)
    noise = jax.random.normal(jax.random.key(0), features.shape, features.dtype)

    def fresh_start(length: int) -> Any:  # as the loop starts: the features before the pending token
        state = start(params, jnp.asarray(history), jnp.asarray([length]))
        return observe(state, features[:, : length - 1], jnp.arange(length - 1)[None, :])

    length = 10
    state = fresh_start(length)
    for kept, plain_steps in ((1, 0), (5, 0), (3, 0), (5, 0), (2, 7), (1, 30), (4, 0)):
        carried, state = propose(state, jnp.asarray([length]))
        fresh, _ = propose(fresh_start(length), jnp.asarray([length]))
        assert carried.probs is not None and fresh.probs is not None
        np.testing.assert_allclose(np.asarray(carried.probs), np.asarray(fresh.probs), atol=1e-5)
        assert np.asarray(carried.tokens).tolist() == np.asarray(fresh.tokens).tolist()
        p = length - 1
        checked = jnp.asarray([[p + j for j in range(5)]])
        seen = jnp.where((jnp.arange(5) < kept)[None, :, None], features[:, p : p + 5], noise[:, p : p + 5])
        state = observe(state, seen, checked)
        length += kept
        state = eagle.advance(state, jnp.asarray([length - 1]))
        for _ in range(plain_steps):  # plain decode steps: the head is not run, the features arrive
            state = observe(state, features[:, length - 1 : length], jnp.asarray([[length - 1]]))
            length += 1
            state = eagle.advance(state, jnp.asarray([length - 1]))


def test_sampled_drafts_follow_the_distribution_they_report(tiny: Model) -> None:
    """The loop's rejection sampling keeps the target's distribution given drafts drawn from the
    ``probs`` they report (tests/test_speculative.py shows the rule): chi-square over many rows."""
    rows = 4000
    eagle = Eagle(EagleHead.init(tiny, 2), 2, adaptive=False)
    params = eagle.device_params()
    config = SamplingConfig(temperature=0.8, top_k=4)
    sampling, flags = SamplingParams.from_configs([config] * rows, 96), SamplingFlags.from_configs([config], 96)
    keys = jnp.asarray(np.random.default_rng(0).integers(0, 2**32, size=(rows, 2), dtype=np.uint32))
    history = jnp.broadcast_to(jnp.asarray([[1, 7, 9, 12, 7, 9, 0, 0]], jnp.int32), (rows, 8))
    length = jnp.full(rows, 6, jnp.int32)

    @jax.jit
    def run() -> Proposal:
        state = eagle.start(params, history, length)
        known = jnp.where(jnp.arange(8)[None, :] < 5, jnp.arange(8)[None, :], -1)
        state = eagle.observe_features(state, _target_features(tiny, eagle, history), jnp.broadcast_to(known, (rows, 8)))
        given = DraftInput(history, length, jnp.full(rows, 2), jnp.ones(rows, bool), keys, sampling, flags)
        return eagle.propose(params, state, given)[0]

    proposal = run()
    assert proposal.probs is not None
    tokens, probs = np.asarray(proposal.tokens), np.asarray(proposal.probs)
    np.testing.assert_allclose(probs[:, 0], probs[:1, 0].repeat(rows, 0), atol=1e-6)  # one history: one distribution
    _assert_follows(tokens[:, 0], probs[0, 0])


def test_draft_steps_traced_out_equal_the_loop(tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU traces a chain's draft steps out, all ``k`` of them, where a CPU loops over the longest
    draft asked for: rows that ask fewer than ``k`` (one asks none) get the same drafts, distributions
    and head state either way, greedy and sampled, and whole adaptive generations (EAGLE and an early
    exit) the plain tokens."""
    from zgen.speculative import draft_model as module

    eagle = Eagle(EagleHead.init(tiny, 4), 4)
    params = eagle.device_params()
    history = jnp.asarray(np.random.default_rng(3).integers(3, 96, size=(3, 64)), jnp.int32)
    length = jnp.asarray([30, 41, 20])
    features = _target_features(tiny, eagle, history)
    known = jnp.where(jnp.arange(64)[None, :] < (length - 1)[:, None], jnp.arange(64)[None, :], -1)
    state = eagle.observe_features(eagle.start(params, history, length), features, known)
    keys = jnp.asarray(np.random.default_rng(4).integers(0, 2**32, size=(3, 2), dtype=np.uint32))
    for config, asked in itertools.product((SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.9, top_k=8)), ([2, 1, 0], [4, 3, 0])):
        sampling, flags = SamplingParams.from_configs([config] * 3, 96), SamplingFlags.from_configs([config] * 3, 96)
        given = DraftInput(history, length, jnp.asarray(asked), jnp.ones(3, bool), keys, sampling, flags)
        outputs = []
        for unrolled in (False, True):
            monkeypatch.setattr(module, "unrolled_drafts", lambda unrolled=unrolled: unrolled)
            outputs.append(jax.jit(lambda state, given=given: eagle.propose(params, state, given))(state))
        (looped, looped_state), (traced, traced_state) = outputs
        assert np.asarray(traced.count).tolist() == np.asarray(looped.count).tolist() == asked
        for row, n in enumerate(asked):
            assert np.asarray(traced.tokens[row, :n]).tolist() == np.asarray(looped.tokens[row, :n]).tolist()
            if looped.probs is not None and traced.probs is not None:
                np.testing.assert_allclose(np.asarray(traced.probs[row, :n]), np.asarray(looped.probs[row, :n]), atol=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves(traced_state), jax.tree_util.tree_leaves(looped_state), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    requests = [Request(p, GREEDY) for p in PROMPTS]
    monkeypatch.setattr(module, "unrolled_drafts", lambda: True)
    plain = Generator(tiny).batch_generate(requests)
    for drafting in (Eagle(EagleHead.init(tiny, 3), num_tokens=3), DraftModel.early_exit(tiny, layers=1, num_tokens=3)):
        spec = Generator(tiny, speculative=drafting).batch_generate(requests)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_the_training_time_test_sees_what_a_drafted_chain_sees(tiny: Model) -> None:
    """Chained step ``s`` of training at row ``j`` (all rows in one pass, through the chain mask) gives
    the logits of drafting step by step: the true rows up to ``j - s + 1`` fed, then ``s - 1`` chain
    rows, each reading the feature its predecessor predicted (the tokens being the true ones)."""
    head = EagleHead.init(tiny, 5, fused=True)
    t, steps = 8, 3
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, tiny.config.vocab_size, (1, t)), jnp.int32)
    features = jax.random.normal(jax.random.PRNGKey(1), (1, t, len(head.feature_layers) * tiny.config.hidden_size))
    lengths = jnp.asarray([t - 1], jnp.int32)  # the last token is padding
    chained = chained_outputs(head, head.params, tiny.params, tokens, lengths, features, steps=steps)
    joined = head.joined(head.params, tiny.params)
    for step in range(1, steps + 1):
        for j in range(step - 1, t - 2):
            kv = head.new_kv(1, t, attention="einsum", dtype=jnp.dtype(jnp.float32))
            true_rows = jnp.arange(j - step + 2)[None]
            feature, logits, kv = draft_step(
                head.graph, joined, kv, fuse(head.params, features[:, : j - step + 2]), tokens[:, 1 : j - step + 3], true_rows, true_rows
            )
            feature, logits = feature[:, -1:], logits[:, -1:]
            for row in range(j - step + 2, j + 1):
                at = jnp.asarray([[row]], jnp.int32)
                feature, logits, kv = draft_step(head.graph, joined, kv, feature, tokens[:, row + 1 : row + 2], at, jnp.zeros((1, 1), jnp.int32))
            np.testing.assert_allclose(chained[step - 1][1][0, j], logits[0, 0], rtol=1e-4, atol=1e-4, err_msg=f"step {step}, row {j}")


def test_the_loss_mask_scores_the_drafted_continuation_only(tiny: Model) -> None:
    """With ``drafted_from`` (a self-distilled sequence's second generated token), the agreement counts
    the rows that predict tokens from there on, nothing of the prompt before it."""
    head = EagleHead.init(tiny, 2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, tiny.config.vocab_size, (2, 12)), jnp.int32)
    lengths, drafted_from = jnp.asarray([12, 10], jnp.int32), jnp.asarray([5, 8], jnp.int32)
    spec = ModelSpec(tiny.graph, None)
    features = target_outputs(spec, tiny, tiny.params, head.feature_layers, tokens, lengths)[1]
    head_logits = chained_outputs(head, head.params, tiny.params, tokens, lengths, features)[0][1]
    # "Target" logits the head agrees with at rows 0, 3, 6, ... only (negated elsewhere: another argmax).
    hits = np.arange(11)[None, :] % 3 == 0
    target = jnp.concatenate([jnp.zeros_like(head_logits[:, :1]), jnp.where(jnp.asarray(hits)[..., None], head_logits, -head_logits)], axis=1)
    _, agreement = head_loss(head, head.params, tiny.params, tokens, lengths, target, features, drafted_from=drafted_from)
    scored = [hits[0, 3:11], hits[0, 6:9]]  # rows j with drafted_from <= j + 2 and j + 1 < length
    np.testing.assert_allclose(float(agreement[0]), np.concatenate(scored).mean(), rtol=1e-6)
    _, everything = head_loss(head, head.params, tiny.params, tokens, lengths, target, features)
    np.testing.assert_allclose(float(everything[0]), np.concatenate([hits[0, :11], hits[0, :9]]).mean(), rtol=1e-6)


def test_chats_are_scored_on_their_final_reply(tiny: Model, tmp_path: Path) -> None:
    """A chat ending in an assistant turn is scored from the reply's second token (its prompt through the
    template is never drafted); other chats and text on every token."""
    template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
    model = dataclasses.replace(tiny, tokenizer=dataclasses.replace(tiny.tokenizer, chat_template=template))
    chats = tmp_path / "chats.jsonl"
    ask = {"role": "user", "content": "w3 w4 w5"}
    chats.write_text("\n".join(json.dumps(c) for c in ({"messages": [ask, {"role": "assistant", "content": "w6 w7 w8 w9"}]}, [ask, ask])), encoding="utf-8")
    replied, asked = training_sequences(model, chats, 64)
    prompt = model.tokenizer.encode(model.tokenizer.apply_chat_template([ask], add_generation_prompt=True), add_special_tokens=False)
    assert replied.ids[: len(prompt)] == prompt and len(replied.ids) > len(prompt) + 1
    assert replied.drafted_from == len(prompt) + 1 and asked.drafted_from == 0


def test_training_learns_resumes_and_records_its_target(tiny: Model, tmp_path: Path) -> None:
    """One short text (every batch the same): the loss goes down step by step."""
    out = tmp_path / "head"
    one = tmp_path / "one.txt"
    one.write_text(" ".join(f"w{(5 * i) % 13}" for i in range(20)), encoding="utf-8")
    losses: list[float] = []
    config = TrainConfig(steps=8, batch_size=2, seq_len=24, lr=3e-3, save_every=4, eval_every=4)
    report = train(tiny, one, out, config, lambda step: losses.append(step.loss))
    assert report.first_step == 0 and len(losses) == 8 and report.tokens > 0
    assert losses[-1] < losses[3] < losses[0]
    assert 0.0 <= report.acceptance <= 1.0 and len(report.chain_acceptance) == 4 and report.chain_acceptance[0] == report.acceptance
    resumed = train(tiny, one, out, dataclasses.replace(config, steps=10))
    assert resumed.first_step == 8 and json.loads((out / "head.json").read_text())["step"] == 10
    with pytest.raises(ConfigError, match="fused"):
        train(tiny, one, out, dataclasses.replace(config, steps=12, fused=True))
    eagle = Eagle.load(out, tiny, 3)
    assert eagle.num_tokens == 3 and eagle.feature_layers == (tiny.config.num_layers - 1,)
    other = _other_weights(tiny)
    with pytest.raises(CheckpointError, match="trained for"):
        Eagle.load(out, other)
    with pytest.raises(CheckpointError, match="trained for"):
        train(other, one, out, config)
    with pytest.raises(ConfigError, match="another model"):
        Generator(other, speculative=eagle).generate(PROMPTS[0], GREEDY)
    with pytest.raises(CheckpointError, match="no EAGLE head"):
        Eagle.load(tmp_path / "nothing", tiny)


def test_a_head_trained_on_the_targets_own_text_drafts_what_it_says(tiny: Model, tmp_path: Path) -> None:
    """Training and drafting read the same rows the same way: a head trained briefly on the target's
    greedy continuations of prompts like the one asked has its drafts accepted."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"w{i % 40} w{(7 * i) % 50} w{(3 * i) % 30}" for i in range(32)), encoding="utf-8")
    out = tmp_path / "head"
    config = TrainConfig(steps=60, batch_size=8, seq_len=32, lr=3e-3, self_distill=32, save_every=60, eval_every=60)
    report = train(tiny, prompts, out, config)
    assert report.acceptance > 0.5
    ask = Request("w11 w27 w3", dataclasses.replace(GREEDY, max_new_tokens=24))
    plain = Generator(tiny).generate(ask.prompt, ask.sampling)
    result = Generator(tiny, speculative=Eagle.load(out, tiny, 4)).generate(ask.prompt, ask.sampling)
    assert result.token_ids == plain.token_ids
    assert result.speculative is not None and result.speculative.acceptance_rate > 0.5, result.speculative


def test_the_command_line_trains_and_drafts_with_a_head(
    checkpoint: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZGEN_CACHE_DIR", str(tmp_path / "weights"))
    monkeypatch.setenv("ZGEN_XLA_CACHE_DIR", str(tmp_path / "xla"))
    runner = CliRunner()
    out = tmp_path / "head"
    train_args = ["--data", str(data), "--out", str(out), "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--chain-steps", "2"]
    trained = runner.invoke(app, ["eagle", "train", "--model", str(checkpoint), *train_args])
    assert trained.exit_code == 0, trained.output
    args = ["generate", "--model", str(checkpoint), "-p", PROMPTS[1], "-n", "12", "--ignore-eos", "--temperature", "0", "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    result = runner.invoke(app, [*args, "--eagle", str(out), "--num-draft-tokens", "3"])
    assert result.exit_code == 0, result.output
    out_json = json.loads(result.stdout)
    assert out_json["token_ids"] == plain["token_ids"] and out_json["speculative"]["draft_tokens"] > 0
    refused = runner.invoke(app, [*args, "--eagle", str(out), "--jacobi"])
    assert refused.exit_code != 0 and "choose one speculator" in refused.output
    # zgen batch takes the head the same way: the records are the plain ones
    source = tmp_path / "in.jsonl"
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": p}} for i, p in enumerate(PROMPTS)]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    batch = ["batch", "--model", str(checkpoint), "--input", str(source), "--quiet"]

    def texts(name: str, *flags: str) -> dict[str, str]:
        done = runner.invoke(app, [*batch, "--output", str(tmp_path / name), *flags])
        assert done.exit_code == 0, done.output
        records = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        return {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records}

    assert texts("eagle.jsonl", "--eagle", str(out)) == texts("plain.jsonl")
