"""The EAGLE head: one decoder layer that predicts the target's next feature from its current one.

Row ``j`` of the head reads the target's feature at position ``j`` (the residual stream after the
last layer — EAGLE — or a learned fusion of a low, a middle and a high layer's — EAGLE-3) and the
embedding of the token at ``j + 1``, and predicts the feature at ``j + 1``; the target's own final
norm and LM head turn that prediction into the distribution of the token at ``j + 2``::

    fc(concat(feature_j, embed(token_{j+1}))) -> decoder layer -> feature_{j+1}^
                                                              -> final norm -> LM head -> token_{j+2}

Drafting chains it: the predicted feature and the drafted token are the next row's input. The head
is built from the target's own graph nodes (its attention reads and writes a KV state of its own,
one layer deep), and :func:`draft_step` is a pure function of (head parameters, state, features,
tokens, positions): it drafts a chain here, and a token tree given tree positions.

Parameters are a plain dict of arrays (the head's own, by name) that the traced loop takes as an
argument; the embedding, final norm and LM head are read from the target's parameters, never copied.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from zgen.cache.tensor import DenseAttention, DenseKVState
from zgen.config import ModelConfig, rope_inverse_frequencies
from zgen.errors import ConfigError
from zgen.graph.core import ForwardContext, Graph, Node, TensorType, act, i32, linear
from zgen.graph.decoder import LOGIT_ROWS, LOGITS, POSITIONS, TOKENS
from zgen.graph.nodes import AddRMSNorm, Attention, Embed, GatedMLP, LMHead, RMSNorm, SelectRows
from zgen.model import Model
from zgen.runtime.step import run_graph
from zgen.runtime.tree import run_tree_graph

#: The head's graph inputs besides the decoder's tokens, positions and logit rows.
FEATURES = "features"
#: The head's output: its prediction of the next position's feature, at every row.
PREDICTED = "eagle.predicted"
LAYER = "eagle.layer"
#: Head rows a row attends to (itself included): the head's context, in training and drafting alike.
HEAD_WINDOW = 256
FC, FUSE = "eagle.fc", "eagle.fuse"


def default_feature_layers(config: ModelConfig, *, fused: bool = False) -> tuple[int, ...]:
    """EAGLE reads the last layer's output; EAGLE-3 fuses a low, a middle and a high layer's."""
    last = config.num_layers - 1
    if not fused:
        return (last,)
    return tuple(sorted({min(2, last), config.num_layers // 2, max(config.num_layers - 3, 0)}))


def shared_names(config: ModelConfig) -> tuple[str, ...]:
    """The target parameters the head reads (embedding, final norm, LM head)."""
    return ("embed", "final_norm") if config.tie_word_embeddings else ("embed", "final_norm", "lm_head")


@dataclass
class HeadInput(Node):
    """``fc(concat(feature, embedding))``: the head's view of one position."""

    name: str
    inputs: tuple[str, ...]
    hidden: int
    weight: str

    def input_types(self) -> tuple[TensorType, ...]:
        return (act("batch", "seq", self.hidden), act("batch", "seq", self.hidden))

    def output_type(self) -> TensorType:
        return act("batch", "seq", self.hidden)

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {self.weight: (self.hidden, 2 * self.hidden)}

    def linear_weights(self) -> tuple[str, ...]:
        return (self.weight,)

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        feature, embedding = args
        return linear(jnp.concatenate([feature.astype(embedding.dtype), embedding], axis=-1), params[self.weight])


def head_graph(config: ModelConfig) -> Graph:
    """The head over ``features`` [batch, seq, hidden] and the next ``tokens``: its predicted features
    at every row and the target-head logits at ``logit_rows``."""
    c = config
    graph = Graph()
    tokens = graph.add_input(TOKENS, i32("batch", "seq"))
    positions = graph.add_input(POSITIONS, i32("batch", "seq"))
    rows = graph.add_input(LOGIT_ROWS, i32("batch", "rows"))
    features = graph.add_input(FEATURES, act("batch", "seq", c.hidden_size))
    embedded = graph.add(Embed("eagle.embed", (tokens,), c.vocab_size, c.hidden_size))
    h = graph.add(HeadInput("eagle.input", (features, embedded), c.hidden_size, FC))
    normed = graph.add(RMSNorm(f"{LAYER}.attn_norm", (h,), c.hidden_size, c.rms_norm_eps, f"{LAYER}.input_norm"))
    attn = graph.add(
        Attention(
            f"{LAYER}.attn", (normed, positions), layer=0, hidden=c.hidden_size, num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, inv_freq=tuple(rope_inverse_frequencies(c)), prefix=LAYER,
        )
    )
    h = graph.add(AddRMSNorm(f"{LAYER}.attn_residual", (h, attn), c.hidden_size, c.rms_norm_eps, f"{LAYER}.post_norm", f"{LAYER}.mlp_norm"))
    mlp = graph.add(GatedMLP(f"{LAYER}.mlp", (f"{LAYER}.mlp_norm",), c.hidden_size, c.intermediate_size, LAYER))
    graph.add(AddRMSNorm(PREDICTED, (h, mlp), c.hidden_size, c.rms_norm_eps, "final_norm", "eagle.final_norm"))
    selected = graph.add(SelectRows("eagle.select_rows", ("eagle.final_norm", rows), c.hidden_size))
    graph.add(LMHead(LOGITS, (selected,), c.hidden_size, c.vocab_size, "embed" if c.tie_word_embeddings else "lm_head"))
    graph.set_outputs(PREDICTED, LOGITS)
    return graph


def fuse(params: Mapping[str, jax.Array], features: Float[Array, "*B F"]) -> Float[Array, "*B H"]:
    """The target's features as the head reads them: the last layer's as they are, several layers'
    through the learned fusion."""
    return features if FUSE not in params else linear(features, params[FUSE])


def draft_step(
    graph: Graph,
    params: Mapping[str, jax.Array],
    kv: DenseKVState,
    features: Float[Array, "B T H"],
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    read_rows: Int[Array, "B R"],
) -> tuple[Float[Array, "B T H"], Float[Array, "B R V"], DenseKVState]:
    """One head pass: row ``t`` reads ``features[:, t]`` (fused) and the token after it, ``tokens[:, t]``,
    at ``positions[:, t]`` (-1: padding) and writes its K/V; returns the predicted next features of
    every row and the logits at ``read_rows``. ``params``: the head's and the shared target ones. A
    row attends to the :data:`HEAD_WINDOW` rows up to itself."""
    feeds = {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: read_rows, FEATURES: features}
    (predicted, logits), kv = run_graph(graph, HEAD_WINDOW, params, kv, feeds)
    return predicted, logits, kv


def draft_tree_step(
    graph: Graph,
    params: Mapping[str, jax.Array],
    kv: DenseKVState,
    features: Float[Array, "B T H"],
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    slots: Int[Array, "B T"],
    visible: Bool[Array, "B T S"],
    read_rows: Int[Array, "B R"],
) -> tuple[Float[Array, "B T H"], Float[Array, "B R V"], DenseKVState]:
    """:func:`draft_step` over nodes of a draft tree: row ``t`` writes its K/V at ``slots[:, t]`` and
    attends to the rows ``visible`` marks (the context and its ancestors, :mod:`zgen.runtime.tree`)."""
    feeds = {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: read_rows, FEATURES: features}
    (predicted, logits), kv, _ = run_tree_graph(graph, params, kv, feeds, slots, visible)
    return predicted, logits, kv


def fingerprint(model: Model) -> str:
    """What identifies a target to its head: its config and a hash of the weights the head reads."""
    digest = hashlib.sha256(json.dumps(asdict(model.config), sort_keys=True, default=str).encode())
    for name in shared_names(model.config):
        for leaf in jax.tree_util.tree_leaves(model.params[name]):
            # bfloat16: a head trained beside bfloat16 weights fits the same weights loaded in float32
            array = np.asarray(jax.device_get(jnp.asarray(leaf).astype(jnp.bfloat16)))
            digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True, eq=False)
class EagleHead:
    """An EAGLE head for ``model``: its parameters (a plain dict of arrays) and the target layers it reads."""

    model: Model
    params: dict[str, jax.Array]
    feature_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        layers = self.feature_layers
        total = self.model.config.num_layers
        if not layers or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < total for i in layers):
            raise ConfigError(f"EAGLE feature layers must be layer indices in [0, {total}), got {layers!r}")
        expected = head_param_shapes(self.model.config, layers)
        shapes = {name: tuple(value.shape) for name, value in self.params.items()}
        if shapes != expected:
            raise ConfigError(f"EAGLE head parameters {shapes} do not fit this model (expected {expected})")

    @classmethod
    def init(
        cls, model: Model, key: jax.Array | int = 0, *, feature_layers: tuple[int, ...] | None = None, fused: bool = False
    ) -> EagleHead:
        """A freshly initialized (untrained) head; ``fused``: read a low, a middle and a high layer (EAGLE-3)."""
        layers = feature_layers if feature_layers is not None else default_feature_layers(model.config, fused=fused)
        rng = jax.random.PRNGKey(key) if isinstance(key, int) else key
        shapes = head_param_shapes(model.config, layers)
        params: dict[str, jax.Array] = {}
        for (name, shape), sub in zip(sorted(shapes.items()), jax.random.split(rng, len(shapes)), strict=True):
            if name.endswith("_norm"):
                params[name] = jnp.ones(shape, model.dtype)
            else:
                params[name] = (0.02 * jax.random.normal(sub, shape, jnp.float32)).astype(model.dtype)
        return cls(model, params, tuple(layers))

    @property
    def graph(self) -> Graph:
        """The head's graph (built once per target model and kept with it)."""
        key = "eagle.head_graph"
        graph = self.model.attachments.get(key)
        if not isinstance(graph, Graph):
            graph = head_graph(self.model.config)
            self.model.attachments[key] = graph
        return graph

    def joined(self, head_params: Mapping[str, Any], target_params: Mapping[str, Any]) -> dict[str, Any]:
        """What :func:`draft_step` reads: the head's parameters and the target ones it shares."""
        return {**{name: target_params[name] for name in shared_names(self.model.config)}, **head_params}

    def new_kv(self, batch: int, capacity: int, attention: DenseAttention = "auto", dtype: jnp.dtype | None = None) -> DenseKVState:
        """The head's K/V buffers (``dtype``: the model's unless given)."""
        c = self.model.config
        return DenseKVState.zeros(1, batch, capacity, c.num_kv_heads, c.head_dim, dtype or self.model.dtype, attention)


def head_param_shapes(config: ModelConfig, feature_layers: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The head's own parameters (not the shared target ones) and their shapes."""
    shared = set(shared_names(config))
    shapes = {name: shape for name, shape in head_graph(config).param_shapes().items() if name not in shared}
    if len(feature_layers) > 1:
        shapes[FUSE] = (config.hidden_size, len(feature_layers) * config.hidden_size)
    return shapes
