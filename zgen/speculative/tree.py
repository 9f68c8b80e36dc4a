"""EAGLE-2's dynamic draft tree, built on the device from any drafter's next-token log-probabilities.

Expand, depth by depth, the ``width`` nodes of highest cumulative draft log-probability (the sum along
their path) with their ``width`` most likely next tokens, then keep the ``size`` candidates of highest
cumulative log-probability as the tree the target verifies. A path's cumulative log-probability never
grows as it gets longer and ties keep the earlier (shallower) candidate, so the kept set holds every
kept node's ancestors: it is a tree. Shapes are static (``width``, the depth and ``size``); the tree is
a deterministic function of the draft's distributions, so the target accepts by exact match and the
output is plain decoding's, greedy or sampled (:func:`~zgen.runtime.speculation.verify_tree`).

:func:`build_tree` asks a drafter for one thing: the log-probabilities of the next token after each of a
batch of nodes (:data:`ExpandStep`), the nodes attending to their ancestors only. A draft model runs
them through its own cache with a tree mask (:class:`~zgen.speculative.draft_model.DraftModel`); a
feature-level head can do the same with its own state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zgen.errors import ConfigError
from zgen.runtime.speculation import Proposal

__all__ = ["MAX_TREE_SIZE", "ExpandStep", "Expansion", "TreeShape", "build_tree"]

#: Most nodes a tree may have (each is one more token in the verification pass).
MAX_TREE_SIZE = 128


@dataclass(frozen=True)
class TreeShape:
    """A dynamic draft tree: ``width`` nodes expanded per depth, each by its ``width`` most likely
    tokens; the ``size`` most likely candidates verified. Its depth is the speculator's ``num_tokens``."""

    width: int = 4
    size: int = 16

    def __post_init__(self) -> None:
        for name, value, most in (("width", self.width, 32), ("size", self.size, MAX_TREE_SIZE)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise ConfigError(f"TreeShape {name} must be an integer in [1, {most}], got {value!r}")

    def candidates(self, depth: int) -> int:
        """Nodes a tree of ``depth`` chooses its ``size`` from."""
        return self.width + (depth - 1) * self.width * self.width

    def expansions(self, depth: int) -> int:
        """Nodes fed to the drafter while a tree of ``depth`` is built."""
        return (depth - 1) * self.width

    def check(self, depth: int) -> None:
        if self.size > self.candidates(depth):
            raise ConfigError(
                f"a tree of width {self.width} and depth {depth} has {self.candidates(depth)} candidates, fewer "
                f"than its size {self.size}: lower the size, or raise the width or the draft length"
            )


def checked_tree(owner: str, tree: object, depth: int) -> TreeShape | None:
    """A speculator's ``tree`` argument checked: None (chains) or a :class:`TreeShape` that drafts
    ``depth`` deep (ConfigError otherwise)."""
    if tree is None:
        return None
    if not isinstance(tree, TreeShape):
        raise ConfigError(f"{owner} tree must be a TreeShape (or None for chains), got {tree!r}")
    tree.check(depth)
    return tree


@dataclass(frozen=True)
class Expansion:
    """Nodes the drafter extends at one depth (trace-time container).

    The nodes of a build are numbered in the order they are fed (expansion index; ``tokens[:, w]``
    is number ``first + w``, at depth ``depth``: position ``pending + depth``); each attends to the
    context up to the pending token, and to the fed nodes ``sees`` marks (its ancestors and itself).
    """

    tokens: Int[Array, "B W"]
    depth: int
    first: int
    sees: Bool[Array, "B W E"]


#: ``(state, nodes) -> (next-token log-probabilities [B, W, V] after each node, state)``.
ExpandStep = Callable[[Any, Expansion], tuple[Float[Array, "B W V"], Any]]


def build_tree(root: Float[Array, "B V"], expand: ExpandStep, state: Any, shape: TreeShape, depth: int) -> tuple[Proposal, Any]:
    """The tree (``shape.size`` nodes, ``depth`` deep) below each row's pending token, whose next-token
    log-probabilities are ``root``: a :class:`~zgen.runtime.speculation.Proposal` with parents and
    depths, nodes in the order they were found (parents first). ``expand`` runs ``depth - 1`` times."""
    shape.check(depth)
    b, k = root.shape[0], shape.width
    everything = shape.expansions(depth)
    score, token = jax.lax.top_k(root.astype(jnp.float32), k)
    scores, tokens, parents = [score], [token], [jnp.full((b, k), -1, jnp.int32)]
    depths = [jnp.full((k,), 1, jnp.int32)]
    frontier = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None, :], (b, k))  # candidate index of each node to expand
    seen = jnp.arange(everything)[None, None, :]
    sees = jnp.broadcast_to(seen == jnp.arange(k)[None, :, None], (b, k, everything))
    found = k  # candidates so far
    for level in range(1, depth):
        first = (level - 1) * k
        logprobs, state = expand(state, Expansion(token, level, first, sees))
        child_score, child_token = jax.lax.top_k(logprobs.astype(jnp.float32), k)  # [B, W, W]
        child_score = (score[:, :, None] + child_score).reshape(b, k * k)
        child_token = child_token.reshape(b, k * k)
        scores.append(child_score)
        tokens.append(child_token)
        parents.append(jnp.repeat(frontier, k, axis=1))
        depths.append(jnp.full((k * k,), level + 1, jnp.int32))
        if level + 1 < depth:
            score, best = jax.lax.top_k(child_score, k)
            token = jnp.take_along_axis(child_token, best, axis=1)
            frontier = (found + best).astype(jnp.int32)
            sees = jnp.take_along_axis(sees, (best // k)[:, :, None], axis=1) | (seen == (first + k + jnp.arange(k))[None, :, None])
        found += k * k
    _, chosen = jax.lax.top_k(jnp.concatenate(scores, axis=1), shape.size)
    chosen = jnp.sort(chosen, axis=1)  # candidates were found parents first
    parent = jnp.take_along_axis(jnp.concatenate(parents, axis=1), chosen, axis=1)
    node_of_parent = jnp.argmax(chosen[:, None, :] == parent[:, :, None], axis=2).astype(jnp.int32)
    return Proposal(
        tokens=jnp.take_along_axis(jnp.concatenate(tokens, axis=1), chosen, axis=1).astype(jnp.int32),
        count=jnp.full((b,), shape.size, jnp.int32),
        probs=None,
        parents=jnp.where(parent < 0, -1, node_of_parent),
        depth=jnp.concatenate(depths)[chosen],
    ), state
