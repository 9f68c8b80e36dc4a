"""TieredPagedBackend: prefix blocks the device pool evicts go to the tiered store and come back."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest

from zgen.cache.block_pool import BlockPool
from zgen.cache.paged import PagedConfig, PagedKVState
from zgen.cache.tiered import TieredConfig, TieredPagedBackend, warm_error_bound
from zgen.errors import CacheError, ConfigError

PS = 4
TOKENS = list(range(100, 113))  # 13 tokens: 3 full blocks below the last token


def _random_pages(state: PagedKVState, seed: int, scale: float = 1.0) -> PagedKVState:
    """The state with every page leaf random (bytes for packed leaves, normals for float ones)."""
    rng = np.random.default_rng(seed)

    def fill(leaf: jax.Array) -> jax.Array:
        if leaf.dtype == np.uint8:
            return jax.numpy.asarray(rng.integers(0, 256, leaf.shape, np.uint8))
        return jax.numpy.asarray(rng.normal(size=leaf.shape) * scale, leaf.dtype)

    return replace(state, k=jax.tree_util.tree_map(fill, state.k), v=jax.tree_util.tree_map(fill, state.v))


def _pages_of(backend: TieredPagedBackend, blocks: list[int]) -> list[np.ndarray]:
    """Every page leaf's slice for ``blocks``, as raw bytes (bit-exact comparisons, any dtype)."""
    leaves = jax.tree_util.tree_leaves((backend.store.k, backend.store.v))
    return [np.ascontiguousarray(np.asarray(leaf)[:, blocks]).view(np.uint8) for leaf in leaves]


def _evict_to_the_tiers(backend: TieredPagedBackend, scale: float = 1.0) -> list[np.ndarray]:
    """Prefill (random pages) and commit TOKENS, then push its 3 blocks out of the pool; returns their pages."""
    state, reused = backend.allocate_with_prefix([TOKENS], 16)
    assert reused == [0]
    state = _random_pages(state, seed=1, scale=scale)
    blocks = [int(b) for b in np.asarray(state.block_tables)[0, :3]]
    assert backend.commit_prefix(state, 0, TOKENS) == 3
    backend.release(state)
    original = _pages_of(backend, blocks)
    backend.release(backend.allocate(1, 6 * PS))  # the whole pool: evicts (demotes) the 3 cached blocks
    assert backend.radix is not None and backend.radix.num_blocks == 0
    backend.store.reset_pages()  # so a restore must really copy the pages back
    return original


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8", "q4", "q3"])
def test_evicted_prefix_blocks_come_back_bit_exact_from_every_tier(kv_dtype: str, tmp_path: Path) -> None:
    tiers = TieredConfig(hot_blocks=1, warm_blocks=1, warm_format="exact", cold_dir=tmp_path)
    backend = TieredPagedBackend(PagedConfig(2, 2, 16, PS, kv_dtype), BlockPool(6, PS), tiers)
    original = _evict_to_the_tiers(backend)
    stats = backend.tiers.stats()
    assert stats.blocks == {"hot": 0, "warm": 1, "cold": 2} and len(backend.tiers.cold_files()) == 4

    state, reused = backend.allocate_with_prefix([TOKENS], 16)
    assert reused == [12]  # all 3 blocks, from host RAM and disk: no prefill for them
    restored = [int(b) for b in np.asarray(state.block_tables)[0, :3]]
    backend.release(state)
    for got, want in zip(_pages_of(backend, restored), original, strict=True):
        np.testing.assert_array_equal(got, want)
    stats = backend.tiers.stats()
    assert stats.hits == 3 and stats.prefetched == 2  # the cold blocks were read on the prefetch threads
    assert backend.radix is not None and backend.radix.num_blocks == 3  # device hits from now on

    backend.release(backend.allocate(1, 6 * PS))  # evicted again: the store still has them, nothing is copied
    assert len(backend.tiers) == 3 and backend.tiers.stats().demotions == stats.demotions
    backend.close()
    assert tmp_path.exists() and list(tmp_path.iterdir()) == []  # our files gone, the given directory kept


def test_lossy_warm_format_restores_within_its_bound() -> None:
    tiers = TieredConfig(hot_blocks=1, warm_blocks=8, warm_format="int8")
    backend = TieredPagedBackend(PagedConfig(2, 2, 16, PS, "fp32"), BlockPool(6, PS), tiers)
    original = _evict_to_the_tiers(backend)
    state, reused = backend.allocate_with_prefix([TOKENS], 16)
    restored = [int(b) for b in np.asarray(state.block_tables)[0, :3]]
    backend.release(state)
    assert reused == [12]
    for got, want in zip(_pages_of(backend, restored), original, strict=True):
        got_f, want_f = got.view(np.float32), want.view(np.float32)
        assert np.all(np.abs(got_f - want_f) <= warm_error_bound(want_f, "int8"))
        assert np.abs(got_f - want_f).max() > 0
    backend.close()


def test_a_block_the_warm_format_cannot_hold_is_dropped_with_a_warning() -> None:
    tiers = TieredConfig(warm_format="float16")
    backend = TieredPagedBackend(PagedConfig(1, 1, 16, PS, "fp32"), BlockPool(6, PS), tiers)
    with pytest.warns(RuntimeWarning, match="float16's range"):
        _evict_to_the_tiers(backend, scale=1e6)  # beyond ±65504: float16 cannot keep these pages
    assert len(backend.tiers) == 0 and backend.pool.num_free == 6  # evicted as without tiers
    state, reused = backend.allocate_with_prefix([TOKENS], 16)
    assert reused == [0]  # a miss everywhere: prefilled again
    backend.release(state)
    backend.close()


def test_lossy_warm_format_is_refused_for_quantized_pages() -> None:
    with pytest.raises(ConfigError, match="warm_format='exact'"):
        TieredPagedBackend(PagedConfig(1, 1, 16, PS, "q4"), BlockPool(4, PS), TieredConfig(warm_format="float16"))


def test_close_and_garbage_collection_remove_the_temporary_cold_dir() -> None:
    backend = TieredPagedBackend(PagedConfig(1, 1, 8, PS, "fp32"), BlockPool(4, PS), TieredConfig())
    cold_dir = backend.tiers.cold_dir
    backend.close()
    assert not cold_dir.exists()
    with pytest.raises(CacheError, match="closed"):
        backend.allocate(1, PS)

    backend = TieredPagedBackend(PagedConfig(1, 1, 8, PS, "fp32"), BlockPool(4, PS), TieredConfig())
    cold_dir = backend.tiers.cold_dir
    del backend
    gc.collect()
    assert not cold_dir.exists()
