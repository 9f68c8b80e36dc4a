"""TieredKVStore: K/V blocks hot on the device, warm (compressed) in host RAM, cold on disk.

Keys are block ids (``int``) or ``(sequence, block)`` tuples — any hashable; values are
:class:`KVBlock` pairs of arrays of any shape (typically ``[block_size, kv_heads, head_dim]``).

- **hot**: device arrays (``jax.device_put``), returned as they are: exact.
- **warm**: numpy arrays in host RAM in ``TieredConfig.warm_format``: ``"exact"`` (the original
  dtype, lossless), ``"float16"`` (relative error at most 2**-11 for magnitudes in float16's normal
  range; values beyond ±65504 are refused when put) or ``"int8"`` (symmetric, one float32 scale per row
  of the last axis: error at most ``max|row| / 254``). See :func:`warm_error_bound`. Values read
  back come in their original dtype, which may round once more (e.g. bfloat16).
- **cold**: the warm representation saved with ``np.save``, one ``.npy`` file per part, in the cold
  directory; read back through ``np.load(mmap_mode="r")`` and copied into RAM. Moving between warm and
  cold is lossless, so a block is quantized at most once per trip down from hot.

Placement is by access counts: a new block enters hot; when a tier is over capacity its least-used
block (fewest accesses, then least recently used) moves one tier down. A block read
``promote_after`` times since it entered its tier moves one tier up. :meth:`TieredKVStore.prefetch`
loads blocks from disk on a thread pool and returns futures. The store is a context manager;
:meth:`TieredKVStore.close` waits for prefetches, deletes every file it wrote, and removes the cold
directory if the store created it (a directory it was given is left in place).

:class:`TieredKVManager` puts the store under a paged cache's radix prefix cache: blocks the device
pool evicts go to host RAM and disk, and come back for prompts that start with them (``tiered_kv`` in
:mod:`zgen.cache.factory`, ``--kv-cache tiered`` on the command line).
"""

from __future__ import annotations

import itertools
import math
import shutil
import tempfile
import threading
import uuid
import warnings
import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from zgen.cache.base import KVHandle
from zgen.cache.formats import kv_format
from zgen.cache.page_store import PageStore
from zgen.cache.paged_manager import PagedKVManager
from zgen.cache.radix import block_hashes
from zgen.errors import CacheError, ConfigError
from zgen.pallas.paged_attention.layouts import KVPages, float_pages, stored_like, take_pages
from zgen.shapes import next_pow2

Tier = Literal["hot", "warm", "cold"]
WarmFormat = Literal["exact", "float16", "int8"]
BlockKey = Hashable  # an int block id or a (sequence, block) tuple
_TIERS: tuple[Tier, ...] = ("hot", "warm", "cold")
_FLOAT16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class TieredConfig:
    """Capacities (in blocks) and policies of a :class:`TieredKVStore`."""

    hot_blocks: int = 64
    warm_blocks: int = 256
    warm_format: WarmFormat = "float16"
    promote_after: int = 2  # reads since entering a tier that move a block one tier up
    cold_dir: str | Path | None = None  # None: a fresh temporary directory, removed on close()
    prefetch_workers: int = 2

    def __post_init__(self) -> None:
        if self.hot_blocks < 1 or self.warm_blocks < 1:
            raise ConfigError(
                f"TieredConfig needs hot_blocks >= 1 and warm_blocks >= 1, got {self.hot_blocks} and "
                f"{self.warm_blocks}; the cold tier (disk) is the unbounded one"
            )
        if self.warm_format not in ("exact", "float16", "int8"):
            raise ConfigError(f"warm_format must be 'exact', 'float16' or 'int8', got {self.warm_format!r}")
        if self.promote_after < 1:
            raise ConfigError(f"promote_after must be >= 1, got {self.promote_after}")
        if self.prefetch_workers < 1:
            raise ConfigError(f"prefetch_workers must be >= 1, got {self.prefetch_workers}")


@dataclass(frozen=True)
class KVBlock:
    """One block's keys and values (any shape; the last axis is the head dimension)."""

    k: Float[Array, "..."]
    v: Float[Array, "..."]


@dataclass(frozen=True)
class TieredStats:
    """Counters since the store was opened."""

    hits_hot: int
    hits_warm: int
    hits_cold: int
    misses: int
    promotions: int
    demotions: int
    prefetched: int  # blocks a prefetch brought up from disk
    blocks: dict[str, int]  # blocks per tier now
    warm_bytes: int  # host RAM the warm tier holds

    @property
    def hits(self) -> int:
        return self.hits_hot + self.hits_warm + self.hits_cold


def warm_error_bound(x: np.ndarray, warm_format: WarmFormat) -> np.ndarray:
    """Largest ``|decoded - x|`` per element that a trip through the warm tier may cause (float32 inputs)."""
    x = np.asarray(x, np.float32)
    if warm_format == "exact":
        return np.zeros_like(x)
    if warm_format == "float16":
        # half an ulp of float16: 2**-11 relative in the normal range, 2**-25 absolute below it
        return np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    row_max = np.max(np.abs(x), axis=-1, keepdims=True)
    return np.broadcast_to(row_max / 254.0 * (1 + 1e-5) + 1e-12, x.shape)


# -- the warm representation -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Packed:
    """A block in host form: named numpy parts plus what is needed to decode them."""

    parts: dict[str, np.ndarray]
    dtype: np.dtype
    warm_format: WarmFormat

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())


def _encode_one(name: str, x: np.ndarray, warm_format: WarmFormat) -> dict[str, np.ndarray]:
    if warm_format == "exact":  # the bytes as they are, as an unsigned int of the same width (np.save-able)
        return {name: np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")}
    wide = x.astype(np.float32)
    if warm_format == "float16":
        return {name: wide.astype(np.float16)}
    row_max = np.max(np.abs(wide), axis=-1, keepdims=True)
    scale = np.where(row_max > 0, row_max / 127.0, 1.0).astype(np.float32)
    quantized = np.clip(np.rint(wide / scale), -127, 127).astype(np.int8)
    return {name: quantized, f"{name}_scale": scale}


def _decode_one(name: str, packed: _Packed) -> np.ndarray:
    data = packed.parts[name]
    if packed.warm_format == "exact":
        return data.view(packed.dtype)
    if packed.warm_format == "float16":
        return data.astype(np.float32).astype(packed.dtype)
    return (data.astype(np.float32) * packed.parts[f"{name}_scale"]).astype(packed.dtype)


def _pack(block: KVBlock, warm_format: WarmFormat) -> _Packed:
    k, v = np.asarray(block.k), np.asarray(block.v)
    return _Packed({**_encode_one("k", k, warm_format), **_encode_one("v", v, warm_format)}, k.dtype, warm_format)


def _unpack(packed: _Packed) -> KVBlock:
    return KVBlock(jax.device_put(_decode_one("k", packed)), jax.device_put(_decode_one("v", packed)))


# -- entries -------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    tier: Tier
    hot: KVBlock | None = None
    warm: _Packed | None = None
    cold: dict[str, Path] = field(default_factory=dict)  # part name -> file
    cold_meta: tuple[np.dtype, WarmFormat] | None = None
    reads: int = 0  # all reads: the demotion order
    reads_here: int = 0  # reads since entering this tier: the promotion trigger
    last_tick: int = 0
    version: int = 0  # bumped on every move, so a prefetch can tell its entry moved meanwhile


class TieredKVStore:
    """Blocks of K/V across device, host RAM and disk; thread-safe; a context manager."""

    def __init__(self, config: TieredConfig | None = None) -> None:
        self.config = config or TieredConfig()
        self._lock = threading.RLock()
        self._entries: dict[BlockKey, _Entry] = {}
        self._ticks = itertools.count(1)
        self._file_ids = itertools.count()
        self._prefix = f"zgen-kv-{uuid.uuid4().hex[:8]}"
        self._counters: dict[str, int] = dict.fromkeys(
            ("hits_hot", "hits_warm", "hits_cold", "misses", "promotions", "demotions", "prefetched"), 0
        )
        self._closed = False
        given = self.config.cold_dir
        self._finalizer: weakref.finalize | None = None
        if given is None:
            self.cold_dir = Path(tempfile.mkdtemp(prefix="zgen-cold-"))
            self._created_dir = True
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.cold_dir), True)
        else:
            self.cold_dir = Path(given)
            self._created_dir = not self.cold_dir.exists()
            try:
                self.cold_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CacheError(f"cannot use {self.cold_dir} as the cold directory ({exc}); pass a writable directory") from exc
        self._pool = ThreadPoolExecutor(self.config.prefetch_workers, thread_name_prefix="zgen-kv-prefetch")

    # -- context manager / lifetime ----------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Wait for prefetches, delete this store's files, remove the cold directory if it created it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for entry in self._entries.values():
                self._delete_files(entry)
            self._entries.clear()
        if self._finalizer is not None:
            self._finalizer()  # removes the temporary directory
        elif self._created_dir:
            try:
                self.cold_dir.rmdir()  # only if empty: never remove files someone else put there
            except OSError:
                pass

    @property
    def closed(self) -> bool:
        return self._closed

    # -- mapping surface ---------------------------------------------------------------------------

    def put(
        self, key: BlockKey, k: Float[Array, "..."], v: Float[Array, "..."], *, tier: Literal["hot", "warm"] = "hot"
    ) -> None:
        """Store a block in ``tier`` (replacing any block under ``key``); overflow moves down.

        ``tier="warm"`` packs it straight into host RAM: how a device cache spills what it evicts.
        """
        self._check_open()
        if tier not in ("hot", "warm"):
            raise CacheError(f"put places a block in 'hot' or 'warm', got {tier!r}; lower tiers fill by overflow")
        if self.config.warm_format == "float16":
            for name, x in (("k", k), ("v", v)):
                top = float(np.max(np.abs(np.asarray(x, np.float32)))) if np.size(x) else 0.0
                if not np.isfinite(top) or top > _FLOAT16_MAX:
                    raise CacheError(
                        f"block {key!r}: |{name}| reaches {top}, beyond float16's range (±{_FLOAT16_MAX}); "
                        "use TieredConfig(warm_format='int8' or 'exact') for such values"
                    )
        if tier == "hot":
            entry = _Entry("hot", hot=KVBlock(jax.device_put(k), jax.device_put(v)))
        else:
            entry = _Entry("warm", warm=_pack(KVBlock(k, v), self.config.warm_format))
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._delete_files(old)
            entry.last_tick = next(self._ticks)
            self._entries[key] = entry
            self._rebalance(keep=key)

    def get(self, key: BlockKey) -> KVBlock | None:
        """The block under ``key`` (None on a miss); counts a hit for its tier and may promote it."""
        self._check_open()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._counters["misses"] += 1
                return None
            self._counters[f"hits_{entry.tier}"] += 1
            entry.reads += 1
            entry.reads_here += 1
            entry.last_tick = next(self._ticks)
            block = self._read(entry)
            if entry.tier != "hot" and entry.reads_here >= self.config.promote_after:
                self._move_up(key, entry, block)
                self._rebalance(keep=key)
            return block

    def __getitem__(self, key: BlockKey) -> KVBlock:
        block = self.get(key)
        if block is None:
            raise KeyError(key)
        return block

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __iter__(self) -> Iterator[BlockKey]:
        with self._lock:
            return iter(list(self._entries))

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._entries)

    def tier_of(self, key: BlockKey) -> Tier | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.tier

    def evict(self, key: BlockKey) -> bool:
        """Forget ``key`` in every tier (deleting its files); False if it was not stored."""
        self._check_open()
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._delete_files(entry)
            entry.version += 1
            return True

    def promote(self, key: BlockKey) -> Tier:
        """Move ``key`` one tier up now (no-op in hot); returns its tier."""
        self._check_open()
        with self._lock:
            entry = self._require(key)
            if entry.tier != "hot":
                self._move_up(key, entry, self._read(entry))
                self._rebalance(keep=key)
            return entry.tier

    def demote(self, key: BlockKey) -> Tier:
        """Move ``key`` one tier down now (no-op in cold); returns its tier."""
        self._check_open()
        with self._lock:
            entry = self._require(key)
            if entry.tier != "cold":
                self._move_down(entry)
                self._rebalance(keep=key)
            return entry.tier

    def prefetch(self, keys: Iterable[BlockKey], *, to: Literal["warm", "hot"] = "warm") -> list[Future[KVBlock | None]]:
        """Start bringing ``keys`` up to tier ``to`` on the thread pool; one future per key.

        Disk reads happen off the calling thread. A future resolves to the block (None for a key not
        stored). Prefetching is not a read: it counts no hit and no promotion, only ``prefetched``.
        """
        self._check_open()
        if to not in ("warm", "hot"):
            raise CacheError(f"prefetch target must be 'warm' or 'hot', got {to!r}")
        return [self._pool.submit(self._prefetch_one, key, to) for key in keys]

    def stats(self) -> TieredStats:
        with self._lock:
            blocks = {tier: 0 for tier in _TIERS}
            warm_bytes = 0
            for entry in self._entries.values():
                blocks[entry.tier] += 1
                if entry.warm is not None:
                    warm_bytes += entry.warm.nbytes
            return TieredStats(**self._counters, blocks=blocks, warm_bytes=warm_bytes)

    def cold_files(self) -> list[Path]:
        """Files the cold tier holds now."""
        with self._lock:
            return sorted(path for entry in self._entries.values() for path in entry.cold.values())

    # -- internals (lock held) ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CacheError("this TieredKVStore is closed; open a new one (or use it inside its `with` block)")

    def _require(self, key: BlockKey) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise CacheError(f"no block {key!r} in the store; put it first")
        return entry

    def _read(self, entry: _Entry) -> KVBlock:
        if entry.tier == "hot":
            assert entry.hot is not None
            return entry.hot
        if entry.tier == "warm":
            assert entry.warm is not None
            return _unpack(entry.warm)
        return _unpack(self._load(entry))

    def _load(self, entry: _Entry) -> _Packed:
        assert entry.cold_meta is not None
        parts = {name: np.array(np.load(path, mmap_mode="r")) for name, path in entry.cold.items()}
        return _Packed(parts, *entry.cold_meta)

    def _move_up(self, key: BlockKey, entry: _Entry, block: KVBlock) -> None:
        del key
        if entry.tier == "cold":
            packed = self._load(entry)
            self._delete_files(entry)
            entry.tier, entry.warm = "warm", packed
        elif entry.tier == "warm":
            entry.tier, entry.hot, entry.warm = "hot", block, None
        entry.reads_here = 0
        entry.version += 1
        self._counters["promotions"] += 1

    def _move_down(self, entry: _Entry) -> None:
        if entry.tier == "hot":
            assert entry.hot is not None
            entry.tier, entry.warm, entry.hot = "warm", _pack(entry.hot, self.config.warm_format), None
        elif entry.tier == "warm":
            assert entry.warm is not None
            file_id = next(self._file_ids)
            paths: dict[str, Path] = {}
            try:
                for name, part in entry.warm.parts.items():
                    path = self.cold_dir / f"{self._prefix}-{file_id}.{name}.npy"
                    np.save(path, part, allow_pickle=False)
                    paths[name] = path
            except OSError as exc:
                for path in paths.values():
                    path.unlink(missing_ok=True)
                raise CacheError(f"cannot write the cold tier in {self.cold_dir} ({exc}); free disk space or pass another cold_dir") from exc
            entry.tier, entry.cold, entry.cold_meta = "cold", paths, (entry.warm.dtype, entry.warm.warm_format)
            entry.warm = None
        entry.reads_here = 0
        entry.version += 1
        self._counters["demotions"] += 1

    def _rebalance(self, keep: BlockKey) -> None:
        """Move least-used blocks down until hot and warm fit (never ``keep``, the block just placed)."""
        for tier, limit in (("hot", self.config.hot_blocks), ("warm", self.config.warm_blocks)):
            members = [(e.reads, e.last_tick, k) for k, e in self._entries.items() if e.tier == tier]
            excess = len(members) - limit
            if excess <= 0:
                continue
            members.sort(key=lambda m: (m[0], m[1]))
            victims = [k for _, _, k in members if k != keep][:excess]
            for victim in victims:
                self._move_down(self._entries[victim])

    def _delete_files(self, entry: _Entry) -> None:
        for path in entry.cold.values():
            path.unlink(missing_ok=True)
        entry.cold = {}

    def _prefetch_one(self, key: BlockKey, to: Literal["warm", "hot"]) -> KVBlock | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or self._closed:
                return None
            if entry.tier != "cold":
                block = self._read(entry)
                if to == "hot" and entry.tier == "warm":
                    self._move_up(key, entry, block)
                    self._counters["prefetched"] += 1
                    self._rebalance(keep=key)
                return block
            files, meta, version = dict(entry.cold), entry.cold_meta, entry.version
        assert meta is not None
        try:  # the disk read, outside the lock
            packed = _Packed({name: np.array(np.load(path, mmap_mode="r")) for name, path in files.items()}, *meta)
        except OSError:
            packed = None  # the block moved or was evicted meanwhile: read it again under the lock
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if packed is None or entry.version != version:
                return self._read(entry)
            self._delete_files(entry)
            entry.tier, entry.warm, entry.reads_here = "warm", packed, 0
            entry.version += 1
            self._counters["prefetched"] += 1
            block = _unpack(packed)
            if to == "hot":
                self._move_up(key, entry, block)
            self._rebalance(keep=key)
            return block


# -- the tiers under a paged prefix cache -----------------------------------------------------------


class TieredKVManager(PagedKVManager):
    """A :class:`~zgen.cache.paged_manager.PagedKVManager` whose prefix cache goes on below the device pool.

    When the radix prefix cache evicts a block, its pages (every layer, K and V, in the pool's storage
    format) are put into a :class:`TieredKVStore`'s warm tier under the block's chained token hash,
    instead of being dropped; the store moves them between host RAM and disk by its own policy (and
    up to a device-resident hot copy when they are read often). When a sequence's prefix misses on the
    device but is in the store, :meth:`match_prefix` takes fresh blocks, copies the pages in (cold
    blocks are read from disk on the store's threads while the blocks are found) and inserts them into
    the radix tree: the sequence skips their prefill, as on a device hit.

    The store keeps a restored block's copy, so evicting it again copies nothing. The warm format
    decides fidelity: ``"exact"`` gives back the evicted bits, so outputs equal a prefill's;
    ``"float16"``/``"int8"`` shrink host RAM and disk but restored K/V differ by up to
    :func:`warm_error_bound` (so may the tokens that follow), and they need a float pool (a quantized
    ``kv_dtype`` is already compressed: quantizing its bytes again would corrupt them).
    :meth:`close` (also run when the manager is garbage collected) closes the store, deleting its
    files and the temporary cold directory.
    """

    def __init__(self, store: PageStore, tiers: TieredConfig, *, max_len: int, max_prefix_blocks: int | None = None) -> None:
        super().__init__(store, max_len=max_len, prefix_cache=True, max_prefix_blocks=max_prefix_blocks)
        if not kv_format(store.config.kv_dtype).plain and tiers.warm_format != "exact":
            raise ConfigError(
                f"warm_format {tiers.warm_format!r} would quantize the bytes of kv_dtype {store.config.kv_dtype!r} pages; "
                "use TieredConfig(warm_format='exact') with a quantized kv_dtype"
            )
        self.tiers = TieredKVStore(tiers)
        assert self.radix is not None
        # A function of the store and tiers, not a method: the manager stays out of a reference cycle, so
        # dropping it runs the finalizer below at once.
        self.radix.on_evict = partial(_demote, self.store, self.tiers)
        self._close_tiers = weakref.finalize(self, self.tiers.close)

    @property
    def kind(self) -> str:
        return "tiered"

    def close(self) -> None:
        """Close the tiered store (its files and temporary directory go); the manager is unusable after."""
        self._close_tiers()

    def match_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> int:
        if self.tiers.closed:
            raise CacheError("this tiered KV cache was closed; create a new Generator or Engine to generate again")
        return super().match_prefix(handle, tokens)

    def _restore_prefix(self, tokens: Sequence[int], cached: list[int]) -> list[int]:
        assert self.radix is not None
        ps = self.page_size
        keys = list(itertools.takewhile(lambda key: key in self.tiers, block_hashes(tokens, ps)[len(cached) :]))
        if not keys:
            return []
        # Disk reads run on the store's threads while blocks are found (which may evict and demote others).
        loading = self.tiers.prefetch([key for key in keys if self.tiers.tier_of(key) == "cold"])
        fresh = self.pool.allocate(len(keys))
        try:
            wait(loading)
            blocks = [self.tiers[key] for key in keys]  # counts the tier hits
            slots = next_pow2(len(keys))
            pad = ((0, slots - len(keys)),) + ((0, 0),) * (blocks[0].k.ndim)
            dst = np.full(slots, self.pool.num_blocks, np.int32)  # padding slots write nowhere
            dst[: len(keys)] = fresh
            self.store.k, self.store.v = _write_blocks(
                self.store.k,
                self.store.v,
                jnp.pad(jnp.stack([b.k for b in blocks]), pad),
                jnp.pad(jnp.stack([b.v for b in blocks]), pad),
                jnp.asarray(dst),
            )
        except BaseException:
            self.pool.free(fresh)
            raise
        for block in fresh:
            self.pool.mark_filled(block, ps)
        self.radix.insert(list(tokens[: (len(cached) + len(keys)) * ps]), [*cached, *fresh])
        return fresh


def _demote(store: PageStore, tiers: TieredKVStore, evicted: list[tuple[bytes, int]]) -> None:
    """Copy the pages of blocks the prefix cache evicts into the warm tier (the tree's ``on_evict``)."""
    new = [(key, block) for key, block in evicted if key not in tiers]  # a restored block's copy is still there
    pages = jax.tree_util.tree_leaves((store.k, store.v))
    if not new or tiers.closed or any(leaf.is_deleted() for leaf in pages):
        return  # nothing new, nowhere to put it, or the pages were donated to a plan and are gone
    ids = np.zeros(next_pow2(len(new)), np.int32)  # padding slots read block 0 and are dropped
    ids[: len(new)] = [block for _, block in new]
    k, v = jax.device_get(_read_blocks(store.k, store.v, jnp.asarray(ids)))
    for i, (key, _) in enumerate(new):
        try:
            tiers.put(key, k[i].copy(), v[i].copy(), tier="warm")  # copies: a view would pin the whole batch
        except CacheError as err:  # a value float16 cannot hold, a full disk: the block is dropped, as without tiers
            warnings.warn(f"an evicted KV block was dropped instead of kept in the tiered store: {err}", RuntimeWarning, stacklevel=2)


# A block's payload is ``[num_layers, kv_heads, page_size, X]`` per K and V: a float pool's values as
# they are (X = head_dim, so lossy warm formats scale per token and head), a quantized pool's leaves
# as raw bytes side by side (X = bytes per token and head).


def _payload(pages: KVPages, blocks: Array) -> Array:
    taken = float_pages(take_pages(pages, blocks))  # a CPU pool's integer containers: back to floats
    leaves = [jnp.moveaxis(leaf, 1, 0) for leaf in jax.tree_util.tree_leaves(taken)]
    if isinstance(taken, jax.Array):
        return leaves[0]
    return jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(*x.shape[:3], -1) for x in leaves], -1)


def _fill(pages: KVPages, payload: Array, blocks: Array) -> KVPages:
    layout = jax.eval_shape(float_pages, pages)
    leaves, treedef = jax.tree_util.tree_flatten(layout)
    if isinstance(layout, jax.ShapeDtypeStruct):
        values = [payload.astype(layout.dtype)]
    else:
        values, offset = [], 0
        for leaf in leaves:
            trailing, itemsize = leaf.shape[3:], leaf.dtype.itemsize
            width = math.prod(trailing) * itemsize
            raw = payload[..., offset : offset + width].reshape(*payload.shape[:3], *trailing, *((itemsize,) if itemsize > 1 else ()))
            values.append(jax.lax.bitcast_convert_type(raw, leaf.dtype))
            offset += width
    new = stored_like(pages, jax.tree_util.tree_unflatten(treedef, [jnp.moveaxis(x, 0, 1) for x in values]))
    return jax.tree_util.tree_map(lambda leaf, x: leaf.at[:, blocks].set(x, mode="drop"), pages, new)


@jax.jit
def _read_blocks(k: tuple[KVPages, ...], v: tuple[KVPages, ...], blocks: Array) -> tuple[Array, Array]:
    """Payloads ``[len(blocks), num_layers, kv_heads, page_size, X]`` of K and V."""
    return jnp.stack([_payload(p, blocks) for p in k], 1), jnp.stack([_payload(p, blocks) for p in v], 1)


@partial(jax.jit, donate_argnums=(0, 1))
def _write_blocks(
    k: tuple[KVPages, ...], v: tuple[KVPages, ...], k_payload: Array, v_payload: Array, blocks: Array
) -> tuple[tuple[KVPages, ...], tuple[KVPages, ...]]:
    """Pages with ``blocks[i]`` holding payload ``i`` in every layer (out-of-range blocks are skipped)."""
    return (
        tuple(_fill(p, k_payload[:, layer], blocks) for layer, p in enumerate(k)),
        tuple(_fill(p, v_payload[:, layer], blocks) for layer, p in enumerate(v)),
    )


__all__ = [
    "BlockKey",
    "KVBlock",
    "TieredConfig",
    "TieredKVManager",
    "TieredKVStore",
    "TieredStats",
    "warm_error_bound",
]
