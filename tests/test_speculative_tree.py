"""Token-tree speculation: greedy and sampled output is plain decoding's on every cache kind, a tree
pass attends and stores like feeding its accepted path, the tree acceptance rules keep the target's
distribution, and the EAGLE-2 builder keeps the most likely candidates."""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_grammar import tiny  # noqa: F401 - a tiny model with a real vocabulary
from test_speculative import _assert_follows
from zgen import Generator, Grammar, SamplingConfig
from zgen.cache.factory import CacheOption, kv_dtype, paged_kv
from zgen.cache.tensor import DenseKVState
from zgen.config import ModelConfig
from zgen.contexts import Context
from zgen.errors import ConfigError
from zgen.generator import Request
from zgen.model import Model, random_model
from zgen.runtime.engine import Engine
from zgen.runtime.sampling import SamplingFlags, SamplingParams, filter_logits
from zgen.runtime.speculation import DraftInput, Proposal, verify_tree
from zgen.runtime.step import ModelSpec, Params, forward
from zgen.runtime.stop import StopCondition
from zgen.runtime.tree import ancestors, commit_path, forward_tree, tree_attention_mask
from zgen.speculative import DraftModel, PromptLookup, TreeShape
from zgen.speculative.tree import Expansion, build_tree

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True)
PROMPTS = [[5, 9, 12, 5, 9, 12, 5, 9, 3], [7, 8, 7, 8, 7], [20, 21, 22, 23, 24, 25, 20, 21, 22, 30, 31]]


def _config(sliding_window: int | None = None) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=8, max_position_embeddings=256, sliding_window=sliding_window,
    )


@pytest.fixture(scope="module")
def target() -> Model:
    """Untied random weights: varied greedy text, and a one-layer early exit that guesses it now and then."""
    return random_model(_config(), dtype="float32", seed=1)


def _requests(sampling: SamplingConfig = GREEDY) -> list[Request]:
    return [Request(p, sampling) for p in PROMPTS]


def _ids(results: list[Any]) -> list[list[int]]:
    return [r.token_ids for r in results]


@pytest.mark.parametrize(
    "options", [(), (paged_kv(4),), (paged_kv(4), kv_dtype("fp8"))], ids=["dense", "paged", "paged-fp8"]
)
def test_greedy_tree_speculation_equals_plain(target: Model, options: tuple[CacheOption, ...]) -> None:
    """An early-exit draft's trees are partly accepted, along first and later children; the rejected
    nodes' K/V never show. The dense cache runs with the adaptive depth (and fallback)."""
    plain = Generator(target, *options).batch_generate(_requests())
    tree = TreeShape(width=3, size=10)
    speculator = DraftModel.early_exit(target, layers=1, num_tokens=4, adaptive=not options, tree=tree)
    spec = Generator(target, *options, speculative=speculator).batch_generate(_requests())
    assert _ids(spec) == _ids(plain)
    for result, reference in zip(spec, plain, strict=True):
        assert result.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    stats = [r.speculative for r in spec if r.speculative is not None]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)


def test_sampled_tree_speculation_is_plain_sampling_and_a_perfect_draft_is_always_accepted() -> None:
    """A tree drafts deterministically (top-k), so a sampled row follows the child equal to the
    target's own draw: plain sampling token for token. With a sliding window shorter than a path,
    and the target drafting for itself: every greedy tree is accepted as deep as it goes."""
    model = random_model(_config(sliding_window=3), dtype="float32", seed=2)
    sampled = [SamplingConfig(temperature=0.8, top_k=20, seed=n, max_new_tokens=20, ignore_eos=True) for n in (3, 4)]
    requests = [Request(PROMPTS[0], GREEDY), *(Request(prompt, config) for prompt, config in zip(PROMPTS[1:], sampled, strict=True))]
    plain = Generator(model).batch_generate(requests)
    self_draft = DraftModel(model, 3, adaptive=False, tree=TreeShape(width=2, size=6))
    spec = Generator(model, speculative=self_draft).batch_generate(requests)
    assert _ids(spec) == _ids(plain)
    greedy = spec[0].speculative
    assert greedy is not None and greedy.acceptance_rate == 1.0 and greedy.mean_accepted_per_step >= 2


def test_prompt_lookup_branches_merge_into_one_tree() -> None:
    """``PromptLookup(branches=R)``: what followed the R best matches (longest, then latest), each
    branch hung below the first branch that agrees with its prefix."""
    history = [1, 2, 3, 7, 1, 2, 4, 8, 1, 5, 6, 9, 1]  # the pending 1 followed 1 three times before
    row = np.zeros((1, 16), np.int32)
    row[0, : len(history)] = history
    greedy = SamplingConfig(temperature=0.0)
    draft = DraftInput(
        jnp.asarray(row), jnp.asarray([len(history)]), jnp.asarray([3]), jnp.asarray([True]), jnp.zeros((1, 2), jnp.uint32),
        SamplingParams.from_configs([greedy], 64), SamplingFlags.from_configs([greedy], 64),
    )
    proposal, _ = PromptLookup(1, 3, branches=4).propose((), (), draft)
    assert proposal.parents is not None and proposal.depth is not None
    # Latest match first: [5 6 9], then [2 4 8] and [2 3 7] (sharing the node 2); the fourth branch finds nothing.
    assert proposal.tokens[0, :9].tolist() == [5, 6, 9, 2, 4, 8, 2, 3, 7]
    assert proposal.parents[0, :9].tolist() == [-1, 0, 1, -1, 3, 4, -1, 3, 7]
    assert proposal.depth[0, :9].tolist() == [1, 2, 3] * 3
    assert int(proposal.count[0]) == 9
    assert PromptLookup(3, 4, branches=2).tree_size == 8 and PromptLookup(3, 4).tree_size is None
    with pytest.raises(ConfigError, match="branches"):
        PromptLookup(3, 8, branches=17)


@pytest.mark.parametrize("options", [(), (paged_kv(4),)], ids=["dense", "paged"])
def test_prompt_lookup_trees_decode_plainly(target: Model, options: tuple[CacheOption, ...]) -> None:
    sampled = SamplingConfig(temperature=0.8, top_k=20, seed=3, max_new_tokens=20, ignore_eos=True)
    for sampling in (GREEDY, sampled):
        plain = Generator(target, *options).batch_generate(_requests(sampling))
        spec = Generator(target, *options, speculative=PromptLookup(2, 4, branches=3)).batch_generate(_requests(sampling))
        assert _ids(spec) == _ids(plain)
        assert sum(r.speculative.draft_tokens for r in spec if r.speculative is not None) > 0


def test_a_tree_pass_attends_and_stores_like_feeding_its_accepted_path(target: Model) -> None:
    """Logits at every entry of a tree equal a causal pass over that entry's path, and after the
    accepted path's K/V are written back the cache holds what feeding only the path stores."""
    spec, params = ModelSpec(target.graph, None), cast(Params, target.params)
    context = jnp.asarray([[5, 9, 12, 5, 9, 12, 5, 9, 3, 4]])
    p = context.shape[1] - 1  # the pending token's position
    kv = DenseKVState.zeros(3, 1, 32, 2, 8, jnp.float32, attention="einsum")
    _, kv = jax.jit(lambda *args: forward(spec, params, *args))(kv, context[:, :p], jnp.arange(p)[None], jnp.zeros((1, 1), jnp.int32))
    nodes = jnp.asarray([[10, 11, 12, 13, 14]])
    parents, depth = jnp.asarray([[-1, -1, 1, 0, 2]]), jnp.asarray([[1, 1, 2, 2, 3]])
    tokens = jnp.concatenate([context[:, p:], nodes], axis=1)
    positions = p + jnp.concatenate([jnp.zeros((1, 1), jnp.int32), depth], axis=1)
    slots = p + jnp.arange(6)[None]
    visible = tree_attention_mask(positions, jnp.asarray([p]), slots, positions, ancestors(parents, 3), kv.capacity, None)
    run_tree = jax.jit(lambda *args: forward_tree(spec, params, *args))
    run_path = jax.jit(lambda *args: forward(spec, params, *args))
    logits, tree_kv, written = run_tree(kv, tokens, positions, slots, visible, jnp.arange(6)[None])
    for path in ([0, 2, 3, 5], [0, 1, 4]):  # entries: the pending token, then nodes 1 -> 2 -> 4, or 0 -> 3
        fed = tokens[:, jnp.asarray(path)]
        reference, path_kv = run_path(kv, fed, p + jnp.arange(len(path))[None], jnp.arange(len(path))[None])
        np.testing.assert_allclose(logits[0, jnp.asarray(path)], reference[0], atol=1e-5)
        committed = commit_path(tree_kv, written, jnp.asarray([path[1:]]), p + 1 + jnp.arange(len(path) - 1)[None])
        end = p + len(path)
        for layer in range(3):
            np.testing.assert_allclose(committed.k[layer][:, :end], path_kv.k[layer][:, :end], atol=1e-5)
            np.testing.assert_allclose(committed.v[layer][:, :end], path_kv.v[layer][:, :end], atol=1e-5)


def _tree_rows(rows: int, rng: np.random.Generator, q: np.ndarray | None, fixed: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
    """Four nodes: two children of the pending token, one child below each. Drawn i.i.d. from ``q``
    (siblings from the same ``q[0]``, grandchildren from ``q[1]``), else the ``fixed`` tokens."""
    if q is None:
        return np.tile(np.asarray([fixed], np.int32), (rows, 1)), None
    which = [0, 0, 1, 1]
    tokens = np.stack([rng.choice(q.shape[1], size=rows, p=q[w]) for w in which], axis=1).astype(np.int32)
    return tokens, np.broadcast_to(q[which][None], (rows, 4, q.shape[1]))


@pytest.mark.parametrize("sampled_tree", [False, True], ids=["top-k-tree", "sampled-tree"])
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 4)])
def test_tree_acceptance_keeps_the_target_distribution(sampled_tree: bool, temperature: float, top_k: int) -> None:
    """verify_tree on a vocabulary of 6, fixed target logits at the tree's five entries, one row per
    seed: the first produced token follows the target at the pending token and the second, on rows
    that accepted a child, the target at that child (chi-square at a fixed seed, far below the 0.1 %
    critical value), for a deterministic tree (exact match) and a sampled one (recursive rejection)."""
    rows, vocab = 40_000, 6
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 5, vocab)) * 1.5, jnp.float32)
    q = rng.dirichlet(np.ones(vocab), size=2).astype(np.float32) if sampled_tree else None
    ranked = np.argsort(-np.asarray(logits[0]), axis=-1)  # fixed nodes among the likely tokens (top-k keeps them)
    tokens, probs = _tree_rows(rows, rng, q, [ranked[0, 0], ranked[0, 2], ranked[1, 1], ranked[2, 0]])
    proposal = Proposal(
        jnp.asarray(tokens), jnp.full(rows, 4, jnp.int32), None if probs is None else jnp.asarray(probs),
        parents=jnp.tile(jnp.asarray([[-1, -1, 0, 1]], jnp.int32), (rows, 1)), depth=jnp.tile(jnp.asarray([[1, 1, 2, 2]], jnp.int32), (rows, 1)),
    )
    config = SamplingConfig(temperature=temperature, top_k=top_k)
    sampling = SamplingParams.from_configs([config] * rows, vocab)
    flags = SamplingFlags.from_configs([config], vocab)
    keys = jnp.asarray(rng.integers(0, 2**32, size=(rows, 2), dtype=np.uint32))
    check = jax.jit(verify_tree, static_argnames=("max_depth", "flags"))
    produced, _, accepted, path = check(
        jnp.broadcast_to(logits, (rows, 5, vocab)), proposal, jnp.ones((rows, 4), bool), jnp.zeros(rows, jnp.int32), max_depth=2,
        sampling=sampling, keys=keys, flags=flags,
    )
    produced, accepted, path = np.asarray(produced), np.asarray(accepted), np.asarray(path)
    one = SamplingParams.from_configs([config], vocab)
    target = np.asarray(jax.nn.softmax(filter_logits(logits[0], jax.tree_util.tree_map(lambda x: jnp.repeat(x, 5), one), None, flags)))
    assert 0.05 < accepted.mean() < 1.95 and (accepted == 2).any()  # rejections, and acceptances at both depths
    _assert_follows(produced[:, 0], target[0])
    for entry in (1, 2):  # below either child of the pending token
        below = (accepted >= 1) & (path[:, 0] == entry)
        assert below.sum() > 1000
        _assert_follows(produced[below, 1], target[entry])


def test_build_tree_keeps_the_most_likely_candidates() -> None:
    """On a drafter whose next-token log-probabilities depend on the last token only, the tree is the
    ``size`` candidates of highest cumulative log-probability among EAGLE-2's expansions (enumerated
    here in numpy), parents before children, each one deeper than its parent, and every expanded
    node saw exactly its ancestors."""
    vocab, width, depth, size = 7, 2, 3, 5
    rng = np.random.default_rng(4)
    table = np.log(rng.dirichlet(np.ones(vocab), size=vocab)).astype(np.float32)  # [last token, next token]
    root = np.log(rng.dirichlet(np.ones(vocab), size=1)).astype(np.float32)
    fed: list[Expansion] = []

    def expand(state: Any, nodes: Expansion) -> tuple[jax.Array, Any]:
        fed.append(nodes)
        return jnp.asarray(table)[nodes.tokens], state

    tree, _ = build_tree(jnp.asarray(root), expand, None, TreeShape(width, size), depth)
    assert tree.parents is not None and tree.depth is not None and len(fed) == depth - 1
    tokens, parents, depths = (np.asarray(x)[0] for x in (tree.tokens, tree.parents, tree.depth))
    # EAGLE-2 by hand: expand the `width` best of each depth by their `width` best next tokens.
    candidates: list[tuple[float, tuple[int, ...]]] = [(float(root[0, t]), (int(t),)) for t in np.argsort(-root[0], kind="stable")[:width]]
    frontier = candidates
    for _ in range(depth - 1):
        children: list[tuple[float, tuple[int, ...]]] = [
            (s + float(table[path[-1], t]), (*path, int(t))) for s, path in frontier for t in np.argsort(-table[path[-1]], kind="stable")[:width]
        ]
        candidates += children
        frontier = sorted(children, key=lambda c: -c[0])[:width]
    best = sorted(c[0] for c in candidates)[-size:]

    def path_of(i: int) -> tuple[int, ...]:
        return (*path_of(int(parents[i])), int(tokens[i])) if i >= 0 else ()

    scores = {path: s for s, path in candidates}
    chosen = [scores[path_of(i)] for i in range(size)]
    np.testing.assert_allclose(sorted(chosen), best, rtol=1e-5)
    assert all(parents[i] < i and depths[i] == (1 if parents[i] < 0 else depths[parents[i]] + 1) for i in range(size))
    for nodes in fed[1:]:  # a node of depth 2 sees its parent (fed at depth 1) and itself
        sees = np.asarray(nodes.sees)[0]
        assert sees.sum(axis=1).tolist() == [nodes.depth] * width


def test_tree_refusals(target: Model) -> None:
    with pytest.raises(ConfigError, match="TreeShape width"):
        TreeShape(width=0)
    with pytest.raises(ConfigError, match="TreeShape size"):
        TreeShape(size=1000)
    with pytest.raises(ConfigError, match="candidates"):
        DraftModel(target, 1, tree=TreeShape(width=2, size=3))  # depth 1: two candidates
    with pytest.raises(ConfigError, match="TreeShape"):
        DraftModel(target, 2, tree=(2, 4))  # type: ignore[arg-type]
    for trees in (DraftModel.early_exit(target, layers=1, num_tokens=2, tree=TreeShape(width=2, size=4)), PromptLookup(2, 4, branches=2)):
        with pytest.raises(ConfigError, match="token trees need a KV format"):  # q4 codes keys with their positions
            Generator(target, paged_kv(4), kv_dtype("q4"), speculative=trees).generate("w1 w2", GREEDY)


def test_a_tree_drafter_leaves_rows_under_a_grammar_to_plain_decoding(tiny: Model) -> None:  # noqa: F811
    """Grammar masks follow chains of drafts: rows under a grammar decode plainly with a tree
    speculator, which gives the same tokens."""
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=30, grammar=Grammar.regex(r"(abc ){4}"))
    plain = Generator(tiny).generate("abc abc", sampling)
    speculator = DraftModel(tiny, 3, adaptive=False, tree=TreeShape(width=2, size=4))
    result = Generator(tiny, speculative=speculator).generate("abc abc", sampling)
    assert result.token_ids == plain.token_ids and result.speculative is None


def test_contexts_with_masked_tokens_speculate_with_trees(target: Model) -> None:
    """A context hides tokens from attention (a token mask cutting through a page, on a masked paged
    state): tree passes keep the mask, and the output is plain decoding's."""
    engine = Engine(target, paged_kv(4))
    limit = StopCondition.from_sampling(GREEDY, ())

    def context() -> Context:
        ctx = Context(engine, seed=1)
        ctx.fill_tokens(PROMPTS[2])
        ctx.mask_token_range(2, 5)
        return ctx

    plain = context().generate_result(None, limit)
    speculator = DraftModel.early_exit(target, layers=1, num_tokens=3, adaptive=False, tree=TreeShape(width=2, size=6))
    result = context().generate_result(None, limit, speculative=speculator)
    assert result.token_ids == plain.token_ids and result.speculative is not None and result.speculative.steps > 0
