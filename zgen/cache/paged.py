"""PagedKVCache: the host handle of one sequence (or a batch sharing one length) on a shared page pool.

Blocks are taken from the pool as the sequence grows, shared by :meth:`PagedKVCache.fork` (reference
counts and a table copy, no page copied) and copied on write; :meth:`PagedKVCache.truncate` keeps
the first ``n`` tokens bit-exactly and frees the blocks past them. The pages themselves live in the
:class:`~zgen.cache.page_store.PageStore`; the device state a compiled step runs on is
:class:`~zgen.cache.paged_state.PagedKVState`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jaxtyping import Array, Float

from zgen.cache.base import LayerKV
from zgen.cache.block_pool import BlockPool, blocks_for
from zgen.cache.page_store import PagedConfig, PageStore
from zgen.cache.paged_state import PagedKVState
from zgen.errors import CacheError, ConfigError


class PagedKVCache:
    """Host handle (``CacheProvider``) of a paged cache: one shared length for the batch, blocks on demand.

    Blocks are taken from the store's pool as the sequences grow (all rows at once, all-or-nothing),
    shared by :meth:`fork` (O(pages) of metadata: reference counts and a table copy) and copied on
    write: a write into a block with other owners first moves this cache to a private copy (only the
    block holding the current end can be partly filled, so at most one copy per row). :meth:`truncate`
    keeps the first ``n`` tokens bit-exactly and frees the blocks past them.
    """

    def __init__(self, store: PageStore, batch: int, max_seq_len: int) -> None:
        if batch <= 0 or max_seq_len <= 0:
            raise ConfigError(f"batch ({batch}) and max_seq_len ({max_seq_len}) must be positive")
        self._store = store
        self._batch = batch
        self._table = np.full((batch, blocks_for(max_seq_len, store.config.page_size)), -1, np.int32)
        self._seq_len = 0
        self._released = False

    @classmethod
    def create(
        cls,
        num_layers: int,
        batch: int,
        max_seq_len: int,
        kv_heads: int,
        head_dim: int,
        *,
        page_size: int = 16,
        kv_dtype: str = "fp32",
        num_blocks: int | None = None,
        max_memory_mb: float | None = None,
        dtype: str = "float32",
    ) -> PagedKVCache:
        """A cache on a fresh pool of ``num_blocks`` blocks, or as many as ``max_memory_mb`` holds
        (default: exactly enough for ``batch`` sequences of ``max_seq_len``)."""
        config = PagedConfig(num_layers, kv_heads, head_dim, page_size, kv_dtype, dtype)
        if max_memory_mb is not None:
            return cls(PageStore.with_budget(config, max_memory_mb), batch, max_seq_len)
        pool = BlockPool(num_blocks or batch * blocks_for(max_seq_len, page_size), page_size)
        return cls(PageStore(config, pool), batch, max_seq_len)

    # -- CacheProvider surface ------------------------------------------------------------------

    @property
    def state(self) -> PagedKVState:
        """The device state over this cache's block table (the store's current pages)."""
        self._store.ensure_available()
        return self._store.state(self._table)

    @property
    def num_layers(self) -> int:
        return self._store.config.num_layers

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def capacity(self) -> int:
        return self._table.shape[1] * self._store.config.page_size

    @property
    def store(self) -> PageStore:
        return self._store

    @property
    def pool(self) -> BlockPool:
        return self._store.pool

    @property
    def block_table(self) -> np.ndarray:
        """A copy of the ``[batch, pages_per_seq]`` table (``-1`` = no block)."""
        return self._table.copy()

    def owned_blocks(self) -> list[int]:
        """Every block this cache holds a reference on (one per table entry)."""
        return [int(b) for b in self._table[self._table >= 0]]

    def update(self, layer: int, k: Float[Array, "B T KVH D"], v: Float[Array, "B T KVH D"]) -> None:
        """Append K/V for ``layer`` at the current end; the length advances after the last layer."""
        self._check_live()
        c = self._store.config
        if not 0 <= layer < c.num_layers:
            raise CacheError(f"layer {layer} outside [0, {c.num_layers})")
        expected = (self._batch, k.shape[1], c.kv_heads, c.head_dim)
        if k.ndim != 4 or tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise CacheError(
                f"update takes k and v shaped [batch={self._batch}, new, kv_heads={c.kv_heads}, head_dim={c.head_dim}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        n = k.shape[1]
        start, end = self._seq_len, self._seq_len + n
        if end > self.capacity:
            raise CacheError(
                f"cannot append {n} tokens to a cache holding {start} of {self.capacity}; "
                "create the cache with a larger max_seq_len"
            )
        if n == 0:
            return
        self._make_writable(start, end)
        positions = np.broadcast_to(np.arange(start, end, dtype=np.int32), (self._batch, n))
        self._store.write(layer, k, v, self._table, positions)
        if layer == c.num_layers - 1:
            self._seq_len = end

    def get(self, layer: int) -> LayerKV:
        """K/V of ``layer`` for positions ``[0, seq_len)``, dequantized to the config's view dtype."""
        self._check_live()
        if not 0 <= layer < self.num_layers:
            raise CacheError(f"layer {layer} outside [0, {self.num_layers})")
        k, v = self._store.view(layer, self._table)
        return LayerKV(k[:, : self._seq_len], v[:, : self._seq_len])

    def reset(self) -> None:
        """Forget every token and give all blocks back (to the pool, or to their other owners)."""
        owned = self.owned_blocks()
        self._table[:] = -1
        self._seq_len = 0
        self._store.pool.free(owned)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens exactly; blocks wholly past them are freed."""
        self._check_live()
        if not 0 <= n <= self._seq_len:
            raise CacheError(f"cannot truncate a cache of {self._seq_len} tokens to {n}; n must be in [0, seq_len]")
        keep = blocks_for(n, self._store.config.page_size)
        dropped = self._table[:, keep:]
        freed = [int(b) for b in dropped[dropped >= 0]]
        self._table[:, keep:] = -1
        self._seq_len = n
        self._store.pool.free(freed)
        self._mark_filled()

    def fork(self) -> PagedKVCache:
        """A second cache over the same tokens: shares every block (reference counts), copies nothing."""
        self._check_live()
        twin = PagedKVCache.__new__(PagedKVCache)
        twin._store, twin._batch, twin._seq_len, twin._released = self._store, self._batch, self._seq_len, False
        twin._table = self._table.copy()
        self._store.pool.share(self.owned_blocks())
        return twin

    def release(self) -> None:
        """Give every block back and make this handle unusable (``reset`` keeps it usable)."""
        if not self._released:
            self.reset()
            self._released = True

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more tokens in every row and count them as stored.

        For writers that fill the pages themselves (an engine's compiled step writes through
        :attr:`state`): blocks are allocated all-or-nothing and shared blocks copied on write, exactly
        as :meth:`update` does; follow with :meth:`truncate` if fewer tokens were written.
        """
        self._check_live()
        start, end = self._seq_len, self._seq_len + n
        if n < 0 or end > self.capacity:
            raise CacheError(f"cannot reserve {n} tokens after {start} in a cache of capacity {self.capacity}")
        self._make_writable(start, end)
        self._seq_len = end

    def drop_blocks(self, indices: Sequence[int]) -> int:
        """Give back the blocks at table positions ``indices`` (in every row); their entries become -1.

        The tokens they held are gone: the caller must keep them out of attention (a page mask).
        Returns how many table entries were dropped.
        """
        self._check_live()
        if any(not 0 <= i < self._table.shape[1] for i in indices):
            raise CacheError(f"block indices {list(indices)} outside [0, {self._table.shape[1]})")
        entries = self._table[:, list(indices)]
        held = [int(b) for b in entries[entries >= 0]]
        self._table[:, list(indices)] = -1
        self._store.pool.free(held)
        return len(held)

    def inject_blocks(self, blocks: Sequence[Sequence[int]], n_tokens: int) -> None:
        """Start from cached blocks: row ``r`` reads ``blocks[r]`` (shared, not copied) for ``n_tokens`` tokens.

        The cache must be empty. Every row needs ``ceil(n_tokens / page_size)`` blocks (the length is
        shared by the batch); a partly used last block is copied on the first write into it. A ``-1``
        entry stands for a dropped block (see :meth:`drop_blocks`).
        """
        self._check_live()
        ps = self._store.config.page_size
        if self._seq_len or (self._table >= 0).any():
            raise CacheError("inject_blocks needs an empty cache; call reset() first")
        need = blocks_for(n_tokens, ps)
        if len(blocks) != self._batch or any(len(row) != need for row in blocks):
            raise CacheError(
                f"inject_blocks needs {self._batch} rows of ceil({n_tokens}/{ps}) = {need} blocks, "
                f"got rows of {[len(r) for r in blocks]}"
            )
        if n_tokens > self.capacity:
            raise CacheError(f"{n_tokens} tokens do not fit this cache's capacity {self.capacity}")
        flat = [int(b) for row in blocks for b in row if b >= 0]  # -1: a dropped (masked) block
        self._store.pool.share(flat)  # raises (and changes nothing) on a free or foreign block
        for r, row in enumerate(blocks):
            self._table[r, :need] = row
        self._seq_len = n_tokens

    # -- internals ----------------------------------------------------------------------------------

    def _check_live(self) -> None:
        if self._released:
            raise CacheError("this PagedKVCache was released; create or fork a new one")

    def _make_writable(self, start: int, end: int) -> None:
        """Give this cache private blocks for positions ``[start, end)`` in every row, all-or-nothing."""
        pool, ps = self._store.pool, self._store.config.page_size
        first, last = start // ps, blocks_for(end, ps)
        need: list[tuple[int, int, int]] = []  # (row, index, old block or -1)
        for r in range(self._batch):
            for i in range(first, last):
                b = int(self._table[r, i])
                if b < 0 or pool.refcount(b) > 1:
                    need.append((r, i, b))
        if not need:
            return
        fresh = pool.allocate(len(need))  # PoolExhaustedError here leaves everything as it was
        src, dst, old = [], [], []
        for (r, i, b), f in zip(need, fresh, strict=True):
            if b >= 0:
                old.append(b)
                if i * ps < start:  # the block holds kept tokens: copy them over
                    src.append(b)
                    dst.append(f)
                    pool.mark_filled(f, start - i * ps)
            self._table[r, i] = f
        self._store.copy_pages(src, dst, width=self._batch)
        pool.free(old)
        for i in range(first, last):
            for r in range(self._batch):
                pool.mark_filled(int(self._table[r, i]), min(ps, end - i * ps))

    def _mark_filled(self) -> None:
        pool, ps = self._store.pool, self._store.config.page_size
        last = blocks_for(self._seq_len, ps) - 1
        if last >= 0:
            for b in self._table[:, last]:
                if b >= 0 and pool.refcount(int(b)) == 1:
                    pool.mark_filled(int(b), self._seq_len - last * ps)
