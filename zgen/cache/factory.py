"""The one KV factory: cache options in, a :class:`~zgen.cache.base.KVManager` out, for every front end.

Options are functions (functional options), applied in order (a later kind wins, except that
``paged_kv`` and ``prefix_cache`` refine a tiered cache rather than replace it)::

    Generator(model, paged_kv(max_memory_mb=512), kv_dtype("q4"), prefix_cache(capacity_blocks=2048))
    Engine(model, tiered_kv(TieredConfig(warm_blocks=1024)), paged_kv(max_memory_mb=512))

=============  ============================================  ===============  ================  ========
kind           what a sequence holds                         KV formats       prefix cache      contexts
=============  ============================================  ===============  ================  ========
``tensor``     a row of a dense batch, grown as needed       fp32 bf16 fp16   no                no
``flat``       a row pre-allocated to the model's context     fp32 bf16 fp16   no                no
``compressed`` a row of chunk means + the raw recent chunk    fp32 bf16 fp16   no                no
``paged``      pages of a shared pool (fork: shared pages)   every format     optional (radix)  yes
``tiered``     ``paged`` + evicted prefixes in RAM / disk    every format     always            yes
=============  ============================================  ===============  ================  ========

Without a kind the factory picks ``tensor`` for float formats and ``paged`` for the page layouts
(fp8, q4, q3); naming ``tensor`` (or ``flat``, ``compressed``) with a page layout is an error, never a
silent switch. Contexts fork and mask pages, so they take the paged kinds only (the engine refuses
the others with a typed error).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import get_args

import jax.numpy as jnp
from jax.sharding import Mesh

from zgen.cache.base import KVManager
from zgen.cache.compressed import CompressedKVState
from zgen.cache.formats import kv_dtype_of, kv_format
from zgen.cache.page_store import PagedConfig, PageStore
from zgen.cache.paged_manager import PagedKVManager
from zgen.cache.sharded import state_split_by_heads
from zgen.cache.slots import SlotKVManager, SlotState
from zgen.cache.tensor import DenseAttention, DenseKVState
from zgen.cache.tiered import TieredConfig, TieredKVManager
from zgen.config import ModelConfig
from zgen.errors import ConfigError
from zgen.pallas.common import platform
from zgen.pallas.paged_attention.api import PAGED_IMPLEMENTATIONS
from zgen.pallas.paged_attention.layouts import KeyCalibration
from zgen.shapes import next_pow2

CACHE_KINDS = ("tensor", "flat", "compressed", "paged", "tiered")
PAGED_KINDS = ("paged", "tiered")
DEFAULT_PAGED_MEMORY_MB = 512.0


def default_page_size() -> int:
    """Tokens per page when none is chosen: 64 on GPUs, 16 elsewhere. The paged Triton kernel takes a
    page per loop step: at batch 64 with 1,000-token rows (Llama-3-8B shape, NVIDIA H200) one layer's
    decode attention took 130 µs with pages of 16, 98 with 32 and 91 with 64, and a batch job's decode
    step 9.8 ms against 8.1 (``benchmarks/batch_job.py``). A page is allocated whole and shared whole by
    the prefix cache, so small pages waste less and share more where no kernel reads them."""
    return 64 if platform() == "gpu" else 16
# The tiers of tiered_kv() give back exactly the bits the device evicted, so a prompt restored from host
# RAM or disk generates what a prefill would (a prefix cache should never change outputs); the pool's
# kv_dtype already decides the compression, and the host copy costs what the device copy did.
DEFAULT_TIERED_CONFIG = TieredConfig(warm_format="exact")


@dataclass(frozen=True)
class CacheOptions:
    """Every cache setting a user can make (see the module docstring)."""

    kind: str | None = None  # None: tensor for float formats, paged for page layouts
    kv_dtype: str | None = None  # None: the model's activation dtype
    max_memory_mb: float | None = None  # paged pool budget; None: DEFAULT_PAGED_MEMORY_MB
    page_size: int | None = None  # None: default_page_size()
    chunk_size: int = 32  # compressed: tokens per mean-pooled chunk
    prefix_cache_blocks: int | None = None  # paged, tiered: radix prefix cache of at most this many blocks
    tiered: TieredConfig | None = None  # tiered: the host RAM and disk levels; None: DEFAULT_TIERED_CONFIG
    attention: DenseAttention = "auto"  # tensor, flat: which attention implementation the rows use
    paged_attention: str | None = None  # paged, tiered: the paged_attention implementation; None: the platform's best

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in CACHE_KINDS:
            raise ConfigError(f"unknown cache kind {self.kind!r}; choose one of {', '.join(CACHE_KINDS)}")
        if self.kv_dtype is not None:
            kv_format(self.kv_dtype)  # ConfigError naming the known formats
        for name in ("page_size", "chunk_size"):
            value = getattr(self, name)
            if name == "page_size" and value is None:
                continue
            # A page or chunk is allocated whole per sequence: 2**16 tokens is far past any useful size.
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**16:
                raise ConfigError(f"{name} must be an integer in [1, 65536], got {value!r}")
        budget = self.max_memory_mb
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0
        ):
            raise ConfigError(f"max_memory_mb must be a finite positive number of MiB, got {budget!r}")
        blocks = self.prefix_cache_blocks
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0):
            raise ConfigError(f"prefix_cache capacity_blocks must be an integer >= 0, got {blocks!r}")
        if self.attention not in get_args(DenseAttention):
            raise ConfigError(f"unknown dense attention {self.attention!r}; choose one of {', '.join(get_args(DenseAttention))}")
        if self.paged_attention is not None and self.paged_attention not in PAGED_IMPLEMENTATIONS:
            raise ConfigError(
                f"unknown paged attention implementation {self.paged_attention!r}; choose one of {', '.join(PAGED_IMPLEMENTATIONS)} or None"
            )
        kind = self.resolved_kind
        if self.prefix_cache_blocks is not None and kind not in PAGED_KINDS:
            raise ConfigError(
                f"a prefix cache shares paged blocks and the {kind} cache has none: "
                "use it with the paged or tiered cache (paged_kv, tiered_kv)"
            )
        if self.tiered is not None and not isinstance(self.tiered, TieredConfig):
            raise ConfigError(f"tiered_kv takes a TieredConfig (zgen.cache.tiered), got {type(self.tiered).__name__}")
        if self.tiered is not None and kind != "tiered":
            raise ConfigError(
                f"a TieredConfig configures the tiered cache, not the {kind} one; drop it or make tiered_kv the last kind chosen"
            )
        if self.kv_dtype is not None and not kv_format(self.kv_dtype).plain and kind not in PAGED_KINDS:
            raise ConfigError(
                f"kv dtype {self.kv_dtype!r} is a page layout and the {kind} cache stores float rows "
                f"(fp32, bf16, fp16); use the paged or tiered cache for {self.kv_dtype}"
            )

    @property
    def resolved_page_size(self) -> int:
        return default_page_size() if self.page_size is None else self.page_size

    @property
    def resolved_kind(self) -> str:
        if self.kind is not None:
            return self.kind
        return "tensor" if self.kv_dtype is None or kv_format(self.kv_dtype).plain else "paged"


CacheOption = Callable[[CacheOptions], CacheOptions]


def cache_kind(kind: str) -> CacheOption:
    """Choose a kind by name (what ``--kv-cache`` does); see the module docstring."""
    if kind not in CACHE_KINDS:
        raise ConfigError(f"unknown cache kind {kind!r}; choose one of {', '.join(CACHE_KINDS)}")
    return lambda o: replace(o, kind=kind, tiered=o.tiered if kind == "tiered" else None)


def paged_kv(max_memory_mb: float = DEFAULT_PAGED_MEMORY_MB, page_size: int | None = None, attention: str | None = None) -> CacheOption:
    """Fixed-size blocks from a pool sized by a memory budget (the tiered cache's pool, if it was chosen);
    for a model split over devices the budget is their total (each holds its KV heads' share).
    ``page_size``: tokens per block (None: :func:`default_page_size`, 64 on GPUs and 16 elsewhere).

    ``attention`` forces a :func:`~zgen.pallas.paged_attention` implementation ("xla", "triton", ...;
    None: the platform's best); tests and benchmarks compare them, and on CPU "triton" runs the
    kernel interpreted."""
    return lambda o: replace(
        o, kind="tiered" if o.kind == "tiered" else "paged", max_memory_mb=max_memory_mb, page_size=page_size,
        paged_attention=attention,
    )


def flat_kv() -> CacheOption:
    """A dense row per sequence, pre-allocated to the model's context length."""
    return lambda o: replace(o, kind="flat")


def kv_dtype(dtype: str) -> CacheOption:
    """Storage format of K/V: fp32, bf16, fp16, fp8, q4 or q3 (:mod:`zgen.cache.formats`)."""
    return lambda o: replace(o, kv_dtype=dtype)


def compressed_kv(chunk_size: int = 32) -> CacheOption:
    """Chunk-wise mean pooling of older K/V, the most recent chunk kept exact (lossy)."""
    return lambda o: replace(o, kind="compressed", chunk_size=chunk_size)


def prefix_cache(capacity_blocks: int) -> CacheOption:
    """Radix prefix cache over paged blocks: shared prompt prefixes are prefilled once.

    Makes a cache with no kind chosen yet paged; with the tiered cache it bounds the device level.
    """
    return lambda o: replace(o, kind=o.kind or "paged", prefix_cache_blocks=capacity_blocks)


def tiered_kv(config: TieredConfig | None = None, max_memory_mb: float | None = None) -> CacheOption:
    """A paged cache with a prefix cache whose evicted blocks go to host RAM and disk, and come back.

    ``config`` (default :data:`DEFAULT_TIERED_CONFIG`, exact) sets the :class:`~zgen.cache.tiered.TieredKVStore`;
    a lossy ``warm_format`` ("float16", "int8") saves host RAM and disk but restored K/V differ slightly,
    so outputs may too, and it needs a float ``kv_dtype``. ``max_memory_mb`` is the device pool's budget
    (default: what ``paged_kv`` set, else :data:`DEFAULT_PAGED_MEMORY_MB`). Close the Generator or Engine
    (or let it be collected) to delete the store's files.
    """
    return lambda o: replace(
        o, kind="tiered", tiered=config, max_memory_mb=o.max_memory_mb if max_memory_mb is None else max_memory_mb
    )


def dense_attention(path: DenseAttention) -> CacheOption:
    """The attention implementation of the tensor and flat rows (``"auto"``: the flash kernels on a
    GPU; elsewhere the einsum for decode and the blocked XLA kernel for prefill chunks); tests and
    benchmarks compare them."""
    return lambda o: replace(o, attention=path)


def resolve(options: Sequence[CacheOption], base: CacheOptions | None = None) -> CacheOptions:
    """Apply ``options`` in order to ``base`` (default: no choices made), validating the result."""
    result = base or CacheOptions()
    for option in options:
        result = option(result)
    return replace(result)  # re-run validation on the combination


def make_kv(
    options: CacheOptions,
    config: ModelConfig,
    dtype: jnp.dtype,
    *,
    max_rows: int,
    max_write: int,
    key_calibration: Sequence[KeyCalibration] | None = None,
    mesh: Mesh | None = None,
) -> KVManager:
    """The KV manager ``options`` describe, for a model of ``config`` computing in ``dtype``.

    ``max_rows``: most sequences a slot kind holds at once; ``max_write``: most tokens one step writes
    per row (it sizes the compressed cache's raw ring). A coded format (q4, q3) needs the model's
    ``key_calibration`` (see :func:`zgen.runtime.calibration.key_calibration`). ``mesh``: a split
    model's devices (:attr:`zgen.model.Model.mesh`); the buffers are built split by KV heads over it.
    """
    c = config
    kind = options.resolved_kind
    storage = options.kv_dtype or kv_dtype_of(dtype)
    fmt = kv_format(storage, c.head_dim)
    if kind in PAGED_KINDS:
        if fmt.coded and key_calibration is None:
            raise ConfigError(f"kv dtype {storage!r} codes keys with the model's key calibration; pass key_calibration")
        paged = PagedConfig(
            c.num_layers, c.num_kv_heads, c.head_dim, options.resolved_page_size, storage, jnp.dtype(dtype).name,
            tuple(key_calibration) if fmt.coded and key_calibration is not None else None, options.paged_attention,
        )
        store = PageStore.with_budget(paged, options.max_memory_mb or DEFAULT_PAGED_MEMORY_MB, mesh)
        max_len = c.max_position_embeddings
        if kind == "tiered":
            return TieredKVManager(
                store, options.tiered or DEFAULT_TIERED_CONFIG, max_len=max_len, max_prefix_blocks=options.prefix_cache_blocks
            )
        return PagedKVManager(
            store, max_len=max_len, prefix_cache=options.prefix_cache_blocks is not None, max_prefix_blocks=options.prefix_cache_blocks
        )
    float_dtype = fmt.float_dtype
    assert float_dtype is not None  # CacheOptions refused page layouts for the row kinds
    shape = (c.num_layers, c.num_kv_heads, c.head_dim)
    if kind == "compressed":
        ring = next_pow2(max_write + options.chunk_size - 1)  # one write of max_write tokens fits the raw ring
        return SlotKVManager(
            kind,
            _on_devices(mesh, lambda rows, capacity: CompressedKVState.zeros(
                shape[0], rows, capacity, shape[1], shape[2], float_dtype, chunk_size=options.chunk_size, raw_slots=ring
            )),
            num_layers=c.num_layers, max_len=c.max_position_embeddings, max_slots=max_rows, capacity=c.max_position_embeddings,
        )
    return SlotKVManager(
        kind,
        _on_devices(mesh, lambda rows, capacity: DenseKVState.zeros(shape[0], rows, capacity, shape[1], shape[2], float_dtype, options.attention)),
        num_layers=c.num_layers, max_len=c.max_position_embeddings, max_slots=max_rows,
        capacity=c.max_position_embeddings if kind == "flat" else None,
    )


def _on_devices(mesh: Mesh | None, empty: Callable[[int, int], SlotState]) -> Callable[[int, int], SlotState]:
    """``empty(rows, capacity)``, building the state split by KV heads over ``mesh`` when there is one."""
    if mesh is None:
        return empty
    return lambda rows, capacity: state_split_by_heads(lambda: empty(rows, capacity), mesh)
