"""The compressed cache: chunk-wise mean pooling of older K/V, the most recent chunk kept raw.

Positions are grouped into chunks of ``chunk_size`` tokens: chunk ``c`` covers ``[c*C, (c+1)*C)``.
The chunk holding the newest token is the *recent* chunk and is stored raw, token by token. Once a
token of a later chunk arrives, every earlier chunk is replaced by one mean-pooled K/V entry (the mean
over the chunk's stored tokens). A pooled entry carries the position of its chunk's last token,
``c*C + C - 1``. With ``L`` tokens, ``(L-1) // C`` chunks are pooled and 1 to ``C`` tokens are raw.

Visibility (the dense rule of :func:`~zgen.cache.tensor.causal_attention`, adapted): a query at
position ``p`` sees the pooled entry of every chunk before its own (``c < p // C``) and the raw tokens
of its own chunk up to itself (``p // C * C <= j <= p``). Under a sliding window ``w`` an entry is also
required to lie inside the window by its position (``pos > p - w``). For the query at the newest
position this is exactly "every stored entry".

Truncation is lossy where it must be (the raw tokens of a pooled chunk are gone). Cutting a row to ``n``:

- keeps every pooled chunk that lies wholly before ``n`` (``(c+1)*C <= n``);
- keeps the raw tokens before ``n``;
- drops a pooled chunk that ``n`` cuts (``c*C < n < (c+1)*C``) as a whole. Its tokens before ``n``
  are lost: the handle's ``seq_len`` still reports ``n`` (the logical length, where the next token
  goes), while :meth:`CompressedKVState.stats` says what is stored (``compressed_tokens``
  folded into pooled entries, ``raw_tokens``, ``stored_entries`` and ``lost_tokens``).

A chunk with lost tokens is refilled by later tokens and, when pooled, is the mean of the tokens it
then holds. A pooled chunk left as the newest chunk by a truncate at its end stays pooled. Truncating to
the current length changes nothing. Every other cut is exact.

Device state (:class:`CompressedKVState`) — compression happens inside the compiled plan, also inside
the on-device decode loop: per layer it keeps running float32 sums and token counts per chunk slot
(``[batch, ceil(capacity/C), kv_heads, head_dim]``) and a ring of ``raw_slots`` raw tokens (slot
``p % raw_slots``) with their positions. ``write`` adds tokens to their chunk's sum and to the ring
(a token written again at the same position replaces its earlier value in the sum while that value is
still in the ring); ``attend`` divides sums by counts (the pooled means), concatenates the ring and
masks by the rule above. ``raw_slots = capacity`` (the default) works for any write; a smaller ring
saves memory but limits one ``write`` call to ``raw_slots - chunk_size + 1`` tokens (prefill in chunks
of that size), checked when the plan is traced.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Self

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from zgen.cache.base import LayerKV, replace_layer
from zgen.cache.tensor import masked_attention
from zgen.errors import CacheError


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class CompressedKVState:
    """Per-layer chunk sums/counts and a raw ring; see the module docstring for the rules."""

    sum_k: tuple[jax.Array, ...]  # [B, NC, KVH, D] float32
    sum_v: tuple[jax.Array, ...]
    count: tuple[jax.Array, ...]  # [B, NC] int32: tokens folded into each chunk's sum
    ring_k: tuple[jax.Array, ...]  # [B, R, KVH, D] cache dtype
    ring_v: tuple[jax.Array, ...]
    ring_pos: tuple[jax.Array, ...]  # [B, R] int32, -1 = empty
    chunk_size: int = field(metadata=dict(static=True))
    max_len: int = field(metadata=dict(static=True))
    positional: ClassVar[bool] = False  # truncation rebuilds chunk sums on the device

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        batch: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
        *,
        chunk_size: int,
        raw_slots: int | None = None,
    ) -> CompressedKVState:
        """Empty state for positions ``[0, capacity)``; ``raw_slots`` defaults to ``capacity``."""
        if chunk_size <= 0 or capacity <= 0:
            raise CacheError(f"chunk_size ({chunk_size}) and capacity ({capacity}) must be positive")
        ring = capacity if raw_slots is None else raw_slots
        if ring < chunk_size:
            raise CacheError(
                f"raw_slots={ring} cannot hold a whole recent chunk of {chunk_size} tokens; "
                f"pass raw_slots >= chunk_size (or leave it None for capacity)"
            )
        chunks = -(-capacity // chunk_size)
        big = (batch, chunks, kv_heads, head_dim)
        raw = (batch, ring, kv_heads, head_dim)
        return cls(
            sum_k=tuple(jnp.zeros(big, jnp.float32) for _ in range(num_layers)),
            sum_v=tuple(jnp.zeros(big, jnp.float32) for _ in range(num_layers)),
            count=tuple(jnp.zeros((batch, chunks), jnp.int32) for _ in range(num_layers)),
            ring_k=tuple(jnp.zeros(raw, dtype) for _ in range(num_layers)),
            ring_v=tuple(jnp.zeros(raw, dtype) for _ in range(num_layers)),
            ring_pos=tuple(jnp.full((batch, ring), -1, jnp.int32) for _ in range(num_layers)),
            chunk_size=chunk_size,
            max_len=capacity,
        )

    @property
    def capacity(self) -> int:
        return self.max_len

    @property
    def num_chunks(self) -> int:
        return self.count[0].shape[1]

    @property
    def raw_slots(self) -> int:
        return self.ring_pos[0].shape[1]

    @property
    def max_write(self) -> int:
        """Most tokens one ``write`` call may carry."""
        if self.raw_slots >= self.max_len:
            return self.max_len
        return self.raw_slots - self.chunk_size + 1

    def write(
        self,
        layer: int,
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
    ) -> Self:
        batch, new = positions.shape
        if new > self.max_write:
            raise CacheError(
                f"a write of {new} tokens does not fit a raw ring of {self.raw_slots} slots with chunk_size "
                f"{self.chunk_size} (at most {self.max_write} per write); prefill in pieces of at most "
                f"{self.max_write} tokens or allocate with a larger raw_slots"
            )
        size, ring = self.chunk_size, self.raw_slots
        dtype = self.ring_k[layer].dtype
        rows = jnp.arange(batch)[:, None]
        valid = (positions >= 0) & (positions < self.max_len)
        slot = jnp.where(valid, positions % ring, ring)
        chunk = jnp.where(valid, positions // size, self.num_chunks)
        gather = jnp.minimum(slot, ring - 1)
        rewrite = valid & (self.ring_pos[layer][rows, gather] == positions)
        again = rewrite[..., None, None]
        k_raw, v_raw = k.astype(dtype), v.astype(dtype)
        add_k = k_raw.astype(jnp.float32) - jnp.where(again, self.ring_k[layer][rows, gather].astype(jnp.float32), 0)
        add_v = v_raw.astype(jnp.float32) - jnp.where(again, self.ring_v[layer][rows, gather].astype(jnp.float32), 0)
        return replace(
            self,
            sum_k=replace_layer(self.sum_k, layer, self.sum_k[layer].at[rows, chunk].add(add_k, mode="drop")),
            sum_v=replace_layer(self.sum_v, layer, self.sum_v[layer].at[rows, chunk].add(add_v, mode="drop")),
            count=replace_layer(
                self.count, layer, self.count[layer].at[rows, chunk].add(jnp.where(rewrite, 0, 1), mode="drop")
            ),
            ring_k=replace_layer(self.ring_k, layer, self.ring_k[layer].at[rows, slot].set(k_raw, mode="drop")),
            ring_v=replace_layer(self.ring_v, layer, self.ring_v[layer].at[rows, slot].set(v_raw, mode="drop")),
            ring_pos=replace_layer(self.ring_pos, layer, self.ring_pos[layer].at[rows, slot].set(positions, mode="drop")),
        )

    def select(self, layer: int) -> CompressedKVState:
        """A one-layer state holding ``layer`` (no copy: the same arrays)."""
        return replace(
            self,
            sum_k=(self.sum_k[layer],),
            sum_v=(self.sum_v[layer],),
            count=(self.count[layer],),
            ring_k=(self.ring_k[layer],),
            ring_v=(self.ring_v[layer],),
            ring_pos=(self.ring_pos[layer],),
        )

    def merge(self, layer: int, one: CompressedKVState) -> CompressedKVState:
        """This state with ``layer`` replaced by the one-layer state ``one`` (see :meth:`select`)."""
        return replace(
            self,
            sum_k=replace_layer(self.sum_k, layer, one.sum_k[0]),
            sum_v=replace_layer(self.sum_v, layer, one.sum_v[0]),
            count=replace_layer(self.count, layer, one.count[0]),
            ring_k=replace_layer(self.ring_k, layer, one.ring_k[0]),
            ring_v=replace_layer(self.ring_v, layer, one.ring_v[0]),
            ring_pos=replace_layer(self.ring_pos, layer, one.ring_pos[0]),
        )

    def head_specs(self, axis: str) -> CompressedKVState:
        """This state's pytree with a ``PartitionSpec`` per leaf, splitting KV heads over mesh axis
        ``axis`` (the sums and the ring; the counts and ring positions are every head's)."""
        heads, rows = PartitionSpec(None, None, axis), PartitionSpec()
        return replace(
            self,
            **{name: tuple(heads for _ in self.count) for name in ("sum_k", "sum_v", "ring_k", "ring_v")},
            **{name: tuple(rows for _ in self.count) for name in ("count", "ring_pos")},
        )

    def pooled(self, layer: int) -> LayerKV:
        """Mean K/V of every chunk slot, [batch, num_chunks, kv_heads, head_dim] (zeros where empty)."""
        dtype = self.ring_k[layer].dtype
        count = jnp.maximum(self.count[layer], 1).astype(jnp.float32)[:, :, None, None]
        return LayerKV((self.sum_k[layer] / count).astype(dtype), (self.sum_v[layer] / count).astype(dtype))

    def entry_positions(self, layer: int) -> Int[Array, "B E"]:
        """Positions of :meth:`layer_view`'s entries: pooled slots (``c*C + C - 1``) then ring slots; -1 = empty."""
        size = self.chunk_size
        chunk_pos = jnp.arange(self.num_chunks, dtype=jnp.int32) * size + size - 1
        pooled = jnp.where(self.count[layer] > 0, chunk_pos[None, :], -1)
        return jnp.concatenate([pooled, self.ring_pos[layer]], axis=1)

    def visibility(
        self, layer: int, positions: Int[Array, "B T"], sliding_window: int | None
    ) -> Bool[Array, "B T E"]:
        """Which of :meth:`layer_view`'s entries a query at each position sees."""
        size = self.chunk_size
        q_chunk = (positions // size)[:, :, None]
        chunk_ids = jnp.arange(self.num_chunks)[None, None, :]
        see_pooled = (self.count[layer][:, None, :] > 0) & (chunk_ids < q_chunk)
        ring_pos = self.ring_pos[layer][:, None, :]
        see_raw = (ring_pos >= 0) & (ring_pos // size == q_chunk) & (ring_pos <= positions[:, :, None])
        if sliding_window is not None:
            low = positions[:, :, None] - sliding_window
            see_pooled &= (chunk_ids * size + size - 1) > low
            see_raw &= ring_pos > low
        return jnp.concatenate([see_pooled, see_raw], axis=2)

    def attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        positions: Int[Array, "B T"],
        *,
        sliding_window: int | None,
    ) -> Float[Array, "B T H D"]:
        view = self.layer_view(layer)
        return masked_attention(q, view.k, view.v, self.visibility(layer, positions, sliding_window))

    def layer_view(self, layer: int) -> LayerKV:
        """Every storage slot of ``layer``: the pooled means, then the raw ring (see :meth:`entry_positions`)."""
        pooled = self.pooled(layer)
        return LayerKV(
            jnp.concatenate([pooled.k, self.ring_k[layer]], axis=1),
            jnp.concatenate([pooled.v, self.ring_v[layer]], axis=1),
        )

    def truncate(self, n: Int[Array, " B"], lengths: Int[Array, "L B"]) -> CompressedKVState:
        """The state after cutting each row ``b`` from ``lengths[layer, b]`` tokens to ``n[b]`` (the
        module's lossy rule; ``n[b] == lengths[layer, b]`` changes nothing).

        ``lengths`` holds what each layer's rows hold (the host handle knows it). Traceable, so one
        compilation serves every cut. Where ``n`` cuts the raw recent chunk, its sum is rebuilt from the ring.
        """
        lengths = jnp.asarray(lengths, jnp.int32)
        n = jnp.asarray(n, jnp.int32)
        parts = [self._truncate_layer(layer, n, lengths[layer]) for layer in range(len(self.count))]
        return replace(
            self,
            sum_k=tuple(p[0] for p in parts),
            sum_v=tuple(p[1] for p in parts),
            count=tuple(p[2] for p in parts),
            ring_pos=tuple(p[3] for p in parts),
        )

    def truncate_rows(self, keep: Int[Array, " B"], lengths: Int[Array, " B"]) -> CompressedKVState:
        """:meth:`truncate` of rows whose layers all hold ``lengths`` tokens."""
        return self.truncate(keep, jnp.broadcast_to(lengths, (len(self.count), lengths.shape[0])))

    def grown(self, batch: int, capacity: int) -> CompressedKVState:
        """The same rows plus empty ones up to ``batch`` (the capacity is fixed at creation)."""
        if capacity != self.max_len:
            raise CacheError(f"a compressed cache keeps its capacity ({self.max_len}); got {capacity}")
        extra = batch - self.count[0].shape[0]

        def pad(x: jax.Array, value: int = 0) -> jax.Array:
            return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1), constant_values=value)

        return replace(
            self,
            sum_k=tuple(pad(x) for x in self.sum_k),
            sum_v=tuple(pad(x) for x in self.sum_v),
            count=tuple(pad(x) for x in self.count),
            ring_k=tuple(pad(x) for x in self.ring_k),
            ring_v=tuple(pad(x) for x in self.ring_v),
            ring_pos=tuple(pad(x, -1) for x in self.ring_pos),
        )

    def _truncate_layer(
        self, layer: int, n: Int[Array, " B"], length: Int[Array, " B"]
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        size = self.chunk_size
        rows = jnp.arange(n.shape[0])
        recent = (jnp.maximum(length - 1, 0) // size)[:, None]  # the chunks before it are pooled
        cut = n // size
        keep_chunk = jnp.arange(self.num_chunks)[None, :] < cut[:, None]
        pos = self.ring_pos[layer]
        keep_raw = (pos >= 0) & (pos < n[:, None]) & (pos // size >= recent)  # raw tokens of the recent chunk, before n
        sum_k = jnp.where(keep_chunk[:, :, None, None], self.sum_k[layer], 0.0)
        sum_v = jnp.where(keep_chunk[:, :, None, None], self.sum_v[layer], 0.0)
        count = jnp.where(keep_chunk, self.count[layer], 0)
        # Where n cuts the raw recent chunk, its sum and count are rebuilt from the head it keeps.
        rebuild = (n % size != 0) & (cut[:, None] >= recent)[:, 0]
        head = keep_raw & (pos // size == cut[:, None]) & rebuild[:, None]
        wide = head[:, :, None, None]
        rebuilt_k = jnp.sum(jnp.where(wide, self.ring_k[layer].astype(jnp.float32), 0.0), axis=1)
        rebuilt_v = jnp.sum(jnp.where(wide, self.ring_v[layer].astype(jnp.float32), 0.0), axis=1)
        index = jnp.minimum(cut, self.num_chunks - 1)
        sum_k = sum_k.at[rows, index].set(jnp.where(rebuild[:, None, None], rebuilt_k, sum_k[rows, index]))
        sum_v = sum_v.at[rows, index].set(jnp.where(rebuild[:, None, None], rebuilt_v, sum_v[rows, index]))
        count = count.at[rows, index].set(jnp.where(rebuild, jnp.sum(head, axis=1, dtype=jnp.int32), count[rows, index]))
        return sum_k, sum_v, count, jnp.where(keep_raw, pos, -1)

    # -- host-side inspection of one row (tests, stats) ----------------------------------------------

    def _row_layout(self, layer: int, row: int, length: int) -> tuple[list[int], list[int], np.ndarray]:
        """(pooled chunk ids, ring slots of raw tokens in position order, counts) of one row."""
        if length == 0:
            return [], [], np.zeros(0, np.int32)
        size = self.chunk_size
        recent = (length - 1) // size
        count = np.asarray(self.count[layer])[row]
        pos = np.asarray(self.ring_pos[layer])[row]
        slots = [int(s) for s in np.nonzero((pos >= 0) & (pos // size == recent) & (pos < length))[0]]
        slots.sort(key=lambda s: int(pos[s]))
        chunks = [c for c in range(recent) if count[c] > 0]
        if not slots and count[recent] > 0:  # a pooled chunk left newest by a truncate at its end
            chunks.append(recent)
        return chunks, slots, count

    def stored(self, layer: int, row: int, length: int) -> LayerKV:
        """Stored K/V of one row in position order: pooled means, then raw recent tokens ([1, E, ...])."""
        chunks, slots, _ = self._row_layout(layer, row, length)
        dtype = self.ring_k[layer].dtype
        count = np.maximum(np.asarray(self.count[layer])[row, chunks], 1).astype(np.float32)[:, None, None]

        def entries(sums: jax.Array, ring: jax.Array) -> jax.Array:
            pooled = (np.asarray(sums)[row, chunks] / count).astype(dtype)
            return jnp.asarray(np.concatenate([pooled, np.asarray(ring)[row, slots]], axis=0)[None])

        return LayerKV(entries(self.sum_k[layer], self.ring_k[layer]), entries(self.sum_v[layer], self.ring_v[layer]))

    def stored_positions(self, layer: int, row: int, length: int) -> list[int]:
        """Position of each entry :meth:`stored` returns (a pooled entry: its chunk's last token)."""
        chunks, slots, _ = self._row_layout(layer, row, length)
        ring_pos = np.asarray(self.ring_pos[layer])[row]
        size = self.chunk_size
        return [c * size + size - 1 for c in chunks] + [int(ring_pos[s]) for s in slots]

    def stats(self, layer: int, row: int, length: int) -> CompressionStats:
        """What ``layer`` of one row of logical length ``length`` stores."""
        chunks, slots, count = self._row_layout(layer, row, length)
        folded = int(sum(int(count[c]) for c in chunks))
        return CompressionStats(
            seq_len=length,
            compressed_chunks=len(chunks),
            compressed_tokens=folded,
            raw_tokens=len(slots),
            stored_entries=len(chunks) + len(slots),
            lost_tokens=length - folded - len(slots),
        )


@dataclass(frozen=True)
class CompressionStats:
    """What one layer of one row of a :class:`CompressedKVState` stores."""

    seq_len: int  # logical length: where the next token goes
    compressed_chunks: int  # pooled entries
    compressed_tokens: int  # tokens folded into the pooled entries
    raw_tokens: int  # tokens stored as they are
    stored_entries: int  # compressed_chunks + raw_tokens: the keys a query at seq_len attends over
    lost_tokens: int  # seq_len - compressed_tokens - raw_tokens (dropped by lossy truncates)


__all__ = ["CompressedKVState", "CompressionStats"]
