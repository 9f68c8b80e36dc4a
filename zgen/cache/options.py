"""Choosing a cache kind for a Generator: the Go package's functional options, in Python.

    Generator(model, paged_kv(max_memory_mb=512), kv_dtype("q4"), prefix_cache(capacity_blocks=2048))

Each option returns a function that refines a :class:`CacheOptions`; :func:`make_backend` turns the
result into the :class:`~zgen.cache.base.CacheBackend` the generator allocates from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax.numpy as jnp

from zgen.cache.base import CacheBackend
from zgen.cache.block_pool import BlockPool
from zgen.cache.compressed import CompressedBackend
from zgen.cache.paged import KV_DTYPES, PagedBackend, PagedConfig, PagedKVState
from zgen.cache.tensor import DenseBackend
from zgen.config import ModelConfig
from zgen.errors import ConfigError

CACHE_KINDS = ("tensor", "flat", "paged", "compressed")
_FLOAT_KV = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
DEFAULT_PAGED_MEMORY_MB = 1024.0


@dataclass(frozen=True)
class CacheOptions:
    kind: str = "tensor"
    kv_dtype: str | None = None  # None: the model's activation dtype
    max_memory_mb: float | None = None  # paged pool budget; None: DEFAULT_PAGED_MEMORY_MB
    page_size: int = 16
    chunk_size: int = 32  # compressed: tokens per mean-pooled chunk
    prefix_cache_blocks: int | None = None  # paged: radix prefix cache of at most this many blocks

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ConfigError(f"unknown cache kind {self.kind!r}; choose one of {', '.join(CACHE_KINDS)}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"unknown kv dtype {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
        if self.prefix_cache_blocks is not None and self.kind != "paged":
            raise ConfigError("a prefix cache shares paged blocks: use it with the paged cache (paged_kv)")
        if self.kv_dtype not in (None, *_FLOAT_KV) and self.kind == "compressed":
            raise ConfigError(f"the compressed cache stores pooled float values; kv dtype {self.kv_dtype!r} needs tensor, flat or paged")


CacheOption = Callable[[CacheOptions], CacheOptions]


def paged_kv(max_memory_mb: float = DEFAULT_PAGED_MEMORY_MB, page_size: int = 16) -> CacheOption:
    """Fixed-size blocks from a pool sized by a memory budget."""
    return lambda o: replace(o, kind="paged", max_memory_mb=max_memory_mb, page_size=page_size)


def flat_kv() -> CacheOption:
    return lambda o: replace(o, kind="flat")


def kv_dtype(dtype: str) -> CacheOption:
    """Storage dtype of K/V: fp32, bf16, fp16, fp8, q4 or q3."""
    return lambda o: replace(o, kv_dtype=dtype)


def compressed_kv(chunk_size: int = 32) -> CacheOption:
    """Chunk-wise mean pooling of older K/V, the most recent chunk kept exact."""
    return lambda o: replace(o, kind="compressed", chunk_size=chunk_size)


def prefix_cache(capacity_blocks: int) -> CacheOption:
    """Radix prefix cache over paged blocks: shared prompt prefixes are prefilled once."""
    return lambda o: replace(o, kind="paged", prefix_cache_blocks=capacity_blocks)


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
            c.num_layers, batch, capacity, c.kv_heads, c.head_dim, kv_dtype=c.kv_dtype, page_size=c.page_size, dtype=c.dtype
        )

    def release(self, state: PagedKVState) -> None:
        del state


def make_backend(options: CacheOptions, config: ModelConfig, dtype: jnp.dtype) -> CacheBackend[Any]:
    c = config
    model_kv = {jnp.dtype(v): k for k, v in _FLOAT_KV.items()}.get(jnp.dtype(dtype), "fp32")
    storage = options.kv_dtype or model_kv
    paged = PagedConfig(c.num_layers, c.num_kv_heads, c.head_dim, options.page_size, storage, jnp.dtype(dtype).name)
    if options.kind == "paged":
        pool = BlockPool.from_memory_budget(
            options.max_memory_mb or DEFAULT_PAGED_MEMORY_MB,
            num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            page_size=options.page_size, kv_dtype=storage,
        )
        return PagedBackend(
            paged, pool, prefix_cache=options.prefix_cache_blocks is not None, max_prefix_blocks=options.prefix_cache_blocks
        )
    if options.kind == "compressed":
        return CompressedBackend(c.num_layers, c.num_kv_heads, c.head_dim, options.chunk_size, jnp.dtype(_FLOAT_KV[storage]))
    if storage in _FLOAT_KV:
        return DenseBackend(c.num_layers, c.num_kv_heads, c.head_dim, jnp.dtype(_FLOAT_KV[storage]))
    return ContiguousQuantizedBackend(paged)
