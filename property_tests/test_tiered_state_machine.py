"""TieredKVStore under random put/get/evict/promote/demote/prefetch against a dict of the original blocks.

Every read equals the original exactly while the block never left the hot tier (and always with the
lossless "exact" warm format); otherwise it lies within the documented warm-tier bound. Tier sizes stay
within capacity, the files on disk are exactly the cold tier's, hits are counted per tier, and closing
leaves no files: a temporary cold directory is removed, a given one is left with only what was there.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zgen.cache.tiered import TieredConfig, TieredKVStore, WarmFormat, warm_error_bound

SHAPE = (4, 2, 8)  # [block_size, kv_heads, head_dim]
KEYS = st.one_of(st.integers(0, 5), st.tuples(st.integers(0, 1), st.integers(0, 2)))

try:  # property_tests/conftest.py registers "ci"/"thorough" and loads one: inherit it
    settings.get_profile("ci")
    SETTINGS = settings(deadline=None)
except InvalidArgument:  # no shared profiles: keep every property test together well under 3 minutes
    SETTINGS = settings(max_examples=30, stateful_step_count=25, deadline=None)


class TieredMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ref: dict[object, tuple[np.ndarray, np.ndarray]] = {}
        self.degraded: set[object] = set()  # blocks that have been below hot (maybe quantized)
        self.hits = {"hot": 0, "warm": 0, "cold": 0}
        self.misses = 0
        self.given_dir: Path | None = None

    @initialize(
        warm_format=st.sampled_from(["exact", "float16", "int8"]),
        give_dir=st.booleans(),
        hot=st.integers(1, 3),
        warm=st.integers(1, 3),
        promote_after=st.integers(1, 3),
    )
    def open_store(self, warm_format: WarmFormat, give_dir: bool, hot: int, warm: int, promote_after: int) -> None:
        if give_dir:
            self.given_dir = Path(tempfile.mkdtemp(prefix="zgen-test-cold-"))
            (self.given_dir / "keep.txt").write_text("not the store's")
        self.format: WarmFormat = warm_format
        self.store = TieredKVStore(
            TieredConfig(hot_blocks=hot, warm_blocks=warm, warm_format=warm_format,
                         promote_after=promote_after, cold_dir=self.given_dir)
        )

    def _check(self, key: object, k: np.ndarray, v: np.ndarray) -> None:
        want_k, want_v = self.ref[key]
        if key not in self.degraded or self.format == "exact":
            np.testing.assert_array_equal(k, want_k)
            np.testing.assert_array_equal(v, want_v)
            return
        for got, want in ((k, want_k), (v, want_v)):
            # one trip's bound, plus float32 rounding of later re-quantizations
            slack = 1e-5 * np.max(np.abs(want), axis=-1, keepdims=True)
            assert np.all(np.abs(got - want) <= warm_error_bound(want, self.format) + slack)

    def _note_tiers(self) -> None:
        for key in self.ref:
            if self.store.tier_of(key) != "hot":
                self.degraded.add(key)

    @rule(key=KEYS, seed=st.integers(0, 2**16))
    def put(self, key: object, seed: int) -> None:
        rng = np.random.default_rng(seed)
        k = (rng.normal(size=SHAPE) * 3).astype(np.float32)
        v = (rng.normal(size=SHAPE) * 3).astype(np.float32)
        self.store.put(key, k, v)
        self.ref[key] = (k, v)
        self.degraded.discard(key)
        self._note_tiers()

    @rule(key=KEYS)
    def get(self, key: object) -> None:
        tier = self.store.tier_of(key)
        block = self.store.get(key)
        if key not in self.ref:
            assert block is None and tier is None
            self.misses += 1
            return
        assert block is not None and tier is not None
        self.hits[tier] += 1
        self._check(key, np.asarray(block.k), np.asarray(block.v))
        self._note_tiers()

    @rule(key=KEYS)
    def evict(self, key: object) -> None:
        assert self.store.evict(key) == (key in self.ref)
        self.ref.pop(key, None)
        self.degraded.discard(key)

    @precondition(lambda self: bool(self.ref))
    @rule(data=st.data(), up=st.booleans())
    def move(self, data: st.DataObject, up: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.ref, key=repr)), label="key")
        before = self.store.tier_of(key)
        after = self.store.promote(key) if up else self.store.demote(key)
        order = ["hot", "warm", "cold"]
        assert before is not None
        step = -1 if up else 1
        assert order.index(after) == min(max(order.index(before) + step, 0), 2)
        self._note_tiers()

    @rule(keys=st.lists(KEYS, max_size=4), to_hot=st.booleans())
    def prefetch(self, keys: list[object], to_hot: bool) -> None:
        futures = self.store.prefetch(keys, to="hot" if to_hot else "warm")
        blocks = [future.result(timeout=30) for future in futures]
        # The futures run concurrently and may demote one another's blocks: a block is exact only if it
        # is hot now and nothing promoted it meanwhile (only a prefetch to hot promotes, the keys asked).
        self._note_tiers()
        if to_hot:
            self.degraded.update(key for key in keys if key in self.ref)
        for key, block in zip(keys, blocks, strict=True):
            if key not in self.ref:
                assert block is None
            else:
                assert block is not None
                self._check(key, np.asarray(block.k), np.asarray(block.v))
                assert self.store.tier_of(key) is not None

    @invariant()
    def tiers_and_files_agree(self) -> None:
        if not hasattr(self, "store"):
            return
        assert set(self.store.keys()) == set(self.ref)
        stats = self.store.stats()
        assert stats.blocks["hot"] <= self.store.config.hot_blocks
        assert stats.blocks["warm"] <= self.store.config.warm_blocks
        assert sum(stats.blocks.values()) == len(self.ref)
        assert (stats.hits_hot, stats.hits_warm, stats.hits_cold) == (self.hits["hot"], self.hits["warm"], self.hits["cold"])
        assert stats.misses == self.misses
        on_disk = {p for p in self.store.cold_dir.iterdir() if p.name != "keep.txt"}
        assert on_disk == set(self.store.cold_files())
        assert len(on_disk) > 0 or stats.blocks["cold"] == 0

    def teardown(self) -> None:
        if not hasattr(self, "store"):
            return
        cold_dir = self.store.cold_dir
        self.store.close()
        self.store.close()  # idempotent
        if self.given_dir is None:
            assert not cold_dir.exists()
        else:
            assert [p.name for p in self.given_dir.iterdir()] == ["keep.txt"]
            shutil.rmtree(self.given_dir)


TieredMachine.TestCase.settings = SETTINGS
TestTieredStateMachine = TieredMachine.TestCase
