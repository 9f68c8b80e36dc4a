"""The cache contract, on two levels.

1. Device state (:class:`KVState`): an immutable pytree with pure functions used inside jit — write
   new K/V at given positions, attend with a query.
2. Host handle (:class:`CacheProvider`): the Go package's mutable surface in Python names, owning a
   device state and the host-side bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Self, TypeVar

import jax
from jaxtyping import Array, Float, Int


T = TypeVar("T")


def replace_layer(items: tuple[T, ...], layer: int, value: T) -> tuple[T, ...]:
    """``items`` with entry ``layer`` replaced: per-layer state tuples stay immutable pytrees."""
    return items[:layer] + (value,) + items[layer + 1 :]


@dataclass(frozen=True)
class LayerKV:
    """Full-precision keys and values of one layer, [batch, seq_len, kv_heads, head_dim] each."""

    k: Float[Array, "B S KVH D"]
    v: Float[Array, "B S KVH D"]


class KVState(Protocol):
    """Device-side cache state: a pytree, functional, used inside compiled plans."""

    @property
    def capacity(self) -> int:
        """Token slots per sequence."""
        ...

    def write(
        self,
        layer: int,
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
    ) -> Self:
        """Store K/V of the tokens at ``positions``; returns the new state."""
        ...

    def attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        positions: Int[Array, "B T"],
        *,
        sliding_window: int | None,
    ) -> Float[Array, "B T H D"]:
        """Causal attention of queries at ``positions`` over the stored keys."""
        ...

    def layer_view(self, layer: int) -> LayerKV:
        """A full-precision copy of one layer, for tests and inspection (never on the hot path)."""
        ...


S = TypeVar("S", bound=KVState)
S_co = TypeVar("S_co", bound=KVState, covariant=True)


class CacheProvider(Protocol[S_co]):
    """Host handle of a KV cache (the Go ``CacheProvider``)."""

    @property
    def state(self) -> S_co: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    def update(self, layer: int, k: jax.Array, v: jax.Array) -> None:
        """Append K/V [batch, new, kv_heads, head_dim] for ``layer`` at the current end."""
        ...

    def get(self, layer: int) -> LayerKV:
        """Full-precision K/V of ``layer`` up to ``seq_len``."""
        ...

    def reset(self) -> None: ...

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens exactly; later tokens are forgotten."""
        ...


class CacheBackend(Protocol[S]):
    """How a :class:`~zgen.generator.Generator` gets device cache state for a batch, and gives it back.

    ``allocate`` returns a state with room for positions ``[0, capacity)`` in each of ``batch`` rows
    (a paged backend takes blocks from its pool here and raises ``PoolExhaustedError`` without
    allocating anything when they do not fit); ``release`` returns what ``allocate`` took.
    """

    def allocate(self, batch: int, capacity: int) -> S: ...

    def release(self, state: S) -> None: ...
