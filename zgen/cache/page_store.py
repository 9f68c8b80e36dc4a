"""The device pages of a paged KV cache, shared by every sequence drawn from one block pool.

:class:`PageStore` owns the pages of every layer (K and V, in the storage format of its
:class:`PagedConfig`) and writes, copies and reads them through small compiled helpers; the
:class:`~zgen.cache.block_pool.BlockPool` beside it does the bookkeeping of which pages are in use.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array

from zgen.cache.base import replace_layer
from zgen.cache.block_pool import BlockPool
from zgen.cache.formats import empty_pages, kv_format
from zgen.cache.paged_state import PagedKVState, device_calibration
from zgen.cache.sharded import pages_split_by_heads
from zgen.errors import CacheError, ConfigError
from zgen.pallas.paged_attention.api import PAGED_IMPLEMENTATIONS
from zgen.pallas.paged_attention.layouts import KeyCalibration, KVPages
from zgen.shapes import next_pow2


def available_memory_bytes() -> int:
    """Bytes a new allocation can take on the default device, at most.

    Accelerators report their free memory; on CPU the pages live in host memory, bounded by the
    machine's physical memory (not what is free this moment: the page cache gives memory back) and by
    the process's address-space limit (``RLIMIT_AS``) where one is set.
    """
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * resource.getpagesize()
        free = min(free, soft - mapped)
    return free


def _one_layer(calibration: KeyCalibration | None) -> tuple[KeyCalibration] | None:
    return None if calibration is None else (calibration,)


@partial(jax.jit, static_argnames=("kv_dtype",), donate_argnums=(0, 1))
def _write_layer(
    k_pages: KVPages,
    v_pages: KVPages,
    k: Array,
    v: Array,
    tables: Array,
    positions: Array,
    calibration: KeyCalibration | None,
    kv_dtype: str,
) -> tuple[KVPages, KVPages]:
    state = PagedKVState((k_pages,), (v_pages,), tables, kv_dtype, key_calibration=_one_layer(calibration))
    state = state.write(0, k, v, positions)
    return state.k[0], state.v[0]


@partial(jax.jit, donate_argnums=(0, 1))
def _copy_pages(
    k: tuple[KVPages, ...], v: tuple[KVPages, ...], src: Array, dst: Array
) -> tuple[tuple[KVPages, ...], tuple[KVPages, ...]]:
    """Copy page ``src[i]`` to ``dst[i]`` in every layer (out-of-range ``dst`` entries are skipped)."""

    def copy(leaf: Array) -> Array:
        return leaf.at[:, dst].set(jnp.take(leaf, src, axis=1, mode="clip"), mode="drop")

    return jax.tree_util.tree_map(copy, k), jax.tree_util.tree_map(copy, v)


@partial(jax.jit, static_argnames=("kv_dtype", "dtype"))
def _view(
    k_pages: KVPages, v_pages: KVPages, tables: Array, calibration: KeyCalibration | None, kv_dtype: str, dtype: str
) -> tuple[Array, Array]:
    view = PagedKVState((k_pages,), (v_pages,), tables, kv_dtype, dtype, _one_layer(calibration)).layer_view(0)
    return view.k, view.v


@dataclass(frozen=True)
class PagedConfig:
    """Shape and storage format of a paged cache."""

    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    kv_dtype: str = "bf16"
    dtype: str = "float32"  # dtype of read-back views (``get``, ``layer_view``)
    # Per-layer key statistics the coded formats (q4, q3) code keys with (zgen.runtime.calibration).
    key_calibration: tuple[KeyCalibration, ...] | None = field(default=None, compare=False)
    attention: str | None = None  # the paged_attention implementation steps use; None: the platform's best

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"PagedConfig.{name} must be positive, got {getattr(self, name)}")
        if self.attention is not None and self.attention not in PAGED_IMPLEMENTATIONS:
            raise ConfigError(f"unknown paged attention implementation {self.attention!r}; choose one of {', '.join(PAGED_IMPLEMENTATIONS)} or None")
        kv_format(self.kv_dtype, self.head_dim)
        device_calibration(self.key_calibration, self.num_layers, self.kv_heads, self.head_dim)  # checks shapes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers (K and V)."""
        return self.num_layers * kv_format(self.kv_dtype).bytes_per_token_per_layer(self.kv_heads, self.head_dim, self.page_size)


class PageStore:
    """The device pages of every layer, shared by all caches and states drawn from one pool.

    A compiled step donates the state it is given (so XLA updates the pages in place) and returns the
    new one; :meth:`absorb` takes its pages back. A step that fails after donating leaves deleted
    pages: every later use raises :class:`~zgen.errors.CacheError` until :meth:`reset_pages`.
    """

    def __init__(self, config: PagedConfig, pool: BlockPool, mesh: Mesh | None = None) -> None:
        if pool.page_size != config.page_size:
            raise ConfigError(f"pool page_size {pool.page_size} differs from the config's {config.page_size}")
        self.config = config
        self.pool = pool
        self.mesh = mesh  # a split model's devices: each holds its KV heads' part of every page
        self.k: tuple[KVPages, ...] = ()
        self.v: tuple[KVPages, ...] = ()
        self.reset_pages()

    @classmethod
    def with_budget(cls, config: PagedConfig, max_memory_mb: float, mesh: Mesh | None = None) -> PageStore:
        """A store on a fresh pool of as many blocks as ``max_memory_mb`` MiB of pages hold (over all
        of ``mesh``'s devices, each holding its KV heads' share).

        A budget the device cannot hold (pages plus the pool's host bookkeeping) is refused before
        anything is allocated, rather than failing deep inside the allocator.
        """
        block_bytes = config.bytes_per_token * config.page_size
        num_blocks = BlockPool.blocks_in_budget(max_memory_mb, block_bytes, config.page_size)
        devices = 1 if mesh is None else mesh.size
        needed = num_blocks * (block_bytes // devices + BlockPool.HOST_BYTES_PER_BLOCK)
        available = available_memory_bytes()
        if needed > available:
            raise ConfigError(
                f"max_memory_mb={max_memory_mb} asks for {needed / 2**20:,.0f} MiB of KV pages and pool "
                f"bookkeeping, but only {available / 2**20:,.0f} MiB are free on {jax.devices()[0].platform}; "
                "lower max_memory_mb"
            )
        return cls(config, BlockPool(num_blocks, config.page_size), mesh)

    def reset_pages(self) -> None:
        """Fresh zeroed pages for every layer (the pool's bookkeeping is untouched)."""
        c = self.config
        n = self.pool.num_blocks

        def empty() -> tuple[KVPages, ...]:
            return tuple(empty_pages(c.kv_dtype, c.kv_heads, n, c.page_size, c.head_dim) for _ in range(c.num_layers))

        mesh = self.mesh
        build = empty if mesh is None else lambda: pages_split_by_heads(empty, mesh)
        self.k, self.v = build(), build()

    @property
    def nbytes(self) -> int:
        """Device bytes of all pages (K and V, every layer)."""
        leaves = jax.tree_util.tree_leaves((self.k, self.v))
        return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)

    def ensure_available(self) -> None:
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves((self.k, self.v))):
            raise CacheError(
                "the KV pages were donated to a compiled step that failed and are gone; the sequences on this "
                "pool have lost their K/V (reset_pages starts over with empty pages)"
            )

    def absorb(self, state: PagedKVState) -> None:
        """Take back the pages of the state a compiled step returned."""
        self.k, self.v = tuple(state.k), tuple(state.v)

    def state(self, block_tables: np.ndarray) -> PagedKVState:
        """The pages with ``block_tables`` (the key calibration as fresh copies: a step donates them)."""
        self.ensure_available()
        c = self.config
        calibration = device_calibration(c.key_calibration, c.num_layers, c.kv_heads, c.head_dim)
        tables = jax.device_put(block_tables.astype(np.int32, copy=False))
        return PagedKVState(self.k, self.v, tables, c.kv_dtype, c.dtype, calibration, c.attention)

    def _layer_calibration(self, layer: int) -> KeyCalibration | None:
        calibration = self.config.key_calibration
        return None if calibration is None else calibration[layer]

    def write(self, layer: int, k: Array, v: Array, tables: np.ndarray, positions: np.ndarray) -> None:
        """Write ``k, v [B, n, KVH, D]`` at ``positions [B, n]`` (``-1`` = skip); pads n to a power of two."""
        self.ensure_available()
        n = k.shape[1]
        t = next_pow2(n)
        pos = np.full((k.shape[0], t), -1, np.int32)
        pos[:, :n] = positions
        pad = ((0, 0), (0, t - n), (0, 0), (0, 0))
        new_k, new_v = _write_layer(
            self.k[layer], self.v[layer], jnp.pad(k, pad), jnp.pad(v, pad), jnp.asarray(tables), jnp.asarray(pos),
            self._layer_calibration(layer), kv_dtype=self.config.kv_dtype,
        )
        self.k = replace_layer(self.k, layer, new_k)
        self.v = replace_layer(self.v, layer, new_v)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int], width: int) -> None:
        """Copy pages ``src[i] -> dst[i]`` in every layer (padded to ``width`` entries to bound compiles)."""
        self.ensure_available()
        if not src:
            return
        s = np.zeros(max(width, len(src)), np.int32)
        d = np.full(max(width, len(src)), self.pool.num_blocks, np.int32)
        s[: len(src)], d[: len(dst)] = src, dst
        self.k, self.v = _copy_pages(self.k, self.v, jnp.asarray(s), jnp.asarray(d))

    def view(self, layer: int, tables: np.ndarray) -> tuple[Array, Array]:
        self.ensure_available()
        c = self.config
        return _view(
            self.k[layer], self.v[layer], jnp.asarray(tables, jnp.int32), self._layer_calibration(layer),
            kv_dtype=c.kv_dtype, dtype=c.dtype,
        )
