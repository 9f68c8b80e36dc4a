"""Stateful property test of PagedKVCache against a plain numpy reference.

Random sequences of update (random lengths, batch 2, 2 kv heads, 2 layers), truncate, reset, fork and
release over caches sharing one small pool (so allocation sometimes fails), in every storage dtype.
After every step, every live cache's ``get(layer)`` is checked against its reference:

* fp32 / bf16 / fp16: bit-exact against the reference rounded to the stored dtype;
* fp8 (E4M3, per-token scale s = amax/448): ``|err| <= |x|/16 + s/1024`` (3 mantissa bits, subnormal step);
* q4 (per-group stored scale s' and min z', bf16): ``|err| <= s'/2`` plus the clipping slack of the
  rounded scale/min, computed from the same bf16 roundings;
* q3 (8-entry codebook per token): each value decodes to its *nearest* codebook entry, and every entry
  lies within the token's [min, max] (up to bf16 rounding).

Invariants: the pool never leaks (free + used == total, reference counts equal the number of tables
naming each block), each cache holds exactly ceil(seq_len / page_size) blocks per row, forks never see
each other's writes (each is read against its own reference), and a failed allocation changes nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import event, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from zgen.cache.block_pool import BlockPool, blocks_for
from zgen.cache.paged import KV_DTYPES, PagedConfig, PagedKVCache, PageStore, q4_group_size
from zgen.cache.tensor import causal_attention
from zgen.errors import CacheError, PoolExhaustedError
from zgen.pallas.paged_attention.layouts import Q3Pages

LAYERS, BATCH, KVH, HEADS, D, PS, MAX_LEN, BLOCKS = 2, 2, 2, 4, 16, 4, 24, 15
MAX_CACHES = 4


def _round(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    if kv_dtype == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    if kv_dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    return x


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def check_read(got: np.ndarray, ref: np.ndarray, kv_dtype: str, codebook: np.ndarray | None) -> None:
    """``got`` (read back) against ``ref`` (what was written, f32), both [B, S, KVH, D]."""
    if kv_dtype in ("fp32", "bf16", "fp16"):
        np.testing.assert_array_equal(got, _round(ref, kv_dtype))
        return
    err = np.abs(got.astype(np.float64) - ref)
    amax = np.max(np.abs(ref), axis=-1, keepdims=True)
    if kv_dtype == "fp8":
        bound = np.abs(ref) / 16 + amax / 448 / 1024 + 1e-6 * amax
    elif kv_dtype == "q4":
        g = q4_group_size(D)
        grouped = ref.reshape(*ref.shape[:-1], D // g, g)
        lo, hi = grouped.min(-1, keepdims=True), grouped.max(-1, keepdims=True)
        scale = _bf16(np.where(hi > lo, (hi - lo) / np.float32(15.0), np.float32(1.0)))
        zero = _bf16(lo)
        slack = np.maximum(zero - lo, 0) + np.maximum(hi - (15 * scale + zero), 0)
        bound = np.broadcast_to(scale / 2 + slack + 1e-6 * (np.abs(lo) + np.abs(hi)), grouped.shape).reshape(ref.shape)
    else:
        assert codebook is not None
        nearest = np.min(np.abs(ref[..., :, None] - codebook[..., None, :].astype(np.float64)), axis=-1)
        lo, hi = ref.min(-1, keepdims=True), ref.max(-1, keepdims=True)
        span = hi - lo
        assert np.all(codebook >= _bf16(lo) - 1e-6 * np.abs(lo) - 1e-12), "a codebook entry below the token's min"
        assert np.all(codebook <= _bf16(hi) + 1e-6 * np.abs(hi) + 1e-12), "a codebook entry above the token's max"
        bound = nearest + 1e-6 * span + 1e-12
    bad = err > bound
    assert not bad.any(), f"{kv_dtype}: {int(bad.sum())} values outside the bound; worst excess {float(np.max(err - bound)):.3g}"


@jax.jit
def _decode_attend(state: Any, q: jax.Array, positions: jax.Array) -> jax.Array:
    return state.attend(0, q, positions, sliding_window=None)


class Entry:
    """A live cache and its reference K/V: per layer [B, seq_len, KVH, D] float64 arrays."""

    def __init__(self, cache: PagedKVCache, k: list[np.ndarray], v: list[np.ndarray]) -> None:
        self.cache, self.k, self.v = cache, k, v

    def __repr__(self) -> str:
        return f"Entry(seq_len={self.cache.seq_len})"


def _empty_ref() -> list[np.ndarray]:
    return [np.zeros((BATCH, 0, KVH, D)) for _ in range(LAYERS)]


class PagedCacheMachine(RuleBasedStateMachine):
    caches = Bundle("caches")

    def __init__(self) -> None:
        super().__init__()
        self.kv_dtype = "fp32"
        self.store: PageStore | None = None
        self.live: list[Entry] = []

    @initialize(target=caches, kv_dtype=st.sampled_from(KV_DTYPES))
    def start(self, kv_dtype: str) -> Entry:
        self.kv_dtype = kv_dtype
        self.store = PageStore(PagedConfig(LAYERS, KVH, D, PS, kv_dtype), BlockPool(BLOCKS, PS))
        return self._new()

    def _new(self) -> Entry:
        assert self.store is not None
        entry = Entry(PagedKVCache(self.store, BATCH, MAX_LEN), _empty_ref(), _empty_ref())
        self.live.append(entry)
        return entry

    @precondition(lambda self: len(self.live) < MAX_CACHES)
    @rule(target=caches)
    def new_cache(self) -> Entry:
        return self._new()

    @rule(
        entry=caches,
        n=st.integers(1, 7),
        seed=st.integers(0, 2**32 - 4),
        magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
        zero_row=st.booleans(),
        repeats=st.integers(1, 3),
    )
    def update(self, entry: Entry, n: int, seed: int, magnitude: float, zero_row: bool, repeats: int) -> None:
        """Append ``n`` tokens to every layer, ``repeats`` times (fresh data each time)."""
        for i in range(repeats):
            if not self._append(entry, n, seed + i, magnitude, zero_row):
                break

    def _append(self, entry: Entry, n: int, seed: int, magnitude: float, zero_row: bool) -> bool:
        cache = entry.cache
        rng = np.random.default_rng(seed)
        ks = (rng.standard_normal((LAYERS, BATCH, n, KVH, D)) * magnitude).astype(np.float32)
        vs = (rng.standard_normal((LAYERS, BATCH, n, KVH, D)) * magnitude).astype(np.float32)
        if zero_row:
            ks[:, -1, 0] = 0.0  # an all-zero token (scales of 0)
        before = (cache.block_table, cache.seq_len, cache.pool.refcounts(), cache.pool.free_blocks())
        if cache.seq_len + n > cache.capacity:
            try:
                cache.update(0, jnp.asarray(ks[0]), jnp.asarray(vs[0]))
            except CacheError as e:
                assert "cannot append" in str(e)
                event("update past capacity rejected")
            else:
                raise AssertionError("an update past capacity was accepted")
            return False
        try:
            cache.update(0, jnp.asarray(ks[0]), jnp.asarray(vs[0]))
        except PoolExhaustedError:
            event("update hit an exhausted pool")
            after = (cache.block_table, cache.seq_len, cache.pool.refcounts(), cache.pool.free_blocks())
            np.testing.assert_array_equal(after[0], before[0])
            assert after[1] == before[1] and after[3] == before[3]
            np.testing.assert_array_equal(after[2], before[2])
            return False
        shared_before = int(np.sum(before[2] > 1))
        if shared_before and int(np.sum(cache.pool.refcounts() > 1)) < shared_before:
            event("update copied a shared block on write")
        for layer in range(1, LAYERS):
            cache.update(layer, jnp.asarray(ks[layer]), jnp.asarray(vs[layer]))
        for layer in range(LAYERS):
            entry.k[layer] = np.concatenate([entry.k[layer], ks[layer].astype(np.float64)], axis=1)
            entry.v[layer] = np.concatenate([entry.v[layer], vs[layer].astype(np.float64)], axis=1)
        return True

    @rule(entry=caches, fraction=st.floats(0.0, 1.0))
    def truncate(self, entry: Entry, fraction: float) -> None:
        n = int(fraction * entry.cache.seq_len)
        entry.cache.truncate(n)
        entry.k = [x[:, :n] for x in entry.k]
        entry.v = [x[:, :n] for x in entry.v]

    @rule(entry=caches)
    def reset(self, entry: Entry) -> None:
        entry.cache.reset()
        entry.k, entry.v = _empty_ref(), _empty_ref()

    @precondition(lambda self: len(self.live) < MAX_CACHES)
    @rule(target=caches, entry=caches)
    def fork(self, entry: Entry) -> Entry:
        used = entry.cache.pool.num_used
        twin = Entry(entry.cache.fork(), [x.copy() for x in entry.k], [x.copy() for x in entry.v])
        assert entry.cache.pool.num_used == used, "fork copied blocks"
        self.live.append(twin)
        return twin

    @precondition(lambda self: len(self.live) > 1)
    @rule(entry=consumes(caches))
    def free(self, entry: Entry) -> None:
        entry.cache.release()
        self.live.remove(entry)
        try:
            entry.cache.get(0)
        except CacheError:
            pass
        else:
            raise AssertionError("a released cache still answers")

    @precondition(lambda self: self.kv_dtype in ("fp32", "q4"))
    @rule(entry=caches, seed=st.integers(0, 2**16))
    def decode_attention(self, entry: Entry, seed: int) -> None:
        """The T == 1 kernel through this cache's block table equals attention over what get() returns."""
        cache = entry.cache
        if cache.seq_len == 0:
            return
        q = jnp.asarray(np.random.default_rng(seed).standard_normal((BATCH, 1, HEADS, D)), jnp.float32)
        pos = jnp.full((BATCH, 1), cache.seq_len - 1, jnp.int32)
        got = _decode_attend(cache.state, q, pos)
        view = cache.get(0)
        want = causal_attention(q, view.k, view.v, pos, sliding_window=None)
        # Large magnitudes make near-one-hot softmaxes: allow rounding relative to the values' size.
        atol = 1e-4 * (1.0 + float(jnp.max(jnp.abs(view.v))))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        if self.store is None:
            return
        pool = self.store.pool
        pool.check_invariants(owners=[e.cache.owned_blocks() for e in self.live])
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert 0.0 <= pool.fragmentation_ratio <= 1.0

    @invariant()
    def caches_hold_exactly_the_blocks_they_need(self) -> None:
        for e in self.live:
            table = e.cache.block_table
            need = blocks_for(e.cache.seq_len, PS)
            assert (table[:, :need] >= 0).all() and (table[:, need:] == -1).all()

    @invariant()
    def every_read_matches_its_reference(self) -> None:
        for e in self.live:
            assert e.cache.seq_len == e.k[0].shape[1]
            for layer in range(LAYERS):
                got = e.cache.get(layer)
                codebooks = self._codebooks(e, layer)
                check_read(np.asarray(got.k, np.float64), e.k[layer], self.kv_dtype, codebooks[0])
                check_read(np.asarray(got.v, np.float64), e.v[layer], self.kv_dtype, codebooks[1])

    def _codebooks(self, e: Entry, layer: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Stored Q3 codebooks of the cache's tokens, [B, S, KVH, 8] (None for other formats)."""
        if self.kv_dtype != "q3" or self.store is None:
            return None, None
        n = e.cache.seq_len
        table = np.maximum(e.cache.block_table, 0)
        out = []
        for pages in (self.store.k[layer], self.store.v[layer]):
            assert isinstance(pages, Q3Pages)
            cb = np.asarray(pages.codebook, np.float32)[:, table]  # [KVH, B, pps, PS, 8]
            cb = cb.reshape(KVH, BATCH, -1, 8).transpose(1, 2, 0, 3)[:, :n]
            out.append(cb)
        return out[0], out[1]

    def teardown(self) -> None:
        for e in self.live:
            e.cache.release()
        if self.store is not None:
            assert self.store.pool.num_free == BLOCKS, "blocks leaked after every cache was released"


TestPagedCache = PagedCacheMachine.TestCase
