"""Stateful property test of PagedKVCache against a plain numpy reference.

Random sequences of update (random lengths, batch 2, 2 kv heads, 2 layers), truncate, reset, fork and
release over caches sharing one small pool (so allocation sometimes fails), in every storage dtype.
After every step, every live cache's ``get(layer)`` is checked against its reference:

* fp32 / bf16 / fp16: bit-exact against the reference rounded to the stored dtype;
* fp8 (E4M3, per-token scale s = amax/448): ``|err| <= |x|/16 + s/1024`` (3 mantissa bits, subnormal step);
* q4 and q3 code what they store (keys: ``y = H((k - rope(shift, p)) * a)`` with a random
  calibration, the sink's shift at position 0; values: ``y = H v``; ``H`` the orthonormal Hadamard matrix), so the
  bound is derived in the coded domain and carried back: ``|err_x[i]| <= sum_j |H[i, j]| |err_y[j]| /
  a[i]``, with in the coded domain
  * q4 (per-group stored scale s' and min z', bf16): ``|err_y| <= s'/2`` plus the clipping slack of
    the rounded scale/min, and s' is the group's (max - min) / 15 up to bf16 rounding;
  * q3 (8 levels times a per-group stored scale s'): each value decodes to its *nearest* scaled level.

Invariants: the pool never leaks (free + used == total, reference counts equal the number of tables
naming each block), each cache holds exactly ceil(seq_len / page_size) blocks per row, forks never see
each other's writes (each is read against its own reference), and a failed allocation changes nothing.

A second machine drives a :class:`~zgen.cache.paged_manager.PagedKVManager` with its prefix cache, as the
runtime does: sequences of tokens from a tiny alphabet start from ``match_prefix``, are fed (K/V that
are a function of the whole token prefix, as a model's are), extended, truncated, forked, committed
with ``commit_prefix`` and released, while the pool reclaims cached blocks when it runs short. Checked
after every step: ``match_prefix`` reuses exactly the longest cached run of whole blocks (never the
last token), every handle reads the K/V of its own tokens, every block the prefix cache holds still
holds the K/V of its token prefix in the pages (copy-on-write protects it from the sequences sharing
it), and reference counts equal the handles' tables plus the tree.
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
from zgen.cache.formats import KV_DTYPES, kv_format, q3_group_size
from zgen.pallas.paged_attention.layouts import q4_group_size
from zgen.cache.page_store import PagedConfig, PageStore
from zgen.cache.paged import PagedKVCache
from zgen.cache.paged_manager import PagedKVManager
from zgen.cache.tensor import causal_attention
from zgen.errors import CacheError, PoolExhaustedError
from zgen.pallas.paged_attention.layouts import Q3_LEVELS, KeyCalibration, float_pages

LAYERS, BATCH, KVH, HEADS, D, PS, MAX_LEN, BLOCKS = 2, 2, 2, 4, 16, 4, 24, 15
MAX_CACHES = 4
CODED_KV_DTYPES = tuple(name for name in KV_DTYPES if kv_format(name).coded)


def _round(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    if kv_dtype == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    if kv_dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    return x


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _sylvester(d: int) -> np.ndarray:
    """The orthonormal Hadamard matrix of order ``d`` (a power of two), Sylvester's construction."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


H_D = _sylvester(D)


INV_FREQ = 10_000.0 ** (-np.arange(0, D, 2) / D)


class Coding:
    """What a coded format stores for reference values ``x [B, S, KVH, D]`` (float64)."""

    def __init__(self, shift_rest: np.ndarray, shift_first: np.ndarray, scale: np.ndarray, inv_freq: np.ndarray) -> None:
        self.shift_rest, self.shift_first, self.scale = shift_rest, shift_first, scale  # [KVH, D] each
        self.inv_freq = inv_freq  # [D/2]

    def shift(self, seq_len: int) -> np.ndarray:
        """Each position's centre, rotated to it (rotate-half RoPE)."""
        pos = np.arange(seq_len)
        shift = np.where((pos == 0)[None, :, None, None], self.shift_first, self.shift_rest)
        angle = (pos[:, None] * self.inv_freq)[None, :, None, :]
        low, high = np.split(shift, 2, axis=-1)
        return np.concatenate([low * np.cos(angle) - high * np.sin(angle), high * np.cos(angle) + low * np.sin(angle)], -1)

    def encode(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.shift(x.shape[1])) * self.scale) @ H_D.T


def _group_bound(y: np.ndarray, stored: dict[str, np.ndarray], kv_dtype: str) -> np.ndarray:
    """Bound on ``|dequantized - y|`` per value of the coded ``y``, from the stored per-group metadata."""
    g = q4_group_size(D) if kv_dtype == "q4" else q3_group_size(D)
    grouped = y.reshape(*y.shape[:-1], D // g, g)
    scale = stored["scale"][..., None]
    if kv_dtype == "q4":
        lo, hi = grouped.min(-1, keepdims=True), grouped.max(-1, keepdims=True)
        step = np.where(hi > lo, (hi - lo) / 15.0, 1.0)
        assert np.all(np.abs(scale - step) <= 2**-8 * step + 1e-30), "a q4 step is not the group's (max - min) / 15"
        zero = stored["zero"][..., None]
        slack = np.maximum(zero - lo, 0) + np.maximum(hi - (15 * scale + zero), 0)
        bound = scale / 2 + slack + 1e-6 * (np.abs(lo) + np.abs(hi))
    else:
        levels = np.asarray(Q3_LEVELS, np.float64) * scale[..., None]  # [..., groups, 1, 8]
        bound = np.min(np.abs(grouped[..., None] - levels), axis=-1) + 1e-6 * np.abs(grouped).max(-1, keepdims=True)
        # The step itself: the stored scale is (up to its 3 refits and bf16) the least-squares scale of its codes.
        code_levels = np.asarray(Q3_LEVELS)[np.argmin(np.abs(grouped[..., None] - levels), axis=-1)]
        fitted = np.sum(grouped * code_levels, -1, keepdims=True) / np.sum(code_levels**2, -1, keepdims=True)
        assert np.all(np.abs(scale - fitted) <= 0.25 * fitted + 1e-30), "a q3 scale is not its codes' least-squares scale"
    return np.broadcast_to(bound, grouped.shape).reshape(y.shape)


def check_read(
    got: np.ndarray, ref: np.ndarray, kv_dtype: str, coding: Coding | None, stored: dict[str, np.ndarray]
) -> None:
    """``got`` (read back) against ``ref`` (what was written, f32), both [B, S, KVH, D]."""
    if kv_dtype in ("fp32", "bf16", "fp16"):
        np.testing.assert_array_equal(got, _round(ref, kv_dtype))
        return
    err = np.abs(got.astype(np.float64) - ref)
    amax = np.max(np.abs(ref), axis=-1, keepdims=True)
    if kv_dtype == "fp8":
        bound = np.abs(ref) / 16 + amax / 448 / 1024 + 1e-6 * amax
    else:
        assert coding is not None
        y = coding.encode(ref)
        spread = _group_bound(y, stored, kv_dtype) @ np.abs(H_D).T  # sum_j |H_ij| err_y[j]
        f32_rounding = 1e-5 * (np.abs(y).max(-1, keepdims=True) / coding.scale + np.abs(coding.shift(ref.shape[1])))
        bound = spread / coding.scale + f32_rounding
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
        self.key_codings: list[Coding] = []
        self.store: PageStore | None = None
        self.live: list[Entry] = []

    @initialize(target=caches, kv_dtype=st.sampled_from(KV_DTYPES), seed=st.integers(0, 2**16))
    def start(self, kv_dtype: str, seed: int) -> Entry:
        """A store on a fresh pool; the coded formats get a random key calibration per layer."""
        self.kv_dtype = kv_dtype
        rng = np.random.default_rng(seed)

        def f32(x: np.ndarray) -> np.ndarray:  # the reference codes with the float32 values the cache holds
            return x.astype(np.float32).astype(np.float64)

        self.key_codings = [
            Coding(
                f32(rng.standard_normal((KVH, D))), f32(rng.standard_normal((KVH, D))), f32(rng.uniform(0.25, 4.0, (KVH, D))), f32(INV_FREQ)
            )
            for _ in range(LAYERS)
        ]
        calibration = tuple(
            KeyCalibration(*(jnp.asarray(x, jnp.float32) for x in (c.shift_rest, c.shift_first, c.scale, c.inv_freq)))
            for c in self.key_codings
        )
        config = PagedConfig(LAYERS, KVH, D, PS, kv_dtype, key_calibration=calibration)
        self.store = PageStore(config, BlockPool(BLOCKS, PS))
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
        # The kernel's logits (for q4 folded through the groups' scales and mins) and the reference's
        # round differently, by a few float32 ulps of sum_d |q_d k_d|; the softmax turns a logit error e
        # into at most 2 max|v| e in the output. Keys of magnitude 300 give logits in the thousands.
        v_max = float(jnp.max(jnp.abs(view.v)))
        q_groups = jnp.abs(q).reshape(BATCH, 1, KVH, HEADS // KVH, D)
        logit_mass = float(jnp.max(jnp.einsum("btkgd,bskd->btkgs", q_groups, jnp.abs(view.k)))) / D**0.5
        logit_error = 8 * float(np.finfo(np.float32).eps) * logit_mass
        atol = 1e-4 * (1.0 + v_max) + 2 * v_max * logit_error
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
        coded = self.kv_dtype in CODED_KV_DTYPES
        value_coding = Coding(np.zeros((KVH, D)), np.zeros((KVH, D)), np.ones((KVH, D)), np.zeros(D // 2))
        for e in self.live:
            assert e.cache.seq_len == e.k[0].shape[1]
            for layer in range(LAYERS):
                got = e.cache.get(layer)
                k_stored, v_stored = self._stored(e, layer)
                key_coding = self.key_codings[layer] if coded else None
                check_read(np.asarray(got.k, np.float64), e.k[layer], self.kv_dtype, key_coding, k_stored)
                check_read(np.asarray(got.v, np.float64), e.v[layer], self.kv_dtype, value_coding if coded else None, v_stored)

    def _stored(self, e: Entry, layer: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The stored per-group metadata (q4: scale, zero; q3: scale) of the cache's tokens, each
        [B, S, KVH, groups], for K and V (empty for the other formats)."""
        if self.kv_dtype not in CODED_KV_DTYPES or self.store is None:
            return {}, {}
        n = e.cache.seq_len
        table = np.maximum(e.cache.block_table, 0)
        out = []
        for pages in (float_pages(self.store.k[layer]), float_pages(self.store.v[layer])):
            gathered = {}
            for name in ("scale", "zero"):
                if not hasattr(pages, name):
                    continue
                x = np.asarray(getattr(pages, name), np.float32)[:, table]  # [KVH, B, pps, PS, groups]
                gathered[name] = x.reshape(KVH, BATCH, -1, x.shape[-1]).transpose(1, 2, 0, 3)[:, :n].astype(np.float64)
            out.append(gathered)
        return out[0], out[1]

    def teardown(self) -> None:
        for e in self.live:
            e.cache.release()
        if self.store is not None:
            assert self.store.pool.num_free == BLOCKS, "blocks leaked after every cache was released"


TestPagedCache = PagedCacheMachine.TestCase


# -- the manager: prefix reuse over the shared pool ----------------------------------------------------

M_LAYERS, M_KVH, M_D, M_PS, M_BLOCKS, M_MAX_LEN, M_HANDLES = 2, 1, 4, 2, 10, 12, 4
prompt_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=8)


def kv_of(tokens: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[layers, 1, len, kv_heads, head_dim]`` of ``tokens``: position p's depend on tokens[:p+1]."""
    k = np.zeros((M_LAYERS, 1, len(tokens), M_KVH, M_D), np.float32)
    v = np.zeros_like(k)
    for p in range(len(tokens)):
        rng = np.random.default_rng([p + 1, *tokens[: p + 1]])
        k[:, 0, p], v[:, 0, p] = rng.standard_normal((2, M_LAYERS, M_KVH, M_D)).astype(np.float32)
    return k, v


class LiveSequence:
    """A live handle and the tokens whose K/V it holds."""

    def __init__(self, handle: PagedKVCache, tokens: tuple[int, ...]) -> None:
        self.handle, self.tokens = handle, tokens

    def __repr__(self) -> str:
        return f"LiveSequence({list(self.tokens)})"


class PagedManagerMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        config = PagedConfig(M_LAYERS, M_KVH, M_D, M_PS, "fp32")
        self.manager = PagedKVManager(PageStore(config, BlockPool(M_BLOCKS, M_PS)), max_len=M_MAX_LEN, prefix_cache=True)
        radix = self.manager.radix
        assert radix is not None and self.manager.pool.reclaim == radix.reclaim
        self.radix = radix
        self.live: list[LiveSequence] = []
        self.prompts: list[tuple[int, ...]] = []  # recent prompts, whose prefixes later ones reuse

    def _feed(self, seq: LiveSequence, tokens: tuple[int, ...]) -> bool:
        """Append ``tokens`` to every layer; False (and nothing changed) when the pool has no room."""
        handle, start = seq.handle, seq.handle.seq_len
        if not tokens:
            return True
        k, v = kv_of(seq.tokens + tokens)
        pool = self.manager.pool
        before = (handle.block_table, handle.seq_len, pool.refcounts(), self.radix.num_blocks)
        try:
            handle.update(0, jnp.asarray(k[0, :, start:]), jnp.asarray(v[0, :, start:]))
        except PoolExhaustedError:
            event("feeding hit an exhausted pool")
            after = (handle.block_table, handle.seq_len, pool.refcounts(), self.radix.num_blocks)
            np.testing.assert_array_equal(after[0], before[0])
            np.testing.assert_array_equal(after[2], before[2])
            assert after[1] == before[1] and after[3] == before[3], "a refused allocation changed something"
            return False
        for layer in range(1, M_LAYERS):
            handle.update(layer, jnp.asarray(k[layer, :, start:]), jnp.asarray(v[layer, :, start:]))
        seq.tokens += tokens
        return True

    @precondition(lambda self: len(self.live) < M_HANDLES)
    @rule(target=sequences, tokens=prompt_strategy, base=st.integers(0, 3), repeat=st.booleans())
    def start(self, tokens: list[int], base: int, repeat: bool) -> LiveSequence:
        # Often a recent prompt again, or its first blocks and more: prefixes are shared.
        recent = self.prompts[-base] if 0 < base <= len(self.prompts) else ()
        prompt = recent if recent and repeat else (recent[: 2 * M_PS] + tuple(tokens))[:M_MAX_LEN]
        self.prompts = [*self.prompts[-3:], prompt]
        cached = {entry for entry, _ in self.radix.entries()}
        expected = 0
        while expected + M_PS <= len(prompt) - 1 and prompt[: expected + M_PS] in cached:
            expected += M_PS
        handle = self.manager.new_handle()
        reused = self.manager.match_prefix(handle, prompt)
        assert reused == expected and handle.seq_len == reused, "match_prefix did not reuse the longest cached prefix"
        event("start reused cached blocks" if reused else "start missed")
        seq = LiveSequence(handle, prompt[:reused])
        self.live.append(seq)
        evicted = self.radix.stats.evicted_blocks
        if self._feed(seq, prompt[reused:]) and self.radix.stats.evicted_blocks > evicted:
            event("the pool reclaimed prefix blocks")
        return seq

    @rule(seq=sequences, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def extend(self, seq: LiveSequence, tokens: list[int]) -> None:
        if seq.handle.seq_len + len(tokens) <= M_MAX_LEN:
            self._feed(seq, tuple(tokens))

    @rule(seq=sequences)
    def commit(self, seq: LiveSequence) -> None:
        self.manager.commit_prefix(seq.handle, seq.tokens)
        cached = {entry for entry, _ in self.radix.entries()}
        for end in range(M_PS, len(seq.tokens) + 1, M_PS):
            assert seq.tokens[:end] in cached, "a committed full block is not in the prefix cache"

    @rule(seq=sequences, fraction=st.floats(0.0, 1.0))
    def truncate(self, seq: LiveSequence, fraction: float) -> None:
        n = int(fraction * seq.handle.seq_len)
        seq.handle.truncate(n)
        seq.tokens = seq.tokens[:n]

    @precondition(lambda self: len(self.live) < M_HANDLES)
    @rule(target=sequences, seq=sequences)
    def fork(self, seq: LiveSequence) -> LiveSequence:
        twin = LiveSequence(seq.handle.fork(), seq.tokens)
        self.live.append(twin)
        return twin

    @rule(seq=consumes(sequences))
    def release(self, seq: LiveSequence) -> None:
        seq.handle.release()
        self.live.remove(seq)

    @invariant()
    def handles_read_their_own_tokens(self) -> None:
        for seq in self.live:
            assert seq.handle.seq_len == len(seq.tokens)
            k, v = kv_of(seq.tokens)
            for layer in range(M_LAYERS):
                got = seq.handle.get(layer)
                np.testing.assert_array_equal(np.asarray(got.k), k[layer])
                np.testing.assert_array_equal(np.asarray(got.v), v[layer])

    @invariant()
    def cached_blocks_hold_their_prefixes(self) -> None:
        entries = self.radix.entries()
        if not entries:
            return
        table = np.full((1, M_BLOCKS), -1, np.int32)  # one shape: one compiled read
        table[0, : len(entries)] = [block for _, block in entries]
        for layer in range(M_LAYERS):
            pages_k, pages_v = (np.asarray(x) for x in self.manager.store.view(layer, table))
            for i, (prefix, _) in enumerate(entries):
                k, v = kv_of(prefix)
                np.testing.assert_array_equal(pages_k[0, i * M_PS : (i + 1) * M_PS], k[layer, 0, -M_PS:])
                np.testing.assert_array_equal(pages_v[0, i * M_PS : (i + 1) * M_PS], v[layer, 0, -M_PS:])

    @invariant()
    def pool_counts_every_owner(self) -> None:
        self.manager.pool.check_invariants(owners=[s.handle.owned_blocks() for s in self.live] + [self.radix.blocks()])
        stats = self.radix.stats
        assert stats.inserted_blocks - stats.evicted_blocks == self.radix.num_blocks

    def teardown(self) -> None:
        for seq in self.live:
            seq.handle.release()
        self.radix.clear()
        assert self.manager.pool.num_free == M_BLOCKS, "blocks leaked after every sequence was released"


TestPagedManager = PagedManagerMachine.TestCase
