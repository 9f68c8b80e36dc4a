"""Token trees in one forward pass: per-node positions, an ancestor-only attention mask, and the
accepted path's K/V put where plain decoding would have put them.

A tree of drafted tokens hangs below a row's pending token at position ``p``: node ``i`` has a parent
(another node, or the pending token) and a depth ``d >= 1``, and stands for the token at position
``p + d`` should its path be accepted. Siblings share a position, so the positional caches (a key at
position ``j`` is visible to every query at ``p >= j``; quantized formats code each token with its
position) cannot hold the nodes where they belong. A tree pass therefore

1. writes every entry of the tree into its own *scratch slot* (the pending token at ``p``, node ``i``
   at ``p + 1 + i``: slots the row reserved for drafts, invisible to later queries until they are
   written again) with its key rotated to its own position ``p + d``;
2. attends through an explicit visibility mask (:func:`tree_attention_mask`): the context before
   ``p`` as the causal rule (and sliding window) would show it, plus the entry's ancestors and itself;
3. after acceptance, writes the accepted path's K/V, kept from the pass (:class:`TreeForward`), at
   ``p + 1 .. p + a`` through the cache's own ``write`` (:func:`commit_path`): the cache then holds,
   bit for bit, what writing only the accepted tokens would have stored, in every cache kind and KV
   format; the scratch slots past them are stale like a chain's rejected drafts.

What the pass computes matches a chain pass over the accepted path exactly for every format that
stores a token independently of its position (fp32, bf16, fp16, fp8). The coded formats (q4, q3) code
a key with its position, so an ancestor seen in its scratch slot would be coded there and the pass
would differ from plain decoding within the format's noise: the engine refuses trees on them
(:class:`~zgen.errors.ConfigError`; chains speculate on every format).

Attention with the mask runs in XLA over the layer's stored keys (:func:`attend_visible`: the dense
buffers as they are, paged pools through their dequantized view, a masked paged state with its own
page and token masks). The paged kernels (``zgen.pallas.paged_attention``) and the dense flash
kernels read keys by position only; a kernel that takes a per-query mask of the few in-chunk slots
(the flash kernel's block mask, or the paged kernel's in-chunk causal mask generalised to a bitmask)
could run tree passes later without the dequantized view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zgen.cache.base import KVState
from zgen.cache.paged_state import MaskedPagedState, PagedKVState
from zgen.cache.tensor import masked_attention
from zgen.graph.core import Graph
from zgen.graph.decoder import LOGIT_ROWS, POSITIONS, TOKENS, feature_graph
from zgen.rope import rotary
from zgen.runtime.step import KernelContext, ModelSpec, Params, S

__all__ = ["TreeForward", "ancestors", "attend_visible", "commit_path", "forward_tree", "forward_tree_features", "run_tree_graph", "tree_attention_mask"]


def ancestors(parents: Int[Array, "B N"], max_depth: int) -> Bool[Array, "B M M"]:
    """``[b, i, j]``: entry ``j`` is entry ``i`` or one of its ancestors, over the ``M = N + 1`` entries
    of a tree (entry 0: the root; entry ``i + 1``: node ``i``, whose parent is ``parents[i]``, ``-1``:
    the root). ``max_depth`` bounds ``depth``: that many steps up reach the root from every node."""
    b, n = parents.shape
    # entry -> parent entry; the root is its own parent, so walking past it stays there
    rows = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), (parents + 1).astype(jnp.int32)], axis=1)
    current = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32)[None, :], (b, n + 1))
    entries = jnp.arange(n + 1)[None, None, :]
    seen = current[:, :, None] == entries
    for _ in range(max_depth):
        current = jnp.take_along_axis(rows, current, axis=1)
        seen |= current[:, :, None] == entries
    return seen


def tree_attention_mask(
    query_positions: Int[Array, "B T"],
    context_end: Int[Array, " B"],
    entry_slots: Int[Array, "B M"],
    entry_positions: Int[Array, "B M"],
    sees: Bool[Array, "B T M"],
    capacity: int,
    sliding_window: int | None,
) -> Bool[Array, "B T S"]:
    """Which of ``capacity`` slots each query sees: slots below ``context_end`` (the causal rule: all of
    them precede every query), and the tree entries it ``sees`` (stored at ``entry_slots``, -1: none;
    their keys rotated to ``entry_positions``); within the sliding window of the query's position.
    Queries at position -1 (padding) see nothing."""
    b, t = query_positions.shape
    slots = jnp.arange(capacity)[None, None, :]
    query = query_positions[:, :, None]
    visible = jnp.broadcast_to(slots < context_end[:, None, None], (b, t, capacity))
    if sliding_window is not None:
        visible &= query - slots < sliding_window
        sees = sees & (query - entry_positions[:, None, :] < sliding_window)
    rows = jnp.arange(b)[:, None, None]
    queries = jnp.arange(t)[None, :, None]
    targets = jnp.where(entry_slots >= 0, entry_slots, capacity)[:, None, :]  # capacity: dropped
    visible = visible.at[rows, queries, targets].max(sees, mode="drop")
    return visible & (query >= 0)


def attend_visible(
    state: KVState, layer: int, q: Float[Array, "B T H D"], positions: Int[Array, "B T"], visible: Bool[Array, "B T S"]
) -> Float[Array, "B T H D"]:
    """Attention of ``q`` over the stored keys of ``layer`` that ``visible`` marks (XLA; see the module
    docstring). A masked paged state keeps its page and token masks (its per-query override, for
    prefill chunks only, gives way to the tree's)."""
    if isinstance(state, PagedKVState):
        state = MaskedPagedState(state)
    if isinstance(state, MaskedPagedState):
        return replace(state, query_mask=visible).attend(layer, q, positions, sliding_window=None)
    view = state.layer_view(layer)
    return masked_attention(q, view.k.astype(q.dtype), view.v.astype(q.dtype), visible)


class _TreeContext(KernelContext):
    """Writes each token's K/V (key rotated to its position) at its slot and attends through the mask;
    keeps every layer's K/V for :func:`commit_path`."""

    def __init__(self, state: KVState, slots: Int[Array, "B T"], visible: Bool[Array, "B T S"]) -> None:
        self.state = state
        self.slots = slots
        self.visible = visible
        self.keys: list[Array] = []
        self.values: list[Array] = []

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        inv_freq: Float[Array, " half"],
    ) -> Float[Array, "B T H D"]:
        rotated = rotary(k, positions, inv_freq)
        self.keys.append(rotated)
        self.values.append(v)
        self.state = self.state.write(layer, rotated, v, self.slots)
        return attend_visible(self.state, layer, rotary(q, positions, inv_freq), positions, self.visible)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TreeForward:
    """Every layer's K/V of a tree pass's tokens (keys rotated), ``[B, T, KVH, D]`` each."""

    keys: tuple[Array, ...]
    values: tuple[Array, ...]


def run_tree_graph(
    graph: Graph, params: Params, kv: S, feeds: Mapping[str, jax.Array], slots: Int[Array, "B T"], visible: Bool[Array, "B T S"]
) -> tuple[tuple[jax.Array, ...], S, TreeForward]:
    """Any graph (the target's, its feature graph, a draft head's) over a tree's entries, fed by name:
    each entry's K/V stored at ``slots`` (-1: nowhere), its attention through ``visible``; the graph's
    outputs, the state and every entry's K/V (for :func:`commit_path`)."""
    ctx = _TreeContext(kv, slots, visible)
    outputs = graph.run(params, feeds, ctx)
    return outputs, ctx.state, TreeForward(tuple(ctx.keys), tuple(ctx.values))  # type: ignore[return-value]


def forward_tree(
    model: ModelSpec,
    params: Params,
    kv: S,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    slots: Int[Array, "B T"],
    visible: Bool[Array, "B T S"],
    read_rows: Int[Array, "B R"],
) -> tuple[Float[Array, "B R V"], S, TreeForward]:
    """:func:`~zgen.runtime.step.forward` for trees: ``tokens`` at RoPE ``positions`` stored at
    ``slots`` (-1: nowhere), each attending to the slots ``visible`` marks; float32 logits at
    ``read_rows`` and the K/V of every token (for :func:`commit_path`)."""
    feeds = {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: read_rows}
    (logits,), kv, written = run_tree_graph(model.graph, params, kv, feeds, slots, visible)
    return logits, kv, written


def forward_tree_features(
    model: ModelSpec,
    params: Params,
    kv: S,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    slots: Int[Array, "B T"],
    visible: Bool[Array, "B T S"],
    read_rows: Int[Array, "B R"],
    layers: tuple[int, ...],
) -> tuple[Float[Array, "B R V"], Float[Array, "B T F"], S, TreeForward]:
    """:func:`forward_tree` that also returns the residual stream after each of ``layers`` at every
    token, concatenated (as :func:`~zgen.runtime.step.forward_features`: an EAGLE head's features)."""
    feeds = {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: read_rows}
    (logits, *features), kv, written = run_tree_graph(feature_graph(model.graph, layers), params, kv, feeds, slots, visible)
    return logits, jnp.concatenate(features, axis=-1), kv, written


def commit_path(kv: S, written: TreeForward, path: Int[Array, "B A"], positions: Int[Array, "B A"]) -> S:
    """Write the K/V of the pass's tokens ``path`` (indices into its T) at ``positions`` (-1: nothing),
    through the cache's own ``write``: what feeding those tokens there would have stored."""
    index = path[:, :, None, None]
    for layer, (k, v) in enumerate(zip(written.keys, written.values, strict=True)):
        kv = kv.write(layer, jnp.take_along_axis(k, index, axis=1), jnp.take_along_axis(v, index, axis=1), positions)  # type: ignore[assignment]
    return kv
