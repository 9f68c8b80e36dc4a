"""The dense ("tensor") cache's device state: buffers [batch, capacity, kv_heads, head_dim] per layer.

The default cache kind (each sequence holds one row, see :mod:`zgen.cache.slots`). Token at position p lives in slot p, so visibility is a pure function of
positions (slot j is visible to a query at position p iff j <= p, within the sliding window), and
the state needs no lengths: slots past a sequence's end hold stale values that no query can see
before they are overwritten.

Attention runs on the GPU through ``zgen.pallas.flash_attention`` (Triton: the flash kernel for
prefill chunks, the split-K decode kernel for one token per row), which reads only the slots up to
each query's position; elsewhere it is :func:`causal_attention` over the whole buffer, whose exact
numerics the CPU parity tests against HF transformers rely on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal, Self

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from zgen.cache.base import LayerKV, replace_layer
from zgen.numerics import matmul_precision
from zgen.pallas import append_and_attend, flash_attention
from zgen.pallas.common import platform
from zgen.pallas.paged_attention.layouts import BIT_CONTAINERS
from zgen.pallas.triton_utils import MIN_DOT
from zgen.rope import rotary

# How DenseKVState.attend computes attention: "einsum" is causal_attention; "reference", "xla" and
# "triton" force that zgen.pallas.flash_attention implementation (Triton runs interpreted on CPU);
# "auto" is the flash kernels on GPU, elsewhere "einsum" for decode and "xla" for several queries a row.
DenseAttention = Literal["auto", "einsum", "reference", "xla", "triton"]


def dense_attention_path(path: DenseAttention, queries: int = 1) -> DenseAttention:
    """The path ``path`` runs on this platform for ``queries`` per row: ``"auto"`` is the flash kernels
    (Triton) on a GPU; elsewhere the einsum for one query (decode) and the blocked XLA kernel for more (a
    prefill chunk), which skips the key blocks no query sees where the einsum scores every slot of the
    row's capacity (on a 2-core CPU, 1.5x the einsum's speed to the first token of a 512-token prompt)."""
    if path == "auto":
        return "triton" if platform() == "gpu" else ("einsum" if queries == 1 else "xla")
    return path


def masked_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S KVH D"],
    v: Float[Array, "B S KVH D"],
    visible: Bool[Array, "B T S"],
) -> Float[Array, "B T H D"]:
    """Grouped-query attention of ``q`` over the keys ``visible`` marks, materialized in XLA (the
    dense, compressed and masked-paged caches all attend through it); a query that sees no key gets 0."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(batch, seq, kv_heads, heads // kv_heads, dim)
    qk_precision, pv_precision = matmul_precision(q.dtype, k.dtype), matmul_precision(v.dtype)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=jnp.float32, precision=qk_precision)
    scores = scores / math.sqrt(dim)
    mask = visible[:, None, None]
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    weights = jnp.where(jnp.any(mask, axis=-1, keepdims=True), weights, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v, preferred_element_type=jnp.float32, precision=pv_precision)
    return out.reshape(batch, seq, heads, dim).astype(q.dtype)


def causal_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S KVH D"],
    v: Float[Array, "B S KVH D"],
    q_positions: Int[Array, "B T"],
    *,
    sliding_window: int | None,
) -> Float[Array, "B T H D"]:
    """:func:`masked_attention` where key slot j is visible to a query at position p iff j <= p
    (and j > p - sliding_window)."""
    slots = jnp.arange(k.shape[1])
    visible = slots[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        visible &= slots[None, None, :] > q_positions[:, :, None] - sliding_window
    return masked_attention(q, k, v, visible)


def _stored_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype a buffer of ``dtype`` is kept in: on CPU bfloat16 in uint16 (XLA:CPU computes on
    bfloat16 in f32, so writing one token converted the whole buffer to f32 and back, 0.6 ms per
    write at 8192 slots; an integer buffer is written in place)."""
    dtype = jnp.dtype(dtype)
    return BIT_CONTAINERS.get(dtype, dtype) if platform() == "cpu" else dtype


def _floats(buffer: Array) -> Array:
    """A buffer as its float values (a uint16 buffer holds bfloat16 bits: KV buffers hold no integers)."""
    return jax.lax.bitcast_convert_type(buffer, jnp.bfloat16) if buffer.dtype == jnp.uint16 else buffer


def _stored(values: Array, buffer: Array) -> Array:
    """``values`` in ``buffer``'s storage dtype."""
    if buffer.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
    return values.astype(buffer.dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DenseKVState:
    """Per-layer K and V buffers, [batch, capacity, kv_heads, head_dim].

    ``attention`` is static (part of the compiled plan's key): see ``DenseAttention``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    attention: DenseAttention = field(default="auto", metadata=dict(static=True))
    positional: ClassVar[bool] = True  # slot j is visible to position p iff j <= p: truncation is bookkeeping

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        batch: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
        attention: DenseAttention = "auto",
    ) -> DenseKVState:
        shape = (batch, capacity, kv_heads, head_dim)
        stored = _stored_dtype(dtype)
        return cls(
            tuple(jnp.zeros(shape, stored) for _ in range(num_layers)),
            tuple(jnp.zeros(shape, stored) for _ in range(num_layers)),
            attention,
        )

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def write(
        self,
        layer: int,
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
    ) -> Self:
        rows = jnp.arange(positions.shape[0])[:, None]
        # Padding tokens at position -1 are dropped like those past the end (jnp would wrap -1 to the last slot).
        slots = jnp.where(positions >= 0, positions, self.capacity)
        new_k = self.k[layer].at[rows, slots].set(_stored(k, self.k[layer]), mode="drop")
        new_v = self.v[layer].at[rows, slots].set(_stored(v, self.v[layer]), mode="drop")
        return replace(
            self,
            k=replace_layer(self.k, layer, new_k),
            v=replace_layer(self.v, layer, new_v),
        )

    def attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        positions: Int[Array, "B T"],
        *,
        sliding_window: int | None,
    ) -> Float[Array, "B T H D"]:
        """Attention of ``q`` at ``positions`` over this layer's slots (padding queries at -1 give zeros
        on the kernel path; their values are never used)."""
        path = dense_attention_path(self.attention, q.shape[1])
        k, v = _floats(self.k[layer]), _floats(self.v[layer])
        if path == "einsum":
            return causal_attention(q, k, v, positions, sliding_window=sliding_window)
        return flash_attention(q, k, v, q_positions=positions, sliding_window=sliding_window, implementation=path)

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
        """RoPE on ``q`` and ``k``, :meth:`write`, then :meth:`attend`; a decode step on the flash
        kernels is one kernel that also updates the buffers in place (six launches fewer per layer,
        which bound small models' steps)."""
        one_kernel = (
            dense_attention_path(self.attention, q.shape[1]) == "triton"
            and q.shape[1] == 1
            and self.capacity % MIN_DOT == 0
            and jnp.issubdtype(self.k[layer].dtype, jnp.floating)
        )
        if not one_kernel:
            q, k = rotary(q, positions, inv_freq), rotary(k, positions, inv_freq)
            state = self.write(layer, k, v, positions)
            return state.attend(layer, q, positions, sliding_window=sliding_window), state
        out, new_k, new_v = append_and_attend(
            q, k, v, self.k[layer], self.v[layer], positions, inv_freq=inv_freq, sliding_window=sliding_window,
            implementation="triton",
        )
        return out, replace(self, k=replace_layer(self.k, layer, new_k), v=replace_layer(self.v, layer, new_v))

    def select(self, layer: int) -> DenseKVState:
        """A one-layer state holding ``layer`` (no copy: the same arrays)."""
        return replace(self, k=(self.k[layer],), v=(self.v[layer],))

    def merge(self, layer: int, one: DenseKVState) -> DenseKVState:
        """This state with ``layer`` taken from the one-layer state ``one`` (see :meth:`select`)."""
        return replace(self, k=replace_layer(self.k, layer, one.k[0]), v=replace_layer(self.v, layer, one.v[0]))

    def head_specs(self, axis: str) -> DenseKVState:
        """This state's pytree with a ``PartitionSpec`` per buffer, splitting KV heads over mesh axis ``axis``."""
        heads = PartitionSpec(None, None, axis)
        return replace(self, k=tuple(heads for _ in self.k), v=tuple(heads for _ in self.v))

    def layer_view(self, layer: int) -> LayerKV:
        return LayerKV(_floats(self.k[layer]), _floats(self.v[layer]))

    def stored(self, layer: int, row: int, length: int) -> LayerKV:
        """One row's first ``length`` slots of ``layer``, ``[1, length, kv_heads, head_dim]``."""
        return LayerKV(_floats(self.k[layer][row : row + 1, :length]), _floats(self.v[layer][row : row + 1, :length]))

    def grown(self, batch: int, capacity: int) -> DenseKVState:
        """The same contents in buffers of ``batch`` rows and ``capacity`` slots (zero-padded)."""
        def pad(x: jax.Array) -> jax.Array:
            return jnp.pad(x, ((0, batch - x.shape[0]), (0, capacity - x.shape[1]), (0, 0), (0, 0)))

        return replace(self, k=tuple(pad(x) for x in self.k), v=tuple(pad(x) for x in self.v))

    def truncate_rows(self, keep: Int[Array, " B"], lengths: Int[Array, " B"]) -> DenseKVState:
        """Nothing to do (``positional``): a slot past a row's length is never visible before it is written again."""
        del keep, lengths
        return self
