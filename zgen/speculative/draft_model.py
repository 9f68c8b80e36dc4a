"""A draft model: a smaller model with the target's vocabulary drafts, the target verifies.

The draft keeps its own dense K/V for the rows of a loop (made empty when the loop starts, inside the
same compiled call, and fed each row's tokens when the row first drafts, so a row that decodes plainly
from its first pass never costs the draft a prefill; kept by the engine for the next loop over the
same rows, which goes on from it: :meth:`DraftModel.resume`), and tracks how far each row's K/V is valid:
after a pass whose drafts were all accepted, the last draft was never fed to the draft model, so the
next pass feeds it together with the new pending token (the classic off-by-one after acceptance);
after a rejection the K/V past the kept tokens are stale and overwritten. After a tree pass only the
pending token's K/V are in place (the nodes sat in scratch slots), so the next pass feeds the accepted
path with the new pending token. A row that decoded plainly for a while (adaptive fallback) catches up
in chunks before it drafts again; a row further behind than a chunk (never fed yet, or back from a
long fallback) is fed in one pass over the history.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.cache.tensor import DenseKVState
from zgen.errors import ConfigError
from zgen.graph.decoder import build_decoder
from zgen.model import LoadTimings, Model, attached
from zgen.pallas.common import platform
from zgen.runtime.sampling import filter_logits, sample
from zgen.runtime.speculation import PROBE_AFTER, DraftInput, Proposal
from zgen.runtime.step import ModelSpec, forward
from zgen.runtime.tree import forward_tree, tree_attention_mask
from zgen.shapes import next_pow2
from zgen.speculative.prompt_lookup import check_num_tokens
from zgen.speculative.tree import Expansion, TreeShape, build_tree, checked_tree

#: Tokens a lagging row feeds per catch-up forward pass (a row falls behind only while it decodes plainly).
CATCH_UP = next_pow2(PROBE_AFTER + 2)

Carry = TypeVar("Carry")


def unrolled_drafts() -> bool:
    """Whether a chain's draft steps are traced out, all ``k - 1`` after the first draft, rather than
    looped over the longest draft asked for: on a GPU, XLA brings every loop predicate to the host
    and the GPU waits for the steps after it to be launched (a non-adaptive EAGLE pass of SmolLM2 on
    an NVIDIA H200 spent 2.95 ms, 1.18 of them in kernels); on a CPU a predicate costs nothing and a
    step past the longest draft costs its forward pass."""
    return platform() == "gpu"


def draft_chain(step: Callable[[Carry], Carry], start: Carry, more: Callable[[Carry], Array], num_tokens: int) -> Carry:
    """A chain's draft steps from ``start`` (the first draft drawn): ``step`` while ``more``, or all
    ``num_tokens - 1`` of them traced out (:func:`unrolled_drafts`; a step past a row's draft writes
    nothing and its draws go unverified)."""
    if not unrolled_drafts():
        return jax.lax.while_loop(more, step, start)
    carry = start
    for _ in range(1, num_tokens):
        carry = step(carry)
    return carry


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftState:
    kv: DenseKVState
    fed: Int[Array, " B"]  # positions below it hold the draft's valid K/V


class DraftModel:
    """Draft with ``model`` (same vocabulary as the target), up to ``num_tokens`` tokens a pass.

    ``adaptive``: grow the draft after full acceptance, shrink it after rejections, and decode plainly
    while fewer than 40 % of the drafts are accepted (probing again later); see
    :mod:`zgen.runtime.speculation`.

    ``tree``: draft EAGLE-2 dynamic trees of ``num_tokens`` depths instead of chains
    (:mod:`zgen.speculative.tree`), verified in one target pass. The nodes are fed through this
    model's own cache in scratch slots past the pending token, each attending to its ancestors; the
    accepted path is fed again at its own positions on the next pass.
    """

    def __init__(self, model: Model, num_tokens: int = 4, *, adaptive: bool = True, tree: TreeShape | None = None) -> None:
        if not isinstance(model, Model):
            raise ConfigError(f"DraftModel takes a loaded zgen Model, got {type(model).__name__}")
        if not isinstance(adaptive, bool):
            raise ConfigError(f"DraftModel adaptive must be a bool, got {adaptive!r}")
        self.model = model
        self._num_tokens = check_num_tokens("DraftModel", num_tokens)
        self._adaptive = adaptive
        self.tree = checked_tree("DraftModel", tree, self._num_tokens)
        self.spec = ModelSpec(model.graph, model.config.sliding_window)

    @classmethod
    def early_exit(
        cls, model: Model, layers: int, num_tokens: int = 4, *, adaptive: bool = True, tree: TreeShape | None = None
    ) -> DraftModel:
        """A self-speculative draft: ``model``'s first ``layers`` decoder layers, then its own final norm
        and LM head (the weights are shared, not copied).

        A model not trained for early exit predicts poorly from its middle layers: on SmolLM2-135M the
        greedy token after N of 30 layers agrees with the full model's on 0 % (N=8), 6 % (15), 18 % (22),
        44 % (27) and 56 % (29) of a passage's positions, so the adaptive fallback mostly decodes plainly.
        """
        total = model.config.num_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= total:
            raise ConfigError(f"early_exit layers must be an integer in [1, {total}] (the model's layers), got {layers!r}")
        config = replace(model.config, num_layers=layers)
        # One graph per target and depth: drafts of it share their compiled loops (keyed by the graph);
        # the weights are the target's as they are now (an adapter pushed since merged into them).
        graph = attached(model, f"early-exit-{layers}", lambda: build_decoder(config))
        params = {name: model.params[name] for name in graph.param_shapes()}
        timings = LoadTimings("early-exit", 0.0, 0.0)
        draft = Model(config, model.tokenizer, graph, params, model.dtype, model.source, timings)
        return cls(draft, num_tokens, adaptive=adaptive, tree=tree)

    def __repr__(self) -> str:
        tree = "" if self.tree is None else f", tree={self.tree}"
        return f"DraftModel({self.model.config.num_layers} layers, num_tokens={self._num_tokens}, adaptive={self._adaptive}{tree})"

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def adaptive(self) -> bool:
        return self._adaptive

    @property
    def tree_size(self) -> int | None:
        """Nodes of each drafted tree (``None``: chains of ``num_tokens``)."""
        return None if self.tree is None else self.tree.size

    def cache_key(self) -> Hashable:
        # Drafts over one graph object (weights are arguments) share a compiled loop; the compiled loop
        # keeps this draft, and so its graph, alive, so the id is never reused for another graph.
        return ("draft-model", id(self.model.graph), str(self.model.dtype), self._num_tokens, self._adaptive, self.tree)

    def check_target(self, model: Model) -> None:
        mine, theirs = self.model.tokenizer, model.tokenizer
        if self.model.config.vocab_size != model.config.vocab_size or mine.backend.get_vocab() != theirs.backend.get_vocab():
            raise ConfigError(
                f"the draft model's vocabulary ({self.model.config.vocab_size} ids) is not the target's "
                f"({model.config.vocab_size} ids, same tokens required): draft with a model of the same "
                "tokenizer, or with DraftModel.early_exit(target, layers=N)"
            )

    def device_params(self) -> Any:
        return self.model.params

    def start(self, params: Any, history: Int[Array, "B L"], length: Int[Array, " B"]) -> DraftState:
        del params  # nothing is fed until a row drafts
        c = self.model.config
        b, width = history.shape
        scratch = 0 if self.tree is None else self.tree.expansions(self._num_tokens)  # the nodes a tree build feeds
        kv = DenseKVState.zeros(c.num_layers, b, width + scratch, c.num_kv_heads, c.head_dim, self.model.dtype)
        return DraftState(kv, jnp.zeros_like(length))

    def resume(self, state: DraftState, history: Int[Array, "B L"], length: Int[Array, " B"]) -> DraftState:
        del history  # the same tokens as the state's up to the shorter length: what it fed stays valid below it
        return replace(state, fed=jnp.minimum(state.fed, length - 1))

    def advance(self, state: DraftState, kept: Int[Array, " B"]) -> DraftState:
        return replace(state, fed=jnp.minimum(state.fed, kept))

    def propose(self, params: Any, state: DraftState, draft: DraftInput) -> tuple[Proposal, DraftState]:
        k = self._num_tokens
        history, active, flags, sampling = draft.history, draft.active, draft.flags, draft.sampling
        b = history.shape[0]
        p = draft.length - 1
        sampled = not flags.all_greedy
        vocab = self.model.config.vocab_size

        def feed(kv: DenseKVState, tokens: Array, positions: Array) -> tuple[Array, DenseKVState]:
            read = jnp.full((b, 1), tokens.shape[1] - 1, jnp.int32)
            logits, kv = forward(self.spec, params, kv, tokens, positions, read)
            return logits[:, 0], kv

        # The last feed ends at the pending token: after a chain pass the token before it may be unfed
        # (all drafts accepted); after a tree pass the whole accepted path is (nodes sat in scratch slots).
        tail = 2 if self.tree is None else k + 1

        end = p - tail + 1  # where the last feed begins

        def prefill(kv: DenseKVState, fed: Array) -> tuple[DenseKVState, Array]:
            slots = jnp.arange(history.shape[1])[None, :]
            positions = jnp.where(active[:, None] & (slots >= fed[:, None]) & (slots < end[:, None]), slots, -1)
            _, kv = forward(self.spec, params, kv, history, positions, jnp.zeros((b, 1), jnp.int32))
            return kv, jnp.where(active, jnp.maximum(fed, end), fed)

        def lagging(carry: tuple[DenseKVState, Array]) -> Array:
            return jnp.any(active & (carry[1] < end))

        def catch_up(carry: tuple[DenseKVState, Array]) -> tuple[DenseKVState, Array]:
            kv, fed = carry
            at = fed[:, None] + jnp.arange(CATCH_UP)[None, :]
            positions = jnp.where(active[:, None] & (at < p[:, None]), at, -1)
            _, kv = feed(kv, jnp.take_along_axis(history, jnp.clip(at, 0, history.shape[1] - 1), axis=1), positions)
            return kv, jnp.where(active, jnp.minimum(fed + CATCH_UP, p), fed)

        far = jnp.any(active & (state.fed < end - CATCH_UP))
        kv, fed = jax.lax.cond(far, prefill, lambda kv, fed: (kv, fed), state.kv, state.fed)
        kv, fed = jax.lax.while_loop(lagging, catch_up, (kv, fed))
        at = end[:, None] + jnp.arange(tail)[None, :]
        positions = jnp.where(active[:, None] & (at >= fed[:, None]), at, -1)
        logits, kv = feed(kv, jnp.take_along_axis(history, jnp.maximum(at, 0), axis=1), positions)
        if self.tree is not None:
            return self._propose_tree(params, kv, fed, draft, logits)

        def draw(logits: Array, position: Array) -> tuple[Array, Array | None]:
            token = sample(logits, sampling, None, draft.keys, position, flags)
            probs = jax.nn.softmax(filter_logits(logits, sampling, None, flags), axis=-1) if sampled else None
            return token, probs

        tokens = jnp.zeros((b, k), jnp.int32)
        probs = jnp.zeros((b, k, vocab), jnp.float32) if sampled else None
        token, q = draw(logits, p)
        tokens = tokens.at[:, 0].set(token)
        if probs is not None and q is not None:
            probs = probs.at[:, 0].set(q)
        steps = jnp.max(jnp.where(active, draft.num_tokens, 0))

        def more(carry: tuple[Any, ...]) -> Array:
            return carry[0] < steps

        def step(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            i, kv, tokens, probs = carry
            position = p + i
            fed_token = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)
            logits, kv = feed(kv, fed_token, jnp.where(active & (i < draft.num_tokens), position, -1)[:, None])
            token, q = draw(logits, position)
            tokens = tokens.at[:, i].set(token)
            if probs is not None and q is not None:
                probs = probs.at[:, i].set(q)
            return i + 1, kv, tokens, probs

        _, kv, tokens, probs = draft_chain(step, (jnp.asarray(1, jnp.int32), kv, tokens, probs), more, k)
        # Fed: the pending token at p and drafts 1 .. n-1 at p+1 .. p+n-1.
        fed = jnp.where(active, p + jnp.maximum(jnp.minimum(draft.num_tokens, steps), 1), fed)
        count = jnp.where(active, draft.num_tokens, 0)
        return Proposal(tokens, count, probs), DraftState(kv, fed)

    def _propose_tree(
        self, params: Any, kv: DenseKVState, fed: Int[Array, " B"], draft: DraftInput, logits: Float[Array, "B V"]
    ) -> tuple[Proposal, DraftState]:
        """EAGLE-2's dynamic tree (:func:`~zgen.speculative.tree.build_tree`) from this model's
        distributions; the nodes it feeds sit in scratch slots past the pending token, each seeing its
        ancestors only, and are fed again (the accepted ones) at their own positions next pass."""
        assert self.tree is not None
        active, p = draft.active, draft.length - 1
        width = self.tree.width
        fed_nodes = jnp.arange(self.tree.expansions(self._num_tokens))[None, :]
        scratch = p[:, None] + 1 + fed_nodes
        placed = p[:, None] + 1 + fed_nodes // width  # the positions of the fed nodes (width of them per depth)

        def expand(kv: DenseKVState, nodes: Expansion) -> tuple[Array, DenseKVState]:
            positions = jnp.where(active[:, None], jnp.broadcast_to(p[:, None] + nodes.depth, nodes.tokens.shape), -1)
            slots = jnp.where(active[:, None], scratch[:, nodes.first : nodes.first + width], -1)
            visible = tree_attention_mask(positions, p + 1, scratch, placed, nodes.sees, kv.capacity, self.spec.sliding_window)
            reads = jnp.broadcast_to(jnp.arange(width)[None, :], nodes.tokens.shape)
            out, kv, _ = forward_tree(self.spec, params, kv, nodes.tokens, positions, slots, visible, reads)
            return jax.nn.log_softmax(out, axis=-1), kv

        proposal, kv = build_tree(jax.nn.log_softmax(logits, axis=-1), expand, kv, self.tree, self._num_tokens)
        proposal = replace(proposal, count=jnp.where(active, proposal.count, 0))
        return proposal, DraftState(kv, jnp.where(active, p + 1, fed))
