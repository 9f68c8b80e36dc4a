"""Choosing a cache kind for a Generator: the Go package's functional options, in Python.

    Generator(model, paged_kv(max_memory_mb=512), kv_dtype("q4"), prefix_cache(capacity_blocks=2048))
    Generator(model, tiered_kv(TieredConfig(warm_blocks=1024)), paged_kv(max_memory_mb=512))

Each option returns a function that refines a :class:`CacheOptions`; :func:`make_backend` turns the
result into the :class:`~zgen.cache.base.CacheBackend` the generator allocates from. Options apply in
order and a later kind wins, except that the tiered cache *is* a paged one: ``paged_kv`` and
``prefix_cache`` refine it rather than replace it (``prefix_cache`` also turns the default dense cache
into a paged one, and is refused with flat or compressed caches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from zgen.cache.base import CacheBackend
from zgen.cache.block_pool import BlockPool
from zgen.cache.compressed import CompressedBackend
from zgen.cache.paged import CODED_KV_DTYPES, KV_DTYPES, PagedBackend, PagedConfig, PagedKVState
from zgen.cache.tensor import DenseBackend
from zgen.cache.tiered import TieredConfig, TieredPagedBackend
from zgen.errors import ConfigError

if TYPE_CHECKING:
    from zgen.model import Model

CACHE_KINDS = ("tensor", "flat", "paged", "compressed", "tiered")
_PAGED_KINDS = ("paged", "tiered")
_FLOAT_KV = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
DEFAULT_PAGED_MEMORY_MB = 1024.0
# The tiers of tiered_kv() give back exactly the bits the device evicted, so a prompt restored from host
# RAM or disk generates what a prefill would (a prefix cache should never change outputs); the pool's
# kv_dtype already decides the compression, and the host copy costs what the device copy did.
DEFAULT_TIERED_CONFIG = TieredConfig(warm_format="exact")


@dataclass(frozen=True)
class CacheOptions:
    kind: str = "tensor"
    kv_dtype: str | None = None  # None: the model's activation dtype
    max_memory_mb: float | None = None  # paged pool budget; None: DEFAULT_PAGED_MEMORY_MB
    page_size: int = 16
    chunk_size: int = 32  # compressed: tokens per mean-pooled chunk
    prefix_cache_blocks: int | None = None  # paged, tiered: radix prefix cache of at most this many blocks
    tiered: TieredConfig | None = None  # tiered: the host RAM and disk levels; None: DEFAULT_TIERED_CONFIG

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ConfigError(f"unknown cache kind {self.kind!r}; choose one of {', '.join(CACHE_KINDS)}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"unknown kv dtype {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
        if self.prefix_cache_blocks is not None and self.kind not in _PAGED_KINDS:
            raise ConfigError(
                f"a prefix cache shares paged blocks and the {self.kind} cache has none: "
                "use it with the paged or tiered cache (paged_kv, tiered_kv)"
            )
        if self.tiered is not None and not isinstance(self.tiered, TieredConfig):
            raise ConfigError(f"tiered_kv takes a TieredConfig (zgen.cache.tiered), got {type(self.tiered).__name__}")
        if self.tiered is not None and self.kind != "tiered":
            raise ConfigError(
                f"a TieredConfig configures the tiered cache, not the {self.kind} one; drop it or make tiered_kv the last kind chosen"
            )
        if self.kv_dtype not in (None, *_FLOAT_KV) and self.kind == "compressed":
            raise ConfigError(f"the compressed cache stores pooled float values; kv dtype {self.kv_dtype!r} needs tensor, flat, paged or tiered")


CacheOption = Callable[[CacheOptions], CacheOptions]


def paged_kv(max_memory_mb: float = DEFAULT_PAGED_MEMORY_MB, page_size: int = 16) -> CacheOption:
    """Fixed-size blocks from a pool sized by a memory budget (the tiered cache's pool, if it was chosen)."""
    return lambda o: replace(
        o, kind="tiered" if o.kind == "tiered" else "paged", max_memory_mb=max_memory_mb, page_size=page_size
    )


def flat_kv() -> CacheOption:
    return lambda o: replace(o, kind="flat")


def kv_dtype(dtype: str) -> CacheOption:
    """Storage dtype of K/V: fp32, bf16, fp16, fp8, q4 or q3."""
    return lambda o: replace(o, kv_dtype=dtype)


def compressed_kv(chunk_size: int = 32) -> CacheOption:
    """Chunk-wise mean pooling of older K/V, the most recent chunk kept exact."""
    return lambda o: replace(o, kind="compressed", chunk_size=chunk_size)


def prefix_cache(capacity_blocks: int) -> CacheOption:
    """Radix prefix cache over paged blocks: shared prompt prefixes are prefilled once.

    Turns the default dense cache into a paged one; with the tiered cache it bounds the device level.
    """
    return lambda o: replace(o, kind="paged" if o.kind == "tensor" else o.kind, prefix_cache_blocks=capacity_blocks)


def tiered_kv(config: TieredConfig | None = None, max_memory_mb: float | None = None) -> CacheOption:
    """A paged cache with a prefix cache whose evicted blocks go to host RAM and disk, and come back.

    Blocks the device pool evicts from the prefix cache are kept in a
    :class:`~zgen.cache.tiered.TieredKVStore` (``config``; default :data:`DEFAULT_TIERED_CONFIG`, exact)
    and copied back when a later prompt starts with them, skipping their prefill. A lossy
    ``warm_format`` ("float16", "int8") saves host RAM and disk but restored K/V differ slightly, so
    outputs may too; it needs a float ``kv_dtype``. ``max_memory_mb`` is the device pool's budget
    (default: what ``paged_kv`` set, else :data:`DEFAULT_PAGED_MEMORY_MB`). Close the Generator (or let
    it be collected) to delete the store's files.
    """
    return lambda o: replace(
        o, kind="tiered", tiered=config, max_memory_mb=o.max_memory_mb if max_memory_mb is None else max_memory_mb
    )


def resolve(options: Sequence[CacheOption]) -> CacheOptions:
    result = CacheOptions()
    for option in options:
        result = option(result)
    return replace(result)  # re-run validation on the combination


@dataclass(frozen=True)
class ContiguousQuantizedBackend:
    """Dense layout with quantized storage: each row owns a contiguous run of pages."""

    config: PagedConfig

    def allocate(self, batch: int, capacity: int) -> PagedKVState:
        c = self.config
        return PagedKVState.contiguous(
            c.num_layers, batch, capacity, c.kv_heads, c.head_dim, kv_dtype=c.kv_dtype, page_size=c.page_size,
            dtype=c.dtype, key_calibration=c.key_calibration,
        )

    def release(self, state: PagedKVState) -> None:
        del state


def make_backend(options: CacheOptions, model: Model) -> CacheBackend[Any]:
    c, dtype = model.config, model.dtype
    model_kv = {jnp.dtype(v): k for k, v in _FLOAT_KV.items()}.get(jnp.dtype(dtype), "fp32")
    storage = options.kv_dtype or model_kv
    # Coded formats (q4, q3) code keys with the model's key statistics (computed once per model).
    calibration = model.key_calibration if storage in CODED_KV_DTYPES else None
    paged = PagedConfig(
        c.num_layers, c.num_kv_heads, c.head_dim, options.page_size, storage, jnp.dtype(dtype).name, calibration
    )
    if options.kind in _PAGED_KINDS:
        pool = BlockPool.from_memory_budget(
            options.max_memory_mb or DEFAULT_PAGED_MEMORY_MB,
            num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            page_size=options.page_size, kv_dtype=storage,
        )
        if options.kind == "tiered":
            return TieredPagedBackend(
                paged, pool, options.tiered or DEFAULT_TIERED_CONFIG, max_prefix_blocks=options.prefix_cache_blocks
            )
        return PagedBackend(
            paged, pool, prefix_cache=options.prefix_cache_blocks is not None, max_prefix_blocks=options.prefix_cache_blocks
        )
    if options.kind == "compressed":
        return CompressedBackend(c.num_layers, c.num_kv_heads, c.head_dim, options.chunk_size, jnp.dtype(_FLOAT_KV[storage]))
    if storage in _FLOAT_KV:
        return DenseBackend(c.num_layers, c.num_kv_heads, c.head_dim, jnp.dtype(_FLOAT_KV[storage]))
    return ContiguousQuantizedBackend(paged)
