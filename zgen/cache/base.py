"""The cache contract, on two levels.

1. Device state (:class:`KVState`): an immutable pytree with pure functions used inside jit — write
   new K/V at given positions, attend with a query.
2. Host side: a :class:`KVManager` owns the device state of many sequences (a pool of pages, or rows
   of a dense batch) and hands each sequence a :class:`KVHandle` — the ``CacheProvider`` surface in
   Python names (``seq_len``, ``update``, ``get``, ``truncate``, ``reset``) plus what the runtime's
   scheduler needs (``reserve`` room before a step, ``release``). The runtime builds one step's state
   from the handles of its rows (:meth:`KVManager.step_state`) and gives the result back
   (:meth:`KVManager.absorb`). :mod:`zgen.cache.factory` is the one place managers are made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar, runtime_checkable

import jax
import numpy as np
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


@runtime_checkable
class WriteAndAttendKVState(KVState, Protocol):
    """A state that can rotate, store and attend over a step's tokens in one go (e.g. one kernel for a
    decode step): the forward pass uses this instead of RoPE, ``write`` and ``attend`` when a state has it."""

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        *,
        inv_freq: Float[Array, " half"],
        sliding_window: int | None,
    ) -> tuple[Float[Array, "B T H D"], Self]:
        """``attend`` after ``write``, given ``q`` and ``k`` before RoPE (rotate-half with ``inv_freq``
        at ``positions``): the attention output and the new state."""
        ...


S = TypeVar("S", bound=KVState)


class CacheProvider(Protocol):
    """The host handle of one sequence's KV, on any kind of cache: append, read back, truncate, reset."""

    @property
    def num_layers(self) -> int: ...

    @property
    def seq_len(self) -> int:
        """Tokens whose K/V are stored."""
        ...

    def update(self, layer: int, k: jax.Array, v: jax.Array) -> None:
        """Append K/V ``[1, new, kv_heads, head_dim]`` of ``layer`` at the end (the length advances
        after the last layer)."""
        ...

    def get(self, layer: int) -> LayerKV:
        """Full-precision K/V of ``layer`` up to ``seq_len`` (for tests and inspection)."""
        ...

    def reset(self) -> None: ...

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens exactly (the compressed kind documents its lossy exception)."""
        ...


class KVHandle(CacheProvider, Protocol):
    """A sequence's KV as the runtime drives it."""

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more tokens a compiled step will write, and count them as stored.

        All-or-nothing: raises :class:`~zgen.errors.PoolExhaustedError` (and changes nothing) when
        the manager has no room now; follow with :meth:`truncate` if fewer tokens were written.
        """
        ...

    def release(self) -> None:
        """Give everything back; the handle is unusable after."""
        ...


@dataclass(frozen=True)
class StepRow:
    """One row of a compiled step: whose KV it reads and writes, and what it feeds.

    ``start``/``count``: the row feeds ``count`` tokens at positions ``start, start+1, ...`` (its
    handle has reserved them). ``masked``: positions hidden from attention (paged kinds only).
    ``attention``: a per-query override of the causal rule, bool ``[count, start + count]``.
    """

    handle: KVHandle
    start: int
    count: int
    masked: np.ndarray | None = None
    attention: np.ndarray | None = None


class KVManager(Protocol):
    """The device state of many sequences and the handles onto it (see the module docstring)."""

    @property
    def kind(self) -> str:
        """The cache kind a user names: tensor, flat, compressed, paged or tiered."""
        ...

    @property
    def pages(self) -> bool:
        """Whether sequences hold pages of a shared pool (forks share them; masks can drop them)."""
        ...

    def new_handle(self) -> KVHandle:
        """An empty sequence (it takes memory at its first ``reserve``)."""
        ...

    def layout(self, handles: Sequence[KVHandle]) -> tuple[int, list[int]]:
        """The batch width of a step serving ``handles`` (reserved already) and the row of each."""
        ...

    def step_state(self, rows: Sequence[StepRow], width: int, tokens: int) -> KVState:
        """The device state a step of ``width`` rows, ``tokens`` per row, runs on (rows as laid out)."""
        ...

    def absorb(self, state: KVState) -> None:
        """Take back the state the step returned (the one given to it was donated)."""
        ...

    def match_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> int:
        """Fill an empty handle with cached K/V of a prefix of ``tokens`` (never the last token, which
        must be fed for its logits); returns how many tokens it holds now. 0 without a prefix cache."""
        ...

    def commit_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        """Offer the stored K/V of ``tokens`` (all of them written) to the prefix cache, if any."""
        ...

    def expect(self, tokens: int) -> None:
        """A sequence is about to grow to ``tokens`` (a prompt and its generation budget). A cache whose
        shapes grow with its sequences takes its final size now, so the prefill and the decode after
        it, and the next request of that length, run one compiled shape. Reserves nothing."""
        ...

    def close(self) -> None:
        """Free what lives outside the device (a tiered store's host RAM and files)."""
        ...
