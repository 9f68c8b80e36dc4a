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

When the loop starts, it hands over the target's features of the last :data:`~.head.HEAD_WINDOW`
tokens of each row (a pass of the target over them that reads its cache without writing it: no
prefill, no scratch cache); the head attends to that many rows, so earlier ones are never needed.
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
from zgen.speculative.draft_model import CATCH_UP
from zgen.speculative.eagle.head import HEAD_WINDOW, EagleHead, draft_step, fingerprint, fuse
from zgen.speculative.prompt_lookup import check_num_tokens


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EagleState:
    kv: DenseKVState  # the head's K/V, one layer
    features: Float[Array, "B L F"]  # the target's (unfused) features at each position
    fed: Int[Array, " B"]  # head rows below it hold K/V from true features


class Eagle:
    """Draft up to ``num_tokens`` tokens a pass with an EAGLE ``head`` (see :mod:`.head`).

    ``adaptive``: grow the draft after full acceptance, shrink it after rejections, and decode plainly
    while fewer than 40 % of the drafts are accepted (see :mod:`zgen.runtime.speculation`).
    """

    def __init__(self, head: EagleHead, num_tokens: int = 4, *, adaptive: bool = True) -> None:
        if not isinstance(head, EagleHead):
            raise ConfigError(f"Eagle takes an EagleHead (EagleHead.init or Eagle.load), got {type(head).__name__}")
        if not isinstance(adaptive, bool):
            raise ConfigError(f"Eagle adaptive must be a bool, got {adaptive!r}")
        self.head = head
        self._num_tokens = check_num_tokens("Eagle", num_tokens)
        self._adaptive = adaptive
        self._fingerprint: str | None = None

    @classmethod
    def load(cls, path: str | Path, model: Model, num_tokens: int = 4, *, adaptive: bool = True) -> Eagle:
        """The head trained into ``path`` (``zgen eagle train``) for ``model``; a head made for another
        model is refused (:class:`~zgen.errors.CheckpointError`)."""
        from zgen.speculative.eagle.checkpoint import load_head  # the checkpoint reader imports orbax

        return cls(load_head(path, model), num_tokens, adaptive=adaptive)

    def __repr__(self) -> str:
        return f"Eagle(feature_layers={self.head.feature_layers}, num_tokens={self._num_tokens}, adaptive={self._adaptive})"

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
        return ("eagle", id(m.graph), str(m.dtype), self.head.feature_layers, self._num_tokens, self._adaptive)

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
        # The loop hands over the features of the HEAD_WINDOW tokens before the pending one (observe_features);
        # the head rows before them are outside its attention window and never fed.
        return EagleState(self.head.new_kv(b, width), features, jnp.maximum(length - 1 - HEAD_WINDOW, 0))

    def observe_features(self, state: EagleState, features: Float[Array, "B T F"], positions: Int[Array, "B T"]) -> EagleState:
        rows = jnp.arange(positions.shape[0])[:, None]
        slots = jnp.where(positions >= 0, positions, state.features.shape[1])
        return replace(state, features=state.features.at[rows, slots].set(features.astype(state.features.dtype), mode="drop"))

    def advance(self, state: EagleState, kept: Int[Array, " B"]) -> EagleState:
        return replace(state, fed=jnp.minimum(state.fed, kept))

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
        _, kv, _, tokens, probs = jax.lax.while_loop(more, step, start)
        count = jnp.where(active, draft.num_tokens, 0)
        return Proposal(tokens, count, probs), EagleState(kv, state.features, jnp.where(active, p, state.fed))
