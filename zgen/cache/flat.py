"""KVCache: the Go package's flat cache — one buffer per layer, pre-allocated to the maximum length.

Each layer owns one contiguous K and one contiguous V buffer of shape
``[batch, max_len, kv_heads, head_dim]`` (the device state is a :class:`~zgen.cache.tensor.DenseKVState`,
so plans compiled for the dense kind are reused as they are). Token ``p`` lives in slot ``p``.

What is and is not a copy (JAX arrays are immutable and cannot be strided views of one another):

- :meth:`KVCache.buffers` returns the layer's buffers themselves: never a copy.
- :meth:`KVCache.get` returns the buffers themselves when the layer is full (``seq_len == max_len``);
  otherwise it returns ``buffer[:, :seq_len]``, which XLA materializes: a copy of ``seq_len`` tokens.
- :meth:`KVCache.numpy_view` returns read-only numpy views of the valid prefix. On the CPU backend
  ``np.asarray`` shares the device buffer's memory, so this is zero-copy; on an accelerator it is one
  device-to-host transfer of the whole buffer.
- :meth:`KVCache.update` writes through a jitted ``dynamic_update_slice``. Where the platform supports
  buffer donation (GPU, TPU) the buffer is donated and XLA updates it in place — no copy of the
  ``max_len`` buffer. A buffer that a zero-copy read or a :meth:`KVCache.fork` handed out is *shared*
  and is never donated: the first write after such a read copies it (copy-on-write), so arrays returned
  earlier stay valid. The CPU backend ignores donation, so there every write copies the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from zgen.cache.base import LayerKV, replace_layer
from zgen.cache.tensor import DenseKVState
from zgen.errors import CacheError


def _write_slice(
    buffer: Float[Array, "B L KVH D"], new: Float[Array, "B T KVH D"], start: Int[Array, ""]
) -> Float[Array, "B L KVH D"]:
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(buffer, new.astype(buffer.dtype), (zero, start, zero, zero))


_write_copy = jax.jit(_write_slice)
_write_donated = jax.jit(_write_slice, donate_argnums=(0,))


def _donation_supported(array: jax.Array) -> bool:
    return all(device.platform != "cpu" for device in array.devices())


class KVCache:
    """Host handle over one pre-allocated ``[batch, max_len, kv_heads, head_dim]`` buffer pair per layer.

    Layers are appended independently (each keeps its own length, so layer 0 may run ahead of
    layer 1 within a step); :attr:`seq_len` is the length every layer has reached. All rows of the
    batch share one length. ``fork()`` is O(1): the fork shares the buffers and each side copies a
    layer on its first write to it.
    """

    def __init__(self, state: DenseKVState, seq_len: int = 0) -> None:
        if not 0 <= seq_len <= state.capacity:
            raise CacheError(f"initial sequence length {seq_len} outside [0, {state.capacity}]")
        self._state = state
        self._lengths = [seq_len] * len(state.k)
        self._shared = [False] * len(state.k)

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.dtype(jnp.float32),
    ) -> KVCache:
        """A cache of ``num_layers`` zeroed buffer pairs with room for ``max_len`` tokens per row."""
        for name, value in {"num_layers": num_layers, "batch": batch, "max_len": max_len,
                            "kv_heads": kv_heads, "head_dim": head_dim}.items():
            if value <= 0:
                raise CacheError(f"KVCache.allocate: {name} must be positive, got {value}")
        return cls(DenseKVState.zeros(num_layers, batch, max_len, kv_heads, head_dim, dtype))

    # -- shape ---------------------------------------------------------------------------------------

    @property
    def state(self) -> DenseKVState:
        """The device state (pass it to a plan; hand the result back through the setter)."""
        self._shared = [True] * self.num_layers  # the caller may keep it: no donation until rewritten
        return self._state

    @state.setter
    def state(self, value: DenseKVState) -> None:
        if len(value.k) != self.num_layers or value.k[0].shape != self._state.k[0].shape:
            raise CacheError(
                "the new state's layout differs from this cache's "
                f"({len(value.k)} layers of {value.k[0].shape} vs {self.num_layers} of {self._state.k[0].shape}); "
                "pass the state returned by a plan called with this cache's state"
            )
        self._state = value
        self._shared = [True] * self.num_layers

    @property
    def num_layers(self) -> int:
        return len(self._state.k)

    @property
    def batch(self) -> int:
        return self._state.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self._state.capacity

    @property
    def capacity(self) -> int:
        return self._state.capacity

    @property
    def seq_len(self) -> int:
        """Tokens every layer holds."""
        return min(self._lengths)

    def layer_len(self, layer: int) -> int:
        """Tokens ``layer`` holds (ahead of :attr:`seq_len` while a step is half written)."""
        return self._lengths[self._check_layer(layer)]

    def set_seq_len(self, n: int) -> None:
        """Record that a compiled plan wrote every layer up to ``n`` tokens."""
        if not 0 <= n <= self.max_len:
            raise CacheError(f"sequence length {n} outside [0, {self.max_len}]; the cache holds {self.max_len} slots")
        self._lengths = [n] * self.num_layers

    # -- the CacheProvider surface -------------------------------------------------------------------

    def update(self, layer: int, k: Float[Array, "B T KVH D"], v: Float[Array, "B T KVH D"]) -> None:
        """Append ``k``/``v`` [batch, new, kv_heads, head_dim] to ``layer`` at its current end."""
        layer = self._check_layer(layer)
        buffer = self._state.k[layer]
        new = k.shape[1] if k.ndim == 4 else -1
        expected = (buffer.shape[0], new, buffer.shape[2], buffer.shape[3])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise CacheError(
                f"update of layer {layer}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                f"[batch={buffer.shape[0]}, new, kv_heads={buffer.shape[2]}, head_dim={buffer.shape[3]}]"
            )
        start = self._lengths[layer]
        if start + new > self.max_len:
            raise CacheError(
                f"cannot append {new} tokens to layer {layer} holding {start} of {self.max_len}; "
                "allocate a KVCache with a larger max_len or truncate first"
            )
        if new == 0:
            return
        donate = not self._shared[layer] and _donation_supported(buffer)
        write = _write_donated if donate else _write_copy
        offset = jnp.asarray(start, jnp.int32)
        new_k = write(self._state.k[layer], jnp.asarray(k), offset)
        new_v = write(self._state.v[layer], jnp.asarray(v), offset)
        self._state = replace(
            self._state,
            k=replace_layer(self._state.k, layer, new_k),
            v=replace_layer(self._state.v, layer, new_v),
        )
        self._shared[layer] = False
        self._lengths[layer] = start + new

    def get(self, layer: int) -> LayerKV:
        """K/V of ``layer`` up to its length: the buffers themselves when full, else a sliced copy."""
        layer = self._check_layer(layer)
        n = self._lengths[layer]
        k, v = self._state.k[layer], self._state.v[layer]
        if n == self.max_len:
            self._shared[layer] = True
            return LayerKV(k, v)
        return LayerKV(k[:, :n], v[:, :n])

    def buffers(self, layer: int) -> LayerKV:
        """The whole ``[batch, max_len, ...]`` buffers of ``layer`` (never a copy; slots past its length are stale)."""
        layer = self._check_layer(layer)
        self._shared[layer] = True
        return LayerKV(self._state.k[layer], self._state.v[layer])

    def numpy_view(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Read-only numpy K/V of ``layer`` up to its length; zero-copy on the CPU backend."""
        layer = self._check_layer(layer)
        self._shared[layer] = True
        n = self._lengths[layer]
        return np.asarray(self._state.k[layer])[:, :n], np.asarray(self._state.v[layer])[:, :n]

    def reset(self) -> None:
        """Forget every token (the buffers keep their stale values; nothing can read them)."""
        self._lengths = [0] * self.num_layers

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of every layer exactly."""
        if not 0 <= n <= self.seq_len:
            raise CacheError(
                f"cannot truncate a KVCache of {self.seq_len} tokens to {n}; n must lie in [0, {self.seq_len}]"
            )
        self._lengths = [n] * self.num_layers

    def fork(self) -> KVCache:
        """A second handle sharing this cache's buffers; each side copies a layer on its first write."""
        twin = KVCache(self._state)
        twin._lengths = list(self._lengths)
        twin._shared = [True] * self.num_layers
        self._shared = [True] * self.num_layers
        return twin

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise CacheError(f"layer {layer} out of range; this cache has layers 0..{self.num_layers - 1}")
        return layer


__all__ = ["KVCache"]
