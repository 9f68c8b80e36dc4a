"""BlockPool: the host-side free list and reference counts of a paged KV cache's fixed-size blocks.

A block (a "page") holds ``page_size`` consecutive token slots of one sequence, for every layer, K and
V. The pool only does bookkeeping — which block ids are free, how many owners each used block has, how
many of its slots hold tokens — the device arrays live in :class:`~zgen.cache.page_store.PageStore`.

Rules every caller relies on (and the property tests check):

* ``allocate(n)`` is all-or-nothing: it returns ``n`` fresh ids with reference count 1, or raises
  :class:`~zgen.errors.PoolExhaustedError` and changes nothing.
* ``share`` adds an owner (fork, prefix reuse); ``free`` drops one; a block returns to the free list
  exactly when its last owner drops it. Freeing a block that is not in use is an error and changes
  nothing (no double free).
* ``num_free + num_used == num_blocks`` always.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from zgen.errors import CacheError, ConfigError, PoolExhaustedError


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's occupancy."""

    num_blocks: int
    num_free: int
    num_used: int
    shared_blocks: int  # used blocks with more than one owner
    filled_slots: int  # token slots holding tokens, over used blocks (a shared block counts once)
    fragmentation_ratio: float


class BlockPool:
    """Free list plus reference counts over ``num_blocks`` blocks of ``page_size`` token slots."""

    def __init__(self, num_blocks: int, page_size: int) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"a block pool needs at least one block, got num_blocks={num_blocks}")
        if page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {page_size}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._refcount = np.zeros(num_blocks, np.int32)
        self._filled = np.zeros(num_blocks, np.int32)
        # Pop from the end: low ids are handed out first, which keeps tests and dumps readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Frees up to n blocks held only by a cache of this pool (a prefix cache); asked when short.
        self.reclaim: Callable[[int], int] | None = None

    # Host bytes per block: a refcount, a fill count and a slot in the free list (a boxed int).
    HOST_BYTES_PER_BLOCK = 2 * 4 + 8 + 32

    @staticmethod
    def blocks_in_budget(max_memory_mb: float, block_bytes: int, page_size: int) -> int:
        """How many blocks of ``block_bytes`` (K and V pages of every layer) fit ``max_memory_mb`` MiB.

        ``block_bytes`` comes from the real page arrays (:meth:`PagedConfig.bytes_per_token
        <zgen.cache.page_store.PagedConfig.bytes_per_token>` x ``page_size``), so quantized formats
        really get more blocks.
        """
        if not (isinstance(max_memory_mb, (int, float)) and not isinstance(max_memory_mb, bool) and max_memory_mb > 0):
            raise ConfigError(f"max_memory_mb must be a positive number, got {max_memory_mb!r}")
        budget_bytes = max_memory_mb * 2**20
        if not math.isfinite(budget_bytes):
            raise ConfigError(f"max_memory_mb must be a finite number of MiB, got {max_memory_mb!r}")
        num_blocks = int(budget_bytes // block_bytes)
        if num_blocks < 1:
            raise ConfigError(
                f"max_memory_mb={max_memory_mb} holds no block: one block of {page_size} tokens takes "
                f"{block_bytes} bytes; raise the budget or lower page_size"
            )
        return num_blocks

    # -- queries ----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return int(np.count_nonzero(self._refcount))

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return int(self._refcount[block])

    def refcounts(self) -> np.ndarray:
        """A copy of every block's reference count (0 = free)."""
        return self._refcount.copy()

    def filled(self, block: int) -> int:
        self._check_id(block)
        return int(self._filled[block])

    def free_blocks(self) -> list[int]:
        return sorted(self._free)

    @property
    def fragmentation_ratio(self) -> float:
        """Share of the used blocks' token slots that hold no token (internal fragmentation), in [0, 1].

        Fixed-size blocks have no external fragmentation; what is lost is the unfilled tail of each
        sequence's last block (a slot reserved for a token a step will write counts as filled).
        0.0 for an empty pool.
        """
        used = self._refcount > 0
        slots = int(np.count_nonzero(used)) * self.page_size
        if slots == 0:
            return 0.0
        return 1.0 - float(np.sum(self._filled[used])) / slots

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.num_blocks,
            num_free=self.num_free,
            num_used=self.num_used,
            shared_blocks=int(np.count_nonzero(self._refcount > 1)),
            filled_slots=int(np.sum(self._filled[self._refcount > 0])),
            fragmentation_ratio=self.fragmentation_ratio,
        )

    # -- mutations --------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (reference count 1, no slot filled), or PoolExhaustedError and no change.

        When short, :attr:`reclaim` (if set) is asked to free the difference first, and only if it can.
        """
        if n < 0:
            raise CacheError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(n - len(self._free))
        if n > len(self._free):
            raise PoolExhaustedError(
                f"the KV block pool needs {n} free blocks but has {len(self._free)} of {self.num_blocks} "
                f"(page_size {self.page_size}); release finished sequences, evict prefix-cache entries, "
                "or build the pool with a larger memory budget"
            )
        blocks = [self._free.pop() for _ in range(n)]
        self._refcount[blocks] = 1
        self._filled[blocks] = 0
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add one owner to each (used) block; all-or-nothing."""
        ids = list(blocks)
        for b in ids:
            self._check_id(b)
            if self._refcount[b] <= 0:
                raise CacheError(f"block {b} is free; only a block in use can be shared (was it already released?)")
        for b in ids:
            self._refcount[b] += 1

    def free(self, blocks: Iterable[int]) -> list[int]:
        """Drop one owner of each block; returns the blocks that went back to the free list.

        All-or-nothing: if any block would drop below zero owners (a double free), nothing changes.
        A block listed twice drops two owners.
        """
        ids = list(blocks)
        drops: dict[int, int] = {}
        for b in ids:
            self._check_id(b)
            drops[b] = drops.get(b, 0) + 1
        for b, k in drops.items():
            if self._refcount[b] < k:
                raise CacheError(
                    f"block {b} has {int(self._refcount[b])} owner(s) but {k} release(s) were asked: a double free "
                    "(a block list released twice, or a state released after its cache was reset)"
                )
        released: list[int] = []
        for b, k in drops.items():
            self._refcount[b] -= k
            if self._refcount[b] == 0:
                self._filled[b] = 0
                self._free.append(b)
                released.append(b)
        return released

    def mark_filled(self, block: int, slots: int) -> None:
        """Record that ``slots`` (0..page_size) leading slots of ``block`` hold tokens (for fragmentation)."""
        self._check_id(block)
        if not 0 <= slots <= self.page_size:
            raise CacheError(f"a block holds 0..{self.page_size} tokens, got {slots}")
        self._filled[block] = slots

    def check_invariants(self, owners: Sequence[Sequence[int]] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests).

        ``owners``, if given, lists every owner's block ids (one list per owner, repeats allowed); the
        reference counts must then equal the number of times each block is listed.
        """
        free = self._free
        assert len(set(free)) == len(free), "a block is on the free list twice"
        assert all(self._refcount[b] == 0 for b in free), "a free block has owners"
        assert np.all(self._refcount >= 0), "negative reference count"
        assert len(free) + self.num_used == self.num_blocks, "free + used != total"
        if owners is not None:
            expected = np.zeros(self.num_blocks, np.int32)
            for blocks in owners:
                for b in blocks:
                    expected[b] += 1
            bad = np.nonzero(expected != self._refcount)[0]
            assert bad.size == 0, f"reference counts differ from owners at blocks {bad[:8].tolist()}"

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise CacheError(f"block id {block} outside [0, {self.num_blocks}): not a block of this pool")


def blocks_for(tokens: int, page_size: int) -> int:
    """Blocks needed to hold ``tokens`` token slots."""
    return math.ceil(tokens / page_size) if tokens > 0 else 0
