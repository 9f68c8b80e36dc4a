"""Slot caches: each sequence holds one row (a *slot*) of one batched dense device state.

The ``tensor``, ``flat`` and ``compressed`` kinds keep K/V per row, ``[slots, capacity, ...]``
(:class:`~zgen.cache.tensor.DenseKVState`, :class:`~zgen.cache.compressed.CompressedKVState`). A
sequence takes the lowest free slot at its first :meth:`SlotHandle.reserve` and keeps it until it is
released, so a finished request frees its row at once for the next one (continuous batching). A
step runs over every row of the state, rows of sequences outside the step feeding position ``-1``
(which writes nothing).

The state grows when needed, between steps: rows by powers of two up to ``max_slots``, and for the
``tensor`` kind the capacity by powers of two (from ``min_capacity`` up to the model's context); the
``flat`` kind is allocated at the full context from the start, and ``compressed`` keeps a fixed
capacity too (its pooled chunks are small). Rows have no pages to share, so they cannot be forked or
masked: contexts need a paged kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar, Protocol, Self

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from zgen.cache.base import KVHandle, KVState, LayerKV, StepRow, replace_layer
from zgen.errors import CacheError, ConfigError, PoolExhaustedError
from zgen.shapes import next_pow2


class SlotState(KVState, Protocol):
    """A device state whose rows are slots (what :class:`SlotKVManager` needs of it)."""

    positional: ClassVar[bool]  # truncating a row needs no device work (positions decide visibility)

    def grown(self, batch: int, capacity: int) -> Self:
        """The same rows in a state of ``batch`` rows and ``capacity`` positions per row."""
        ...

    def truncate_rows(self, keep: Int[Array, " B"], lengths: Int[Array, " B"]) -> Self:
        """Cut each row from ``lengths`` to ``keep`` tokens (``keep == lengths``: unchanged)."""
        ...

    def stored(self, layer: int, row: int, length: int) -> LayerKV:
        """What one row stores of ``layer`` for its first ``length`` positions, ``[1, entries, ...]``."""
        ...


def _layer_fields(state: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(state) if isinstance(getattr(state, f.name), tuple)]


@jax.jit
def _write_one_layer(one: Any, k: Array, v: Array, positions: Array) -> Any:
    return one.write(0, k, v, positions)


@partial(jax.jit, donate_argnums=(0,))
def _truncate(state: Any, keep: Array, lengths: Array) -> Any:
    return state.truncate_rows(keep, lengths)


class SlotKVManager:
    """Sequences as rows of one dense state (see the module docstring).

    ``empty(batch, capacity)`` makes a zeroed state; ``capacity`` is the fixed capacity of the
    ``flat`` and ``compressed`` kinds, ``None`` for the growing ``tensor`` kind.
    """

    pages = False

    def __init__(
        self,
        kind: str,
        empty: Callable[[int, int], SlotState],
        *,
        num_layers: int,
        max_len: int,
        max_slots: int,
        capacity: int | None = None,
        min_capacity: int = 128,
    ) -> None:
        if max_slots < 1:
            raise ConfigError(f"a slot cache needs at least one slot, got max_slots={max_slots}")
        self._kind = kind
        self._empty = empty
        self.num_layers = num_layers
        self.max_len = max_len
        self.max_slots = max_slots
        self._fixed_capacity = capacity
        self._min_capacity = min_capacity
        self.state: SlotState | None = None
        self._owners: list[SlotHandle | None] = []
        self._token_shape: tuple[int, ...] | None = None

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def capacity(self) -> int:
        return 0 if self.state is None else self.state.capacity

    @property
    def token_shape(self) -> tuple[int, ...]:
        """``(kv_heads, head_dim)`` of one stored token (read from the state's shapes; allocates nothing)."""
        if self._token_shape is None:
            capacity = self._fixed_capacity or min(self.max_len, self._min_capacity)
            self._token_shape = tuple(jax.eval_shape(lambda: self._empty(1, capacity).layer_view(0).k).shape[2:])
        return self._token_shape

    @property
    def slots_in_use(self) -> int:
        return sum(owner is not None for owner in self._owners)

    def new_handle(self) -> SlotHandle:
        return SlotHandle(self)

    def layout(self, handles: Sequence[KVHandle]) -> tuple[int, list[int]]:
        rows = []
        for handle in handles:
            assert isinstance(handle, SlotHandle) and handle.slot is not None, "reserve before laying out a step"
            rows.append(handle.slot)
        return len(self._owners), rows

    def step_state(self, rows: Sequence[StepRow], width: int, tokens: int) -> SlotState:
        del tokens
        if any(row.masked is not None or row.attention is not None for row in rows):
            raise ConfigError(f"the {self._kind} cache cannot mask tokens; masks need a paged cache (paged or tiered)")
        assert self.state is not None and width == len(self._owners)
        return self.state

    def absorb(self, state: KVState) -> None:
        self.state = state  # type: ignore[assignment]

    def match_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> int:
        del handle, tokens
        return 0

    def expect(self, tokens: int) -> None:
        if self.state is not None:  # the first reserve makes the state (it knows the rows)
            self._ensure_capacity(min(tokens, self.max_len))

    def commit_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        del handle, tokens

    def close(self) -> None:
        pass

    # -- the handles' side ------------------------------------------------------------------------

    def _acquire(self, handle: SlotHandle) -> int:
        free = next((i for i, owner in enumerate(self._owners) if owner is None), len(self._owners))
        if free >= self.max_slots:
            raise PoolExhaustedError(
                f"all {self.max_slots} rows of the {self._kind} cache hold sequences; wait for one to finish, "
                "or allow more rows (max_batch)"
            )
        if free >= len(self._owners):
            self._owners += [None] * (min(self.max_slots, next_pow2(free + 1)) - len(self._owners))
        self._owners[free] = handle
        self._resize(len(self._owners), self.capacity)
        return free

    def _ensure_capacity(self, tokens: int) -> None:
        if tokens > self.capacity:
            self._resize(len(self._owners), min(self.max_len, next_pow2(tokens, self._min_capacity)))

    def _resize(self, rows: int, capacity: int) -> None:
        capacity = self._fixed_capacity or max(capacity, min(self.max_len, self._min_capacity))
        if self.state is None:
            self.state = self._empty(rows, capacity)
        elif (rows, capacity) != (jax.tree_util.tree_leaves(self.state)[0].shape[0], self.state.capacity):
            self.state = self.state.grown(rows, capacity)

    def _truncate(self, slot: int, keep: int, length: int) -> None:
        assert self.state is not None
        if self.state.positional:
            return
        lengths = np.asarray([owner.seq_len if owner is not None else 0 for owner in self._owners], np.int32)
        lengths[slot] = length
        kept = lengths.copy()
        kept[slot] = keep
        self.state = _truncate(self.state, *jax.device_put((kept, lengths)))

    def _release(self, handle: SlotHandle) -> None:
        if handle.slot is not None:
            self._truncate(handle.slot, 0, handle.seq_len)
            self._owners[handle.slot] = None

    def _write(self, slot: int, layer: int, k: Array, v: Array, start: int) -> None:
        assert self.state is not None
        rows, new = len(self._owners), k.shape[1]
        positions = np.full((rows, new), -1, np.int32)
        positions[slot] = np.arange(start, start + new)
        pad = lambda x: jnp.zeros((rows, *x.shape[1:]), x.dtype).at[slot].set(x[0])  # noqa: E731
        state: Any = self.state
        names = _layer_fields(state)
        one = dataclasses.replace(state, **{name: (getattr(state, name)[layer],) for name in names})
        one = _write_one_layer(one, pad(k), pad(v), jnp.asarray(positions))
        self.state = dataclasses.replace(
            state, **{name: replace_layer(getattr(state, name), layer, getattr(one, name)[0]) for name in names}
        )

    def _read(self, slot: int, layer: int, length: int) -> LayerKV:
        assert self.state is not None
        stored = self.state.stored(layer, slot, length)
        # Copies: a slice covering a whole buffer is that buffer, which the next step or truncate donates.
        return LayerKV(jnp.copy(stored.k), jnp.copy(stored.v))


class SlotHandle:
    """One sequence's row in a :class:`SlotKVManager` (the ``CacheProvider`` of the slot kinds)."""

    def __init__(self, manager: SlotKVManager) -> None:
        self._manager = manager
        self.slot: int | None = None
        self._seq_len = 0
        self._pending = 0  # tokens update() has written into some layers but not the last
        self._released = False

    @property
    def num_layers(self) -> int:
        return self._manager.num_layers

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def reserve(self, n: int) -> None:
        self._check_live()
        if n < 0 or self._seq_len + n > self._manager.max_len:
            raise CacheError(
                f"cannot reserve {n} tokens after {self._seq_len}: a row of the {self._manager.kind} cache holds "
                f"{self._manager.max_len} positions"
            )
        if self.slot is None:
            self.slot = self._manager._acquire(self)  # PoolExhaustedError here changes nothing
        self._manager._ensure_capacity(self._seq_len + n)
        self._seq_len += n

    def truncate(self, n: int) -> None:
        self._check_live()
        if not 0 <= n <= self._seq_len:
            raise CacheError(f"cannot truncate a cache of {self._seq_len} tokens to {n}; n must be in [0, seq_len]")
        if self._pending:
            raise CacheError(
                f"a step is half written ({self._pending} tokens in some layers, not the last); "
                "update the remaining layers before truncating"
            )
        if self.slot is not None and n < self._seq_len:
            self._manager._truncate(self.slot, n, self._seq_len)
        self._seq_len = n

    def reset(self) -> None:
        """Forget every token and give the row back (the handle stays usable)."""
        self._check_live()
        self._manager._release(self)
        self.slot, self._seq_len, self._pending = None, 0, 0

    def release(self) -> None:
        if not self._released:
            self.reset()
            self._released = True

    def update(self, layer: int, k: Float[Array, "1 T KVH D"], v: Float[Array, "1 T KVH D"]) -> None:
        self._check_live()
        if not 0 <= layer < self.num_layers:
            raise CacheError(f"layer {layer} outside [0, {self.num_layers})")
        kv_heads, head_dim = self._manager.token_shape
        if k.ndim != 4 or k.shape[0] != 1 or tuple(k.shape[2:]) != (kv_heads, head_dim) or k.shape != v.shape:
            raise CacheError(
                f"update takes k and v shaped [1, new, kv_heads={kv_heads}, head_dim={head_dim}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        new = k.shape[1]
        if layer == 0:
            self.reserve(new)  # room for every layer; counted when the last layer is written
            self._seq_len -= new
            self._pending = new
        if new != self._pending:
            raise CacheError(f"layer {layer} got {new} tokens, layer 0 got {self._pending}; append the same tokens to every layer in order")
        if new and self.slot is not None:
            self._manager._write(self.slot, layer, k, v, self._seq_len)
        if layer == self.num_layers - 1:
            self._seq_len += new
            self._pending = 0

    def get(self, layer: int) -> LayerKV:
        self._check_live()
        if not 0 <= layer < self.num_layers:
            raise CacheError(f"layer {layer} outside [0, {self.num_layers})")
        if self.slot is None:
            raise CacheError("this sequence stores nothing yet")
        return self._manager._read(self.slot, layer, self._seq_len)

    def _check_live(self) -> None:
        if self._released:
            raise CacheError("this KV handle was released; open a new one")
