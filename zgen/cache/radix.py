"""RadixCache: a prefix cache over whole KV blocks, shared by reference count.

The tree has one node per full block of ``page_size`` tokens. A node is found from its parent by the
block's exact tokens (so :meth:`RadixCache.match` can never return a block whose tokens differ from
the query — no hash collision can alias two blocks), and carries a hash chained with its parent's
(``blake2b(parent_hash || tokens)``), which names the whole prefix up to and including the block.

Each node owns one reference on its block in the :class:`~zgen.cache.block_pool.BlockPool`: blocks are
shared with the sequences that reuse them, never copied. A node is *in use* while any sequence holds
its block too (pool reference count above one); eviction takes least-recently-used leaves that are not
in use, so it never frees a block some sequence still reads.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from zgen.cache.block_pool import BlockPool
from zgen.errors import CacheError, ConfigError

ROOT_HASH = b"\x00" * 16
EvictionHandler = Callable[[list[tuple[bytes, int]]], None]  # (chained hash, block) of each evicted node


def block_hash(parent_hash: bytes, tokens: Sequence[int]) -> bytes:
    """The chained hash of a block: its parent's hash and its own tokens."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *(int(t) for t in tokens)))  # each token as 8 little-endian signed bytes
    return h.digest()


def block_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Chained hashes of every full block of ``tokens``."""
    out: list[bytes] = []
    parent = ROOT_HASH
    for i in range(len(tokens) // page_size):
        parent = block_hash(parent, tokens[i * page_size : (i + 1) * page_size])
        out.append(parent)
    return out


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    block: int
    hash: bytes
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


@dataclass(frozen=True)
class RadixStats:
    """Counters since the cache was built (or ``reset_stats``)."""

    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    misses: int = 0
    query_tokens: int = 0  # tokens asked for (full blocks only count as matchable)
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of queried tokens served from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class RadixCache:
    """Radix tree of token blocks whose KV blocks live in (and are reference-counted by) ``pool``."""

    def __init__(self, pool: BlockPool, *, max_blocks: int | None = None, on_evict: EvictionHandler | None = None) -> None:
        if max_blocks is not None and max_blocks < 0:
            raise ConfigError(f"max_blocks must be non-negative or None, got {max_blocks}")
        self.pool = pool
        self.page_size = pool.page_size
        self.max_blocks = max_blocks
        self.on_evict = on_evict
        self._root = _Node((), -1, ROOT_HASH, None)
        self._by_hash: dict[bytes, _Node] = {}
        # Leaves by last use, a heap: an entry goes stale when its leaf is used again (a newer entry
        # stands for it), gets a child or leaves the tree, and is dropped when it comes up.
        self._lru: list[tuple[int, int, _Node]] = []
        self._pushes = itertools.count()  # ties by push order; nodes are never compared
        self._clock = 0
        self._stats = RadixStats()

    # -- queries ----------------------------------------------------------------------------------

    @property
    def stats(self) -> RadixStats:
        return self._stats

    def reset_stats(self) -> None:
        self._stats = RadixStats()

    @property
    def num_blocks(self) -> int:
        """Blocks the tree holds a reference on."""
        return len(self._by_hash)

    def blocks(self) -> list[int]:
        """Every block the tree holds a reference on (one reference each)."""
        return [n.block for n in self._by_hash.values()]

    def contains_hash(self, h: bytes) -> bool:
        return h in self._by_hash

    def entries(self) -> list[tuple[tuple[int, ...], int]]:
        """``(prefix tokens, block)`` for every node: the full token prefix ending with that block
        (depth first, children in insertion order)."""
        out: list[tuple[tuple[int, ...], int]] = []
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            if node is not self._root:
                out.append((prefix, node.block))
            stack.extend((child, prefix + child.tokens) for child in reversed(node.children.values()))
        return out

    def evictable_blocks(self, enough: int | None = None) -> int:
        """Blocks that eviction could free now: nodes whose whole subtree is not in use. With
        ``enough``, the count stops once it reaches that many (:meth:`reclaim` asks only whether it can:
        a full count walks the whole tree on every allocation of a full pool).

        The walk is a loop over an explicit stack (post-order): a tree as deep as a long sequence's
        blocks would pass Python's recursion limit."""
        found = 0
        stack: list[tuple[_Node, Iterator[_Node]]] = [(self._root, iter(self._root.children.values()))]
        subtree_free = [True]  # per node on the stack: nothing below it is in use
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is not None:
                stack.append((child, iter(child.children.values())))
                subtree_free.append(True)
                continue
            stack.pop()
            free = subtree_free.pop()
            if node is self._root:
                break
            free = free and self.pool.refcount(node.block) == 1
            found += free
            if enough is not None and found >= enough:
                break
            subtree_free[-1] &= free
        return found

    # -- the cache --------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """The blocks of the longest cached prefix of ``tokens`` made of whole blocks, and its length.

        The returned blocks are *not* shared yet: a caller that keeps them must ``pool.share`` them
        before anything can evict them. Marks the matched path as recently used.
        """
        self._clock += 1
        node, blocks = self._root, []
        ps = self.page_size
        for i in range(len(tokens) // ps):
            child = node.children.get(tuple(int(t) for t in tokens[i * ps : (i + 1) * ps]))
            if child is None:
                break
            child.last_used = self._clock
            blocks.append(child.block)
            node = child
        self._queue_if_leaf(node)
        n = len(blocks) * ps
        s = self._stats
        self._stats = RadixStats(
            lookups=s.lookups + 1,
            hits=s.hits + (1 if n else 0),
            misses=s.misses + (0 if n else 1),
            query_tokens=s.query_tokens + len(tokens),
            hit_tokens=s.hit_tokens + n,
            inserted_blocks=s.inserted_blocks,
            evicted_blocks=s.evicted_blocks,
        )
        return blocks, n

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Record that ``blocks[i]`` holds the KV of tokens ``[i*page_size, (i+1)*page_size)``.

        Only whole blocks are inserted (``min(len(blocks), len(tokens) // page_size)`` of them). A block
        whose prefix is already cached keeps the cached block (the caller's copy is left alone); a new
        node takes one reference on its block. Returns the number of new nodes.
        """
        ps = self.page_size
        n = min(len(blocks), len(tokens) // ps)
        for b in blocks[:n]:
            if self.pool.refcount(int(b)) <= 0:
                raise CacheError(
                    f"block {int(b)} is free in the pool; insert blocks while the sequence that wrote them still holds them"
                )
        self._clock += 1
        node, added = self._root, 0
        ids = [int(t) for t in tokens[: n * ps]]
        for i in range(n):
            chunk = tuple(ids[i * ps : (i + 1) * ps])
            child = node.children.get(chunk)
            if child is None:
                block = int(blocks[i])
                self.pool.share([block])
                child = _Node(chunk, block, block_hash(node.hash, chunk), node)
                node.children[chunk] = child
                self._by_hash[child.hash] = child
                added += 1
            child.last_used = self._clock
            node = child
        self._queue_if_leaf(node)
        s = self._stats
        self._stats = RadixStats(
            s.lookups, s.hits, s.misses, s.query_tokens, s.hit_tokens, s.inserted_blocks + added, s.evicted_blocks
        )
        if self.max_blocks is not None and self.num_blocks > self.max_blocks:
            self.evict(self.num_blocks - self.max_blocks)
        return added

    def evict(self, n_blocks: int) -> int:
        """Free up to ``n_blocks`` blocks, least recently used leaves first, skipping blocks in use.

        ``on_evict`` (if set) gets the evicted nodes before their blocks are freed; the blocks are freed
        even if it raises. Returns how many blocks went back to the pool's free list.
        """
        evicted: list[_Node] = []
        in_use: list[tuple[int, int, _Node]] = []  # set aside, queued again after
        while len(evicted) < n_blocks and self._lru:  # a heap: a scan of the tree cost each allocation of a full pool
            entry = heapq.heappop(self._lru)
            used, _, node = entry
            if used != node.last_used or node.children or self._by_hash.get(node.hash) is not node:
                continue  # stale
            if self.pool.refcount(node.block) != 1:
                in_use.append(entry)
                continue
            self._unlink(node)  # its parent may become a leaf, queued by its own last use
            evicted.append(node)
        for entry in in_use:
            heapq.heappush(self._lru, entry)
        if not evicted:
            return 0
        blocks = [n.block for n in evicted]
        try:
            if self.on_evict is not None:
                self.on_evict([(n.hash, n.block) for n in evicted])
        finally:
            released = self.pool.free(blocks)
            assert sorted(released) == sorted(blocks), "evicted a block that something else still holds"
            s = self._stats
            self._stats = RadixStats(
                s.lookups, s.hits, s.misses, s.query_tokens, s.hit_tokens, s.inserted_blocks, s.evicted_blocks + len(evicted)
            )
        return len(evicted)

    def reclaim(self, n_blocks: int) -> int:
        """Evict ``n_blocks`` blocks if that many can be (all or nothing); the pool asks when short."""
        return self.evict(n_blocks) if self.evictable_blocks(enough=n_blocks) >= n_blocks else 0

    def clear(self) -> int:
        """Drop every node not in use (as ``evict`` would); returns the blocks freed."""
        return self.evict(self.num_blocks)

    def _unlink(self, leaf: _Node) -> None:
        parent = leaf.parent
        assert parent is not None and not leaf.children
        del parent.children[leaf.tokens]
        del self._by_hash[leaf.hash]
        self._queue_if_leaf(parent)

    def _queue_if_leaf(self, node: _Node) -> None:
        """Queue ``node`` for eviction by its last use if it is a leaf (every leaf has a live entry)."""
        if node is self._root or node.children:
            return
        if len(self._lru) > 2 * len(self._by_hash) + 64:  # mostly stale: rebuilt from the leaves
            self._lru = [(n.last_used, next(self._pushes), n) for n in self._by_hash.values() if not n.children]
            heapq.heapify(self._lru)
            return  # ``node`` among them
        heapq.heappush(self._lru, (node.last_used, next(self._pushes), node))
