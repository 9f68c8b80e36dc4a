"""Paged caches: sequences as chains of pages in one shared pool, with a radix prefix cache.

The ``paged`` kind (and ``tiered``, :mod:`zgen.cache.tiered`, which adds host RAM and disk below the
prefix cache). Each sequence's handle is a :class:`~zgen.cache.paged.PagedKVCache` over the shared
:class:`~zgen.cache.page_store.PageStore`: pages are taken as the sequence grows, shared by forks and
by the prefix cache (reference counts, copy-on-write), and given back on release. A step's state is
the whole pool with one block-table row per batch row (and, for contexts that mask tokens, the masks:
:class:`~zgen.cache.paged_state.MaskedPagedState`).

With a prefix cache (:class:`~zgen.cache.radix.RadixCache`), a new sequence starts from the cached
pages of its longest cached prefix of whole pages (:meth:`PagedKVManager.match_prefix`) and offers its
own full pages when it is done (:meth:`PagedKVManager.commit_prefix`); the pool reclaims unused
cached pages when it runs short.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from zgen.cache.base import KVHandle, KVState, StepRow
from zgen.cache.block_pool import BlockPool, blocks_for
from zgen.cache.page_store import PageStore
from zgen.cache.paged import PagedKVCache
from zgen.cache.paged_state import MaskedPagedState, PagedKVState
from zgen.cache.radix import RadixCache
from zgen.errors import CacheError
from zgen.shapes import next_pow2


class PagedKVManager:
    """Sequences on a shared page pool (see the module docstring)."""

    pages = True

    def __init__(self, store: PageStore, *, max_len: int, prefix_cache: bool = False, max_prefix_blocks: int | None = None) -> None:
        self.store = store
        self.max_len = max_len
        self.radix: RadixCache | None = RadixCache(store.pool, max_blocks=max_prefix_blocks) if prefix_cache else None
        # Block tables never narrow: every width is a compiled shape of each step (compiles take seconds
        # for a large model), and a table wider than the rows need costs only its unread entries.
        self._table_width = 8
        if self.radix is not None:
            store.pool.reclaim = self.radix.reclaim

    @property
    def kind(self) -> str:
        return "paged"

    @property
    def pool(self) -> BlockPool:
        return self.store.pool

    @property
    def page_size(self) -> int:
        return self.store.config.page_size

    def new_handle(self) -> PagedKVCache:
        return PagedKVCache(self.store, 1, self.max_len)

    def layout(self, handles: Sequence[KVHandle]) -> tuple[int, list[int]]:
        return next_pow2(len(handles)), list(range(len(handles)))

    def step_state(self, rows: Sequence[StepRow], width: int, tokens: int) -> PagedKVState | MaskedPagedState:
        ps = self.page_size
        pages = max(next_pow2(max(blocks_for(row.handle.seq_len, ps) for row in rows)), self._table_width)
        self._table_width = pages
        tables = np.full((width, pages), -1, np.int32)
        for i, row in enumerate(rows):
            table = _paged(row.handle).block_table[0, :pages]
            tables[i, : len(table)] = table
        state = self.store.state(tables)
        if all(row.masked is None and row.attention is None for row in rows):
            return state
        return _masked(state, rows, tables, tokens)

    def absorb(self, state: KVState) -> None:
        self.store.absorb(state.pages if isinstance(state, MaskedPagedState) else state)  # type: ignore[arg-type]

    def expect(self, tokens: int) -> None:
        # Pages are taken as tokens come, but the tables take the width the sequence will need now: its
        # prefill, its decode loops and the next request of that length run one compiled shape.
        blocks = blocks_for(min(tokens, self.max_len), self.page_size)
        self._table_width = max(self._table_width, next_pow2(blocks))

    def match_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> int:
        cache = _paged(handle)
        if self.radix is None or len(tokens) < 2:
            return 0
        if cache.seq_len:
            raise CacheError("a prefix is matched into an empty sequence only")
        usable = list(tokens[: min(len(tokens) - 1, cache.capacity)])  # the last token is fed for its logits
        blocks, _ = self.radix.match(usable)
        self.pool.share(blocks)  # held while lower levels restore more (which may evict)
        restored: list[int] = []
        try:
            restored = self._restore_prefix(usable, blocks)
            chain = blocks + restored
            if chain:
                cache.inject_blocks([chain], len(chain) * self.page_size)
        finally:
            self.pool.free(blocks + restored)  # the handle and the tree hold their own references
        return len(chain) * self.page_size

    def commit_prefix(self, handle: KVHandle, tokens: Sequence[int]) -> None:
        if self.radix is None:
            return
        cache = _paged(handle)
        table = cache.block_table[0]
        n = min(len(tokens), cache.seq_len) // self.page_size
        present = int(np.argmin(table[:n] >= 0)) if (table[:n] < 0).any() else n  # stop at a dropped page
        for block in table[:present]:
            self.pool.mark_filled(int(block), self.page_size)
        self.radix.insert(list(tokens[: present * self.page_size]), [int(b) for b in table[:present]])

    def close(self) -> None:
        pass

    def _restore_prefix(self, tokens: Sequence[int], cached: list[int]) -> list[int]:
        """Blocks continuing ``cached`` (the device prefix-cache hit on ``tokens``) that a lower level
        brings back: freshly allocated, owned by the caller, already in the prefix cache. None here:
        the device pool is this manager's only level."""
        del tokens, cached
        return []


def _paged(handle: KVHandle) -> PagedKVCache:
    if not isinstance(handle, PagedKVCache):
        raise CacheError(f"a paged cache got a {type(handle).__name__} handle; handles stay with the manager that made them")
    return handle


def _masked(state: PagedKVState, rows: Sequence[StepRow], tables: np.ndarray, tokens: int) -> MaskedPagedState:
    """The rows' token masks and attention overrides as the masks :class:`MaskedPagedState` reads."""
    width, pages = tables.shape
    ps = state.page_size
    visible = np.ones((width, pages * ps), bool)
    used = np.zeros((width, pages), bool)
    for i, row in enumerate(rows):
        if row.masked is not None:
            visible[i, row.masked[row.masked < pages * ps]] = False
        used[i, : blocks_for(row.start + row.count, ps)] = True
    token_pages = visible.reshape(width, pages, ps)
    readable = (tables >= 0) & token_pages.any(axis=2)
    cut_pages = used & token_pages.any(axis=2) & ~token_pages.all(axis=2)
    page_mask = None if readable[used].all() else jax.device_put(readable)
    token_mask = jax.device_put(visible) if cut_pages.any() else None
    query_mask = None
    if any(row.attention is not None for row in rows):
        query = np.zeros((width, tokens, pages * ps), bool)
        for i, row in enumerate(rows):
            if row.attention is not None:
                query[i, : row.count, : row.attention.shape[1]] = row.attention
            else:
                positions = np.arange(row.start, row.start + row.count)
                query[i, : row.count] = np.arange(pages * ps)[None, :] <= positions[:, None]
        query_mask = jax.device_put(query)
    return MaskedPagedState(state, page_mask, token_mask, query_mask)
