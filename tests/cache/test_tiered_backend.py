"""TieredKVManager: prefix blocks the device pool evicts go to the tiered store and come back through
``match_prefix``."""

from __future__ import annotations

import gc
from pathlib import Path

import jax
import numpy as np
import pytest

from zgen.cache.block_pool import BlockPool
from zgen.cache.page_store import PagedConfig, PageStore
from zgen.cache.tiered import TieredConfig, TieredKVManager, warm_error_bound
from zgen.errors import CacheError, ConfigError
from zgen.pallas.paged_attention.layouts import KVPages, float_pages, stored_like

PS = 4
POOL_BLOCKS = 6
TOKENS = list(range(100, 113))  # 13 tokens: 3 full blocks below the last token


def _manager(config: PagedConfig, tiers: TieredConfig) -> TieredKVManager:
    return TieredKVManager(PageStore(config, BlockPool(POOL_BLOCKS, PS)), tiers, max_len=POOL_BLOCKS * PS)


def _randomize_pages(store: PageStore, seed: int, scale: float = 1.0) -> None:
    """Every page leaf of the store random (bytes for packed leaves, normals for float ones)."""
    rng = np.random.default_rng(seed)

    def fill(leaf: jax.Array) -> jax.Array:
        if leaf.dtype == np.uint8:
            return jax.numpy.asarray(rng.integers(0, 256, leaf.shape, np.uint8))
        return jax.numpy.asarray(rng.normal(size=leaf.shape) * scale, leaf.dtype)

    def randomize(pages: KVPages) -> KVPages:  # float leaves filled as floats, however the pool stores them
        return stored_like(pages, jax.tree_util.tree_map(fill, float_pages(pages)))

    store.k, store.v = tuple(map(randomize, store.k)), tuple(map(randomize, store.v))


def _pages_of(manager: TieredKVManager, blocks: list[int]) -> list[np.ndarray]:
    """Every page leaf's slice for ``blocks``, as raw bytes (bit-exact comparisons, any dtype)."""
    leaves = jax.tree_util.tree_leaves((manager.store.k, manager.store.v))
    return [np.ascontiguousarray(np.asarray(leaf)[:, blocks]).view(np.uint8) for leaf in leaves]


def _fill_the_pool(manager: TieredKVManager) -> None:
    """A sequence that takes every block of the pool (evicting the prefix cache's), then finishes."""
    handle = manager.new_handle()
    handle.reserve(POOL_BLOCKS * PS)
    handle.release()


def _evict_to_the_tiers(manager: TieredKVManager, scale: float = 1.0) -> list[np.ndarray]:
    """Prefill (random pages) and commit TOKENS, then push its 3 blocks out of the pool; returns their pages."""
    handle = manager.new_handle()
    assert manager.match_prefix(handle, TOKENS) == 0
    handle.reserve(len(TOKENS))
    _randomize_pages(manager.store, seed=1, scale=scale)  # what a prefill would have written
    blocks = [int(b) for b in handle.block_table[0, :3]]
    manager.commit_prefix(handle, TOKENS)
    assert manager.radix is not None and manager.radix.num_blocks == 3
    handle.release()
    original = _pages_of(manager, blocks)
    _fill_the_pool(manager)  # evicts (demotes) the 3 cached blocks
    assert manager.radix.num_blocks == 0
    manager.store.reset_pages()  # so a restore must really copy the pages back
    return original


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8", "q4", "q3"])
def test_evicted_prefix_blocks_come_back_bit_exact_from_every_tier(kv_dtype: str, tmp_path: Path) -> None:
    tiers = TieredConfig(hot_blocks=1, warm_blocks=1, warm_format="exact", cold_dir=tmp_path)
    manager = _manager(PagedConfig(2, 2, 16, PS, kv_dtype), tiers)
    assert manager.kind == "tiered"
    original = _evict_to_the_tiers(manager)
    stats = manager.tiers.stats()
    assert stats.blocks == {"hot": 0, "warm": 1, "cold": 2} and len(manager.tiers.cold_files()) == 4

    handle = manager.new_handle()
    assert manager.match_prefix(handle, TOKENS) == 12  # all 3 blocks, from host RAM and disk: no prefill for them
    assert handle.seq_len == 12
    restored = [int(b) for b in handle.block_table[0, :3]]
    handle.release()
    for got, want in zip(_pages_of(manager, restored), original, strict=True):
        np.testing.assert_array_equal(got, want)
    stats = manager.tiers.stats()
    assert stats.hits == 3 and stats.prefetched == 2  # the cold blocks were read on the prefetch threads
    assert manager.radix is not None and manager.radix.num_blocks == 3  # device hits from now on
    assert manager.pool.num_used == 3  # the tree holds the restored blocks, the finished sequence none

    _fill_the_pool(manager)  # evicted again: the store still has them, nothing is copied
    assert len(manager.tiers) == 3 and manager.tiers.stats().demotions == stats.demotions
    manager.close()
    assert tmp_path.exists() and list(tmp_path.iterdir()) == []  # our files gone, the given directory kept


def test_lossy_warm_format_restores_within_its_bound() -> None:
    tiers = TieredConfig(hot_blocks=1, warm_blocks=8, warm_format="int8")
    manager = _manager(PagedConfig(2, 2, 16, PS, "fp32"), tiers)
    original = _evict_to_the_tiers(manager)
    handle = manager.new_handle()
    assert manager.match_prefix(handle, TOKENS) == 12
    restored = [int(b) for b in handle.block_table[0, :3]]
    handle.release()
    for got, want in zip(_pages_of(manager, restored), original, strict=True):
        got_f, want_f = got.view(np.float32), want.view(np.float32)
        assert np.all(np.abs(got_f - want_f) <= warm_error_bound(want_f, "int8"))
        assert np.abs(got_f - want_f).max() > 0
    manager.close()


def test_a_block_the_warm_format_cannot_hold_is_dropped_with_a_warning() -> None:
    tiers = TieredConfig(warm_format="float16")
    manager = _manager(PagedConfig(1, 1, 16, PS, "fp32"), tiers)
    with pytest.warns(RuntimeWarning, match="float16's range"):
        _evict_to_the_tiers(manager, scale=1e6)  # beyond ±65504: float16 cannot keep these pages
    assert len(manager.tiers) == 0 and manager.pool.num_free == POOL_BLOCKS  # evicted as without tiers
    handle = manager.new_handle()
    assert manager.match_prefix(handle, TOKENS) == 0  # a miss everywhere: prefilled again
    handle.release()
    manager.close()


def test_lossy_warm_format_is_refused_for_quantized_pages() -> None:
    with pytest.raises(ConfigError, match="warm_format='exact'"):
        _manager(PagedConfig(1, 1, 16, PS, "q4"), TieredConfig(warm_format="float16"))


def test_close_and_garbage_collection_remove_the_temporary_cold_dir() -> None:
    manager = _manager(PagedConfig(1, 1, 8, PS, "fp32"), TieredConfig())
    cold_dir = manager.tiers.cold_dir
    manager.close()
    assert not cold_dir.exists()
    with pytest.raises(CacheError, match="closed"):
        manager.match_prefix(manager.new_handle(), TOKENS)

    manager = _manager(PagedConfig(1, 1, 8, PS, "fp32"), TieredConfig())
    cold_dir = manager.tiers.cold_dir
    del manager
    gc.collect()
    assert not cold_dir.exists()
