"""TieredKVStore: placement by access counts, the three tiers' fidelity, prefetch, and the cold-directory rule."""

from __future__ import annotations

import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from zgen.cache.tiered import KVBlock, TieredConfig, TieredKVStore, warm_error_bound
from zgen.errors import CacheError, ConfigError


def _block(seed: int, dtype: np.dtype = np.dtype(np.float32)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(4, 2, 8)) * 2).astype(dtype), (rng.normal(size=(4, 2, 8)) * 2).astype(dtype)


def test_overflow_moves_least_used_blocks_down_and_reads_promote(tmp_path: Path) -> None:
    config = TieredConfig(hot_blocks=2, warm_blocks=1, warm_format="exact", promote_after=2, cold_dir=tmp_path)
    with TieredKVStore(config) as store:
        for key in [0, 1, (7, 0)]:
            store.put(key, *_block(hash(key) % 100))
        store.get(1)
        assert store.tier_of(0) == "warm"  # fewest reads, oldest: first down
        store.put((7, 1), *_block(5))  # hot is full again: 0 reads for (7, 0) -> warm, warm's 0 -> cold
        assert [store.tier_of(k) for k in (0, 1, (7, 0), (7, 1))] == ["cold", "hot", "warm", "hot"]
        assert len(store.cold_files()) == 2  # k and v of block 0

        store.get(0)
        assert store.tier_of(0) == "cold"
        got = store.get(0)  # second read since it went cold: up one tier (pushing the warm block down)
        assert store.tier_of(0) == "warm" and store.tier_of((7, 0)) == "cold"
        assert got is not None
        np.testing.assert_array_equal(np.asarray(got.k), _block(hash(0) % 100)[0])
        stats = store.stats()
        assert (stats.hits_hot, stats.hits_warm, stats.hits_cold, stats.misses) == (1, 0, 2, 0)
        assert stats.promotions == 1 and stats.demotions == 4
        assert stats.blocks == {"hot": 2, "warm": 1, "cold": 1}
        assert store.get("missing") is None and store.stats().misses == 1
        with pytest.raises(KeyError):
            store["missing"]
    assert tmp_path.exists() and list(tmp_path.iterdir()) == []  # given directory kept, our files gone


@pytest.mark.parametrize("warm_format", ["float16", "int8"])
def test_lossy_warm_tier_stays_within_the_stated_bound(warm_format: str) -> None:
    with TieredKVStore(TieredConfig(hot_blocks=1, warm_blocks=1, warm_format=warm_format)) as store:  # type: ignore[arg-type]
        k, v = _block(1)
        store.put("a", k, v)
        assert store.demote("a") == "warm"
        warm = store["a"]
        assert store.demote("a") == "cold"
        cold = store["a"]
        for got in (warm, cold):
            for have, want in ((got.k, k), (got.v, v)):
                err = np.abs(np.asarray(have) - want)
                assert np.all(err <= warm_error_bound(want, warm_format))  # type: ignore[arg-type]
                assert err.max() > 0
        np.testing.assert_array_equal(np.asarray(warm.k), np.asarray(cold.k))  # warm <-> cold is lossless
        assert store.stats().warm_bytes == 0
        store.promote("a")
        assert store.stats().warm_bytes == (k.size + v.size) * (2 if warm_format == "float16" else 1) + (
            0 if warm_format == "float16" else (k.size + v.size) // 8 * 4
        )


def test_exact_format_round_trips_bfloat16_through_every_tier() -> None:
    k = jnp.asarray(np.random.default_rng(2).normal(size=(4, 2, 8)), jnp.bfloat16)
    with TieredKVStore(TieredConfig(hot_blocks=1, warm_blocks=1, warm_format="exact")) as store:
        store.put((0, 3), k, -k)
        for tier in ("warm", "cold"):
            assert store.demote((0, 3)) == tier
            got = store[(0, 3)]
            assert got.k.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(got.k), np.asarray(k))
            np.testing.assert_array_equal(np.asarray(got.v), np.asarray(-k))


def test_prefetch_reads_disk_off_the_calling_thread() -> None:
    config = TieredConfig(hot_blocks=1, warm_blocks=3, warm_format="exact", promote_after=5)
    with TieredKVStore(config) as store:
        for key in range(4):
            store.put(key, *_block(key))
        assert [store.tier_of(key) for key in range(4)] == ["warm", "warm", "warm", "hot"]
        for key in range(3):
            store.demote(key)
        cold = [0, 1, 2]
        threads: set[str] = set()
        original = np.load

        def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            threads.add(threading.current_thread().name)
            return original(*args, **kwargs)

        np.load = spy  # type: ignore[assignment]
        try:
            futures = store.prefetch([*cold, 99])
            blocks = [f.result(timeout=30) for f in futures]
        finally:
            np.load = original  # type: ignore[assignment]
        assert blocks[-1] is None
        for key, block in zip(cold, blocks[:-1], strict=True):
            assert isinstance(block, KVBlock)
            np.testing.assert_array_equal(np.asarray(block.k), _block(key)[0])
            assert store.tier_of(key) == "warm"
        assert threads and all(name.startswith("zgen-kv-prefetch") for name in threads)
        stats = store.stats()
        assert stats.prefetched == len(cold) and stats.hits == 0  # prefetching is not a read
        [future] = store.prefetch([cold[0]], to="hot")
        future.result(timeout=30)
        assert store.tier_of(cold[0]) == "hot"


def test_temporary_cold_dir_is_removed_and_a_given_one_kept(tmp_path: Path) -> None:
    store = TieredKVStore(TieredConfig(hot_blocks=1, warm_blocks=1))
    created = store.cold_dir
    for key in range(4):
        store.put(key, *_block(key))
    assert len(list(created.iterdir())) == 4  # two cold blocks, k and v each
    store.close()
    assert not created.exists()
    with pytest.raises(CacheError, match="closed"):
        store.put(0, *_block(0))

    given = tmp_path / "cold"
    given.mkdir()
    (given / "other.npy").write_bytes(b"someone else's")
    with TieredKVStore(TieredConfig(hot_blocks=1, warm_blocks=1, cold_dir=given)) as store:
        for key in range(4):
            store.put(key, *_block(key))
        store.evict(3)
        assert store.evict(3) is False
        assert len(list(given.iterdir())) == 1 + 2 * store.stats().blocks["cold"]
    assert [p.name for p in given.iterdir()] == ["other.npy"]


def test_errors_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="hot_blocks >= 1"):
        TieredConfig(hot_blocks=0)
    with pytest.raises(ConfigError, match="warm_format"):
        TieredConfig(warm_format="fp8")  # type: ignore[arg-type]
    with TieredKVStore(TieredConfig(warm_format="float16")) as store:
        with pytest.raises(CacheError, match="beyond float16's range.*warm_format='int8' or 'exact'"):
            store.put(0, np.full((2, 4), 1e6, np.float32), np.zeros((2, 4), np.float32))
        with pytest.raises(CacheError, match="put it first"):
            store.promote(5)
        with pytest.raises(CacheError, match="'warm' or 'hot'"):
            store.prefetch([0], to="cold")  # type: ignore[arg-type]


def test_put_can_place_a_block_straight_in_host_ram() -> None:
    with TieredKVStore(TieredConfig(hot_blocks=1, warm_blocks=1, warm_format="exact")) as store:
        k, v = _block(3)
        store.put("spilled", k, v, tier="warm")
        assert store.tier_of("spilled") == "warm" and store.stats().warm_bytes == k.nbytes + v.nbytes
        store.put("next", k, v, tier="warm")  # warm is full: the least used block goes to disk
        assert store.tier_of("spilled") == "cold" and store.tier_of("next") == "warm"
        np.testing.assert_array_equal(np.asarray(store["spilled"].k), k)
        with pytest.raises(CacheError, match="'hot' or 'warm'"):
            store.put("x", k, v, tier="cold")  # type: ignore[arg-type]
        assert "x" not in store and len(store) == 2
