"""``Eagle``: an EAGLE head as a speculator of the runtime's draft–verify–accept loop.

State per row: the target's features at every position of the row so far (handed over by every
forward pass of the loop: :class:`~zgen.runtime.speculation.FeatureObserver`), the head's own K/V,
and ``fed``: the head rows below it hold K/V made from the target's true features. Head row ``j``
reads the feature at ``j`` and the token at ``j + 1``, so with the pending token at ``p`` the rows up to
``p - 1`` can be fed; the last of them predicts the feature at ``p`` and so the first draft.

Each pass: catch up on rows a plain-decoding stretch left behind (in chunks), feed the last ``k + 1``
rows with the true features (this overwrites the rows the previous pass wrote from its predicted
features; a row's K/V depend on that row's input only, so feeding a row again is harmless), then chain
``k`` draft steps, each feeding the predicted feature and the drafted token. Drafts are drawn like the
target's tokens (the row's key and draw index); at temperature > 0 they carry their distribution, so
the loop's rejection sampling keeps the target's distribution whatever the head's quality.

Plain decode steps hand over no features (a stretch in fallback runs the plain decode loop):
``observed`` marks where each row's true features stop, and before a pass drafts the loop reads the
missing ones, at most the last :data:`~.head.HEAD_WINDOW` tokens (a pass of the target over them that
reads its cache without writing it: no prefill, no scratch cache); the head attends to that many rows,
so earlier ones are never needed. The next loop over the same rows goes on from the state the last one
left (:class:`~zgen.runtime.speculation.ResumableSpeculator`), reading only what was decoded since.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.cache.tensor import DenseKVState
from zgen.errors import ConfigError
from zgen.model import Model
from zgen.runtime.sampling import filter_logits, sample
from zgen.runtime.speculation import DraftInput, Proposal
from zgen.speculative.draft_model import CATCH_UP, draft_chain
from zgen.runtime.tree import tree_attention_mask
from zgen.speculative.eagle.head import HEAD_WINDOW, EagleHead, draft_step, draft_tree_step, fingerprint, fuse
from zgen.speculative.prompt_lookup import check_num_tokens
from zgen.speculative.tree import Expansion, TreeShape, build_tree, checked_tree


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EagleState:
    kv: DenseKVState  # the head's K/V, one layer
    features: Float[Array, "B L F"]  # the target's (unfused) features at each position
    observed: Int[Array, " B"]  # the features below it are the target's (those the head window needs)
    fed: Int[Array, " B"]  # head rows below it hold K/V from true features


class Eagle:
    """Draft up to ``num_tokens`` tokens a pass with an EAGLE ``head`` (see :mod:`.head`).

    ``adaptive``: grow the draft after full acceptance, shrink it after rejections, and decode plainly
    while fewer than 40 % of the drafts are accepted (see :mod:`zgen.runtime.speculation`).

    ``tree``: draft EAGLE-2 dynamic trees of ``num_tokens`` depths instead of chains
    (:mod:`zgen.speculative.tree`), verified in one target pass. Each node is a head row in a scratch
    slot past the pending token's, reading its parent's predicted feature and its own token and
    attending to the true rows and its ancestors only; after the pass the target's features of the
    accepted path come back like a chain's, and those rows are fed again from them.
    """

    def __init__(self, head: EagleHead, num_tokens: int = 4, *, adaptive: bool = True, tree: TreeShape | None = None) -> None:
        if not isinstance(head, EagleHead):
            raise ConfigError(f"Eagle takes an EagleHead (EagleHead.init or Eagle.load), got {type(head).__name__}")
        if not isinstance(adaptive, bool):
            raise ConfigError(f"Eagle adaptive must be a bool, got {adaptive!r}")
        self.head = head
        self._num_tokens = check_num_tokens("Eagle", num_tokens)
        self._adaptive = adaptive
        self.tree = checked_tree("Eagle", tree, self._num_tokens)
        self._fingerprint: str | None = None

    @classmethod
    def load(
        cls, path: str | Path, model: Model, num_tokens: int = 4, *, adaptive: bool = True, tree: TreeShape | None = None
    ) -> Eagle:
        """The head trained into ``path`` (``zgen eagle train``) for ``model``; a head made for another
        model is refused (:class:`~zgen.errors.CheckpointError`)."""
        from zgen.speculative.eagle.checkpoint import load_head  # the checkpoint reader imports orbax

        return cls(load_head(path, model), num_tokens, adaptive=adaptive, tree=tree)

    def __repr__(self) -> str:
        tree = "" if self.tree is None else f", tree={self.tree}"
        return f"Eagle(feature_layers={self.head.feature_layers}, num_tokens={self._num_tokens}, adaptive={self._adaptive}{tree})"

    @property
    def tree_size(self) -> int | None:
        """Nodes of each drafted tree (``None``: chains of ``num_tokens``)."""
        return None if self.tree is None else self.tree.size

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def adaptive(self) -> bool:
        return self._adaptive

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    @property
    def feature_window(self) -> int:
        return HEAD_WINDOW

    def cache_key(self) -> Hashable:
        # The compiled loop keeps this speculator and so the target's graph alive: the id is not reused.
        m = self.head.model
        return ("eagle", id(m.graph), str(m.dtype), self.head.feature_layers, self._num_tokens, self._adaptive, self.tree)

    def check_target(self, model: Model) -> None:
        if model is self.head.model:
            return
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.head.model)
        if model.config != self.head.model.config or fingerprint(model) != self._fingerprint:
            raise ConfigError(
                "this EAGLE head drafts for another model (its target's config or weights differ): use it with the "
                "model it was loaded for, or train a head for this one with `zgen eagle train`"
            )

    def device_params(self) -> Any:
        shared = self.head.joined({}, self.head.model.params)  # the target's embedding, final norm and LM head
        return self.head.params, shared

    def start(self, params: Any, history: Int[Array, "B L"], length: Int[Array, " B"]) -> EagleState:
        c = self.head.model.config
        b, width = history.shape
        features = jnp.zeros((b, width, len(self.feature_layers) * c.hidden_size), self.head.model.dtype)
        # Before it drafts, the loop reads the features of the HEAD_WINDOW tokens before the pending one
        # (observe_missing_features); the head rows before them are outside its attention window and never fed.
        scratch = 0 if self.tree is None else self.tree.expansions(self._num_tokens)  # the tree nodes' head rows
        outside = jnp.maximum(length - 1 - HEAD_WINDOW, 0)
        return EagleState(self.head.new_kv(b, width + scratch), features, outside, outside)

    def observed(self, state: EagleState) -> Int[Array, " B"]:
        return state.observed

    def observe_features(self, state: EagleState, features: Float[Array, "B T F"], positions: Int[Array, "B T"]) -> EagleState:
        rows = jnp.arange(positions.shape[0])[:, None]
        slots = jnp.where(positions >= 0, positions, state.features.shape[1])
        # A contiguous run of positions (every pass writes one) extends what is held if it starts
        # within it, or covers a whole window by itself.
        written = positions >= 0
        low = jnp.min(jnp.where(written, positions, jnp.iinfo(jnp.int32).max), axis=1)
        top = jnp.max(jnp.where(written, positions + 1, 0), axis=1)
        extends = jnp.any(written, axis=1) & (low <= jnp.maximum(state.observed, top - HEAD_WINDOW))
        return replace(
            state,
            features=state.features.at[rows, slots].set(features.astype(state.features.dtype), mode="drop"),
            observed=jnp.where(extends, jnp.maximum(state.observed, top), state.observed),
        )

    def resume(self, state: EagleState, history: Int[Array, "B L"], length: Int[Array, " B"]) -> EagleState:
        del history  # the same tokens as the state's up to the shorter length: its features and head rows hold below it
        return self.advance(state, length - 1)

    def advance(self, state: EagleState, kept: Int[Array, " B"]) -> EagleState:
        # Features from the pending token on are a rejected draft's, or not written yet.
        return replace(state, observed=jnp.minimum(state.observed, kept), fed=jnp.minimum(state.fed, kept))

    def _feed(
        self, head_params: Any, shared: Any, state: EagleState, rows: Int[Array, "B T"], after: Int[Array, "B T"],
        positions: Int[Array, "B T"], kv: DenseKVState | None = None,
    ) -> tuple[Array, Array, DenseKVState]:
        """Head rows ``rows`` from the stored true features (``after``: the token after each row)."""
        width = state.features.shape[1]
        features = jnp.take_along_axis(state.features, jnp.clip(rows, 0, width - 1)[..., None], axis=1)
        params = self.head.joined(head_params, shared)
        read = jnp.full((rows.shape[0], 1), rows.shape[1] - 1, jnp.int32)
        return draft_step(self.head.graph, params, state.kv if kv is None else kv, fuse(head_params, features), after, positions, read)

    def propose(self, params: Any, state: EagleState, draft: DraftInput) -> tuple[Proposal, EagleState]:
        head_params, shared = params
        k = self._num_tokens
        history, active, flags, sampling = draft.history, draft.active, draft.flags, draft.sampling
        b, width = history.shape
        p = draft.length - 1
        sampled = not flags.all_greedy
        vocab = self.head.model.config.vocab_size
        joined = self.head.joined(head_params, shared)

        def token_after(rows: Array) -> Array:
            return jnp.take_along_axis(history, jnp.clip(rows + 1, 0, width - 1), axis=1)

        def lagging(carry: tuple[DenseKVState, Array]) -> Array:
            return jnp.any(active & (carry[1] < p - (k + 1)))

        def catch_up(carry: tuple[DenseKVState, Array]) -> tuple[DenseKVState, Array]:
            kv, fed = carry
            rows = fed[:, None] + jnp.arange(CATCH_UP)[None, :]
            positions = jnp.where(active[:, None] & (rows < p[:, None]), rows, -1)
            kv = self._feed(head_params, shared, state, rows, token_after(rows), positions, kv)[2]
            return kv, jnp.where(active, jnp.minimum(fed + CATCH_UP, p), fed)

        kv, _ = jax.lax.while_loop(lagging, catch_up, (state.kv, state.fed))
        # The last k + 1 rows (up to p - 1) from true features; the last one predicts the first draft.
        rows = p[:, None] - (k + 1) + jnp.arange(k + 1)[None, :]
        positions = jnp.where(active[:, None] & (rows >= 0), rows, -1)
        predicted, logits, kv = self._feed(head_params, shared, state, rows, token_after(rows), positions, kv)
        if self.tree is not None:
            proposal, kv = self._propose_tree(joined, kv, draft, predicted[:, -1:], logits[:, 0])
            return proposal, replace(state, kv=kv, fed=jnp.where(active, p, state.fed))

        def draw(logits: Array, position: Array) -> tuple[Array, Array | None]:
            token = sample(logits, sampling, None, draft.keys, position, flags)
            probs = jax.nn.softmax(filter_logits(logits, sampling, None, flags), axis=-1) if sampled else None
            return token, probs

        tokens = jnp.zeros((b, k), jnp.int32)
        probs = jnp.zeros((b, k, vocab), jnp.float32) if sampled else None
        token, q = draw(logits[:, 0], p)
        tokens = tokens.at[:, 0].set(token)
        if probs is not None and q is not None:
            probs = probs.at[:, 0].set(q)
        steps = jnp.max(jnp.where(active, draft.num_tokens, 0))

        def more(carry: tuple[Any, ...]) -> Array:
            return carry[0] < steps

        def step(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            i, kv, feature, tokens, probs = carry
            position = p + i - 1  # the row of the feature predicted for position p + i - 1 and draft i
            fed_token = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)
            at = jnp.where(active & (i < draft.num_tokens), position, -1)[:, None]
            feature, logits, kv = draft_step(self.head.graph, joined, kv, feature, fed_token, at, jnp.zeros((b, 1), jnp.int32))
            token, q = draw(logits[:, 0], p + i)
            tokens = tokens.at[:, i].set(token)
            if probs is not None and q is not None:
                probs = probs.at[:, i].set(q)
            return i + 1, kv, feature, tokens, probs

        start = (jnp.asarray(1, jnp.int32), kv, predicted[:, -1:], tokens, probs)
        _, kv, _, tokens, probs = draft_chain(step, start, more, k)
        count = jnp.where(active, draft.num_tokens, 0)
        return Proposal(tokens, count, probs), replace(state, kv=kv, fed=jnp.where(active, p, state.fed))

    def _propose_tree(
        self, joined: Any, kv: DenseKVState, draft: DraftInput, root: Float[Array, "B 1 H"], logits: Float[Array, "B V"]
    ) -> tuple[Proposal, DenseKVState]:
        """EAGLE-2's dynamic tree (:func:`~zgen.speculative.tree.build_tree`) from the head's
        distributions. Fed node ``e`` (``width`` of them per depth) is head row ``p + depth - 1`` stored
        in scratch slot ``p + e`` (the true rows end at ``p - 1``): it reads the feature its parent
        predicted (a depth-1 node: ``root``, predicted by row ``p - 1``) and its own token."""
        assert self.tree is not None
        active, p = draft.active, draft.length - 1
        b, width = p.shape[0], self.tree.width
        fed = jnp.arange(self.tree.expansions(self._num_tokens))[None, :]
        scratch = p[:, None] + fed
        placed = p[:, None] + fed // width  # each fed node's head row
        graph = self.head.graph

        def expand(carry: tuple[DenseKVState, Array], nodes: Expansion) -> tuple[Array, tuple[DenseKVState, Array]]:
            kv, predicted = carry
            if nodes.depth == 1:
                inputs = jnp.broadcast_to(root, (b, width, root.shape[-1]))
            else:  # the node one depth up that each one descends from
                parent = nodes.first - width + jnp.argmax(nodes.sees[:, :, nodes.first - width : nodes.first], axis=2)
                inputs = jnp.take_along_axis(predicted, parent[..., None], axis=1)
            positions = jnp.where(active[:, None], jnp.broadcast_to(p[:, None] + nodes.depth - 1, nodes.tokens.shape), -1)
            slots = jnp.where(active[:, None], scratch[:, nodes.first : nodes.first + width], -1)
            visible = tree_attention_mask(positions, p, scratch, placed, nodes.sees, kv.capacity, HEAD_WINDOW)
            reads = jnp.broadcast_to(jnp.arange(width)[None, :], nodes.tokens.shape)
            out, node_logits, kv = draft_tree_step(graph, joined, kv, inputs.astype(root.dtype), nodes.tokens, positions, slots, visible, reads)
            predicted = predicted.at[:, nodes.first : nodes.first + width].set(out.astype(predicted.dtype))
            return jax.nn.log_softmax(node_logits, axis=-1), (kv, predicted)

        start = (kv, jnp.zeros((b, fed.shape[1], root.shape[-1]), root.dtype))
        proposal, (kv, _) = build_tree(jax.nn.log_softmax(logits, axis=-1), expand, start, self.tree, self._num_tokens)
        return replace(proposal, count=jnp.where(active, proposal.count, 0)), kv
