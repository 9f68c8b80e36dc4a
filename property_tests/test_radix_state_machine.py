"""Stateful property test of RadixCache over a BlockPool.

Sequences of tokens from a tiny alphabet (so prefixes are shared often) start (matching cached blocks
and sharing them, allocating the rest), finish (optionally inserting their full blocks) and are matched,
evicted and reclaimed in random orders, on a pool small enough to run out. In half the runs the pool
asks the tree to reclaim blocks when it is short (as a paged KV manager's pool does).

Ground truth: every allocated block is labelled with the exact token prefix whose KV it would hold
(all tokens up to the end of the block — KV depends on the whole prefix). Checked:

* ``match`` never returns a block whose label differs from the query's prefix, and returns the
  longest cached run of whole blocks;
* eviction never frees a block that a live sequence still holds; only unused leaves go;
* reclaim is all or nothing: it frees exactly what is asked when that many blocks are evictable, else
  none; a pool that reclaims allocates exactly when its free blocks plus the evictable ones suffice;
* reference counts always equal (live sequences naming the block) + (1 if the tree holds it);
  free + used == total; every tree entry's block carries the entry's prefix;
* hit/miss/eviction stats add up.
"""

from __future__ import annotations

from hypothesis import event, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from zgen.cache.block_pool import BlockPool, blocks_for
from zgen.cache.radix import RadixCache, block_hashes
from zgen.errors import PoolExhaustedError

PS, BLOCKS = 2, 12

tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=9)


class Seq:
    def __init__(self, tokens: tuple[int, ...], blocks: list[int]) -> None:
        self.tokens, self.blocks = tokens, blocks

    def __repr__(self) -> str:
        return f"Seq({list(self.tokens)})"


class RadixMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(BLOCKS, PS)
        self.radix = RadixCache(self.pool)
        self.label: dict[int, tuple[int, ...]] = {}  # block -> token prefix its KV holds
        self.live: list[Seq] = []
        self.lookups = 0
        self.evicted = 0
        self.reclaiming = False

    @initialize(reclaiming=st.booleans())
    def hook(self, reclaiming: bool) -> None:
        """Whether the pool asks the tree for blocks when an allocation is short."""
        self.reclaiming = reclaiming
        if reclaiming:
            self.pool.reclaim = self.radix.reclaim

    def _forget_freed_blocks(self) -> None:
        for b in range(BLOCKS):
            if self.pool.refcount(b) == 0:
                self.label.pop(b, None)

    def _check_match(self, tokens: tuple[int, ...]) -> tuple[list[int], int]:
        blocks, n = self.radix.match(tokens)
        self.lookups += 1
        assert n == len(blocks) * PS and n <= len(tokens)
        for i, b in enumerate(blocks):
            assert self.label.get(b) == tokens[: (i + 1) * PS], f"match returned block {b} holding other tokens"
        # Longest: the next whole block of the query is not cached under this path.
        cached = {prefix for prefix, _ in self.radix.entries()}
        if n + PS <= len(tokens):
            assert tokens[: n + PS] not in cached, "match stopped before the longest cached prefix"
        return blocks, n

    @rule(target=seqs, tokens=tokens_strategy, base=st.integers(0, 3))
    def start(self, tokens: list[int], base: int) -> Seq:
        # Often extend a live sequence's tokens, so prefixes are shared.
        prefix: tuple[int, ...] = self.live[base % len(self.live)].tokens[: 2 * PS] if self.live and base else ()
        full = prefix + tuple(tokens)
        blocks, n = self._check_match(full)
        event("start reused cached blocks" if n else "start missed")
        self.pool.share(blocks)
        need = blocks_for(len(full), PS) - len(blocks)
        short = need - self.pool.num_free
        can_reclaim = self.reclaiming and self.radix.evictable_blocks() >= short
        evicted_before = self.radix.stats.evicted_blocks
        try:
            fresh = self.pool.allocate(need)
        except PoolExhaustedError:
            event("pool exhausted")
            assert short > 0 and not can_reclaim, "the pool refused blocks it had or could reclaim"
            assert self.radix.stats.evicted_blocks == evicted_before, "a refused allocation evicted blocks"
            self.pool.free(blocks)
            return Seq((), [])  # a sequence that holds nothing
        if short > 0:
            event("the pool reclaimed prefix blocks")
            assert can_reclaim and self.radix.stats.evicted_blocks - evicted_before == short
            self.evicted += short
        else:
            assert self.radix.stats.evicted_blocks == evicted_before, "the pool reclaimed blocks it did not need"
        for j, b in enumerate(fresh):
            i = len(blocks) + j
            self.label[b] = full[: min((i + 1) * PS, len(full))]
        self._forget_freed_blocks()  # blocks the pool reclaimed and did not hand out again
        seq = Seq(full, blocks + fresh)
        self.live.append(seq)
        return seq

    @rule(seq=consumes(seqs), commit=st.booleans())
    def finish(self, seq: Seq, commit: bool) -> None:
        if seq not in self.live:
            return
        if commit:
            self.radix.insert(list(seq.tokens), seq.blocks)
        self.live.remove(seq)
        for b in self.pool.free(seq.blocks):
            del self.label[b]

    @rule(tokens=tokens_strategy)
    def match(self, tokens: list[int]) -> None:
        self._check_match(tuple(tokens))

    @precondition(lambda self: self.radix.num_blocks > 0)
    @rule(n=st.integers(1, 4))
    def evict(self, n: int) -> None:
        held = {b: self.pool.refcount(b) for s in self.live for b in s.blocks}
        evictable = self.radix.evictable_blocks()
        freed = self.radix.evict(n)
        self.evicted += freed
        assert freed == min(n, evictable), "eviction freed a different number of blocks than were evictable"
        for b, count in held.items():
            assert self.pool.refcount(b) >= 1 and b in self.label, f"eviction freed block {b} a live sequence holds"
            assert self.pool.refcount(b) in (count, count - 1)
        self._forget_freed_blocks()
        if freed:
            event("evicted")

    @precondition(lambda self: self.radix.num_blocks > 0)
    @rule(n=st.integers(1, 4))
    def reclaim(self, n: int) -> None:
        held = {b: self.pool.refcount(b) for s in self.live for b in s.blocks}
        evictable = self.radix.evictable_blocks()
        freed = self.radix.reclaim(n)
        self.evicted += freed
        assert freed == (n if evictable >= n else 0), "reclaim is not all or nothing"
        for b, count in held.items():
            assert self.pool.refcount(b) == count, f"reclaim took block {b} a live sequence holds"
        self._forget_freed_blocks()

    @invariant()
    def consistent(self) -> None:
        tree_blocks = self.radix.blocks()
        assert len(set(tree_blocks)) == len(tree_blocks), "a block sits in the tree twice"
        self.pool.check_invariants(owners=[s.blocks for s in self.live] + [tree_blocks])
        entries = self.radix.entries()
        assert len(entries) == self.radix.num_blocks
        for prefix, block in entries:
            assert len(prefix) % PS == 0
            assert self.label.get(block) == prefix, "a tree entry points at a block holding other tokens"
            assert self.radix.contains_hash(block_hashes(prefix, PS)[-1])
        s = self.radix.stats
        assert s.lookups == self.lookups == s.hits + s.misses
        assert s.evicted_blocks == self.evicted
        assert s.inserted_blocks - s.evicted_blocks == self.radix.num_blocks

    def teardown(self) -> None:
        for s in self.live:
            self.pool.free(s.blocks)
        self.radix.clear()
        assert self.pool.num_free == BLOCKS and self.radix.num_blocks == 0


TestRadix = RadixMachine.TestCase
# Host-only and fast: eight times the profile's examples.
_profile = settings.default
assert _profile is not None
TestRadix.settings = settings(_profile, max_examples=8 * _profile.max_examples)
