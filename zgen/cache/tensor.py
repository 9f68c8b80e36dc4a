"""TensorCache: fixed-shape device buffers [batch, capacity, kv_heads, head_dim] per layer.

The default cache. Token at position p lives in slot p, so visibility is a pure function of
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
from typing import Literal, Self

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.cache.base import LayerKV, replace_layer
from zgen.errors import CacheError
from zgen.numerics import matmul_precision
from zgen.pallas import flash_attention
from zgen.pallas.common import platform

# How DenseKVState.attend computes attention: "einsum" is causal_attention; "reference", "xla" and
# "triton" force that zgen.pallas.flash_attention implementation (Triton runs interpreted on CPU);
# "auto" is the flash kernels on GPU and "einsum" elsewhere.
DenseAttention = Literal["auto", "einsum", "reference", "xla", "triton"]


def causal_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S KVH D"],
    v: Float[Array, "B S KVH D"],
    q_positions: Int[Array, "B T"],
    *,
    sliding_window: int | None,
) -> Float[Array, "B T H D"]:
    """Grouped-query attention where key slot j is visible to a query at position p iff j <= p."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(batch, seq, kv_heads, heads // kv_heads, dim)
    qk_precision, pv_precision = matmul_precision(q.dtype, k.dtype), matmul_precision(v.dtype)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=jnp.float32, precision=qk_precision)
    scores = scores / math.sqrt(dim)
    slots = jnp.arange(k.shape[1])
    visible = slots[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        visible &= slots[None, None, :] > q_positions[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v, preferred_element_type=jnp.float32, precision=pv_precision)
    return out.reshape(batch, seq, heads, dim).astype(q.dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DenseKVState:
    """Per-layer K and V buffers, [batch, capacity, kv_heads, head_dim].

    ``attention`` is static (part of the compiled plan's key): see ``DenseAttention``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    attention: DenseAttention = field(default="auto", metadata=dict(static=True))

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
        return cls(
            tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
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
        new_k = self.k[layer].at[rows, slots].set(k.astype(self.k[layer].dtype), mode="drop")
        new_v = self.v[layer].at[rows, slots].set(v.astype(self.v[layer].dtype), mode="drop")
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
        path = self.attention
        if path == "auto":
            path = "triton" if platform() == "gpu" else "einsum"
        if path == "einsum":
            return causal_attention(q, self.k[layer], self.v[layer], positions, sliding_window=sliding_window)
        return flash_attention(
            q, self.k[layer], self.v[layer], q_positions=positions, sliding_window=sliding_window, implementation=path
        )

    def layer_view(self, layer: int) -> LayerKV:
        return LayerKV(self.k[layer], self.v[layer])


class TensorCache:
    """Host handle over a :class:`DenseKVState` with one shared sequence length for the batch."""

    def __init__(self, state: DenseKVState) -> None:
        self._state = state
        self._seq_len = 0

    @classmethod
    def allocate(
        cls, num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype: jnp.dtype
    ) -> TensorCache:
        return cls(DenseKVState.zeros(num_layers, batch, capacity, kv_heads, head_dim, dtype))

    @property
    def state(self) -> DenseKVState:
        return self._state

    @state.setter
    def state(self, value: DenseKVState) -> None:
        self._state = value

    @property
    def num_layers(self) -> int:
        return len(self._state.k)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def set_seq_len(self, n: int) -> None:
        """Record that the compiled plan wrote tokens up to ``n``."""
        if not 0 <= n <= self._state.capacity:
            raise CacheError(f"sequence length {n} outside [0, {self._state.capacity}]")
        self._seq_len = n

    def update(self, layer: int, k: jax.Array, v: jax.Array) -> None:
        new = k.shape[1]
        if self._seq_len + new > self._state.capacity:
            raise CacheError(
                f"cannot append {new} tokens to a cache holding {self._seq_len} of {self._state.capacity}; "
                "allocate a larger cache"
            )
        positions = jnp.broadcast_to(jnp.arange(self._seq_len, self._seq_len + new), k.shape[:2])
        self._state = self._state.write(layer, k, v, positions)
        if layer == self.num_layers - 1:
            self._seq_len += new

    def get(self, layer: int) -> LayerKV:
        view = self._state.layer_view(layer)
        return LayerKV(view.k[:, : self._seq_len], view.v[:, : self._seq_len])

    def reset(self) -> None:
        self._seq_len = 0

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self._seq_len:
            raise CacheError(f"cannot truncate a cache of {self._seq_len} tokens to {n}")
        self._seq_len = n


@dataclass(frozen=True)
class DenseBackend:
    """Fresh :class:`DenseKVState` buffers per batch; released buffers are simply dropped."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: jnp.dtype
    attention: DenseAttention = "auto"

    def allocate(self, batch: int, capacity: int) -> DenseKVState:
        return DenseKVState.zeros(
            self.num_layers, batch, capacity, self.kv_heads, self.head_dim, self.dtype, self.attention
        )

    def release(self, state: DenseKVState) -> None:
        del state  # device buffers are freed when the last reference goes
