"""KVCache (flat) and TensorCache (dense) against plain numpy arrays, under random update/truncate/reset/fork.

Both are lossless, so every read must equal the reference exactly. The flat cache's zero-copy claims
are checked too: a full layer's ``get`` returns the buffers themselves, ``numpy_view`` shares the
device buffer's memory on CPU, and arrays handed out earlier keep their values across later writes.
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import jax
import numpy as np
from hypothesis import settings
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zgen.cache.flat import KVCache
from zgen.cache.tensor import TensorCache
from zgen.errors import CacheError

LAYERS, BATCH, KV_HEADS, DIM, CAPACITY = 2, 2, 3, 4, 12
ON_CPU = jax.default_backend() == "cpu"

try:  # property_tests/conftest.py registers "ci"/"thorough" and loads one: inherit it
    settings.get_profile("ci")
    SETTINGS = settings(deadline=None)
except InvalidArgument:  # no shared profiles: keep every property test together well under 3 minutes
    SETTINGS = settings(max_examples=20, stateful_step_count=20, deadline=None)


def _block(rng: np.random.Generator, new: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (BATCH, new, KV_HEADS, DIM)
    return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


class FlatMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = KVCache.allocate(LAYERS, BATCH, CAPACITY, KV_HEADS, DIM)
        empty = np.zeros((BATCH, 0, KV_HEADS, DIM), np.float32)
        self.ref: list[tuple[np.ndarray, np.ndarray]] = [(empty, empty)] * LAYERS
        self.others: list[tuple[KVCache, list[tuple[np.ndarray, np.ndarray]]]] = []
        self.handed_out: list[tuple[jax.Array, np.ndarray]] = []  # (array from a read, its value then)

    def _append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self.cache.update(layer, k, v)
        rk, rv = self.ref[layer]
        self.ref[layer] = (np.concatenate([rk, k], 1), np.concatenate([rv, v], 1))

    @rule(new=st.integers(1, 5), seed=st.integers(0, 2**16))
    def update(self, new: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        blocks = [_block(rng, new) for _ in range(LAYERS)]
        if max(r[0].shape[1] for r in self.ref) + new > CAPACITY:
            with np.testing.assert_raises(CacheError):
                self.cache.update(int(np.argmax([r[0].shape[1] for r in self.ref])), *blocks[0])
            return
        for layer, (k, v) in enumerate(blocks):
            self._append(layer, k, v)

    @rule(new=st.integers(1, 3), seed=st.integers(0, 2**16))
    def update_layer_zero_ahead(self, new: int, seed: int) -> None:
        if self.ref[0][0].shape[1] + new <= CAPACITY:
            self._append(0, *_block(np.random.default_rng(seed), new))

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, self.cache.seq_len), label="n")
        self.cache.truncate(n)
        self.ref = [(k[:, :n], v[:, :n]) for k, v in self.ref]

    @rule()
    def truncate_past_end_is_refused(self) -> None:
        with np.testing.assert_raises(CacheError):
            self.cache.truncate(self.cache.seq_len + 1)

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.ref = [(k[:, :0], v[:, :0]) for k, v in self.ref]

    @precondition(lambda self: len(self.others) < 2)
    @rule()
    def fork(self) -> None:
        self.others.append((self.cache, self.ref))
        self.cache, self.ref = self.cache.fork(), copy.copy(self.ref)

    @precondition(lambda self: len(self.others) > 0)
    @rule()
    def switch(self) -> None:
        other = self.others.pop(0)
        self.others.append((self.cache, self.ref))
        self.cache, self.ref = other

    @rule(layer=st.integers(0, LAYERS - 1))
    def zero_copy_reads(self, layer: int) -> None:
        n = self.cache.layer_len(layer)
        whole = self.cache.buffers(layer)
        assert whole.k.shape == (BATCH, CAPACITY, KV_HEADS, DIM)
        got = self.cache.get(layer)
        if n == CAPACITY:  # a full layer is returned as is
            assert got.k is whole.k and got.v is whole.v
        nk, nv = self.cache.numpy_view(layer)
        if ON_CPU and n > 0:
            assert np.shares_memory(nk, np.asarray(whole.k))
        np.testing.assert_array_equal(nk, self.ref[layer][0])
        np.testing.assert_array_equal(nv, self.ref[layer][1])
        self.handed_out.append((whole.k, np.array(whole.k)))

    @invariant()
    def reads_match_reference(self) -> None:
        for cache, ref in [(self.cache, self.ref), *self.others]:
            assert cache.seq_len == min(k.shape[1] for k, _ in ref)
            for layer, (k, v) in enumerate(ref):
                got = cache.get(layer)
                np.testing.assert_array_equal(np.asarray(got.k), k)
                np.testing.assert_array_equal(np.asarray(got.v), v)
        for array, value in self.handed_out:  # copy-on-write kept earlier reads intact
            np.testing.assert_array_equal(np.asarray(array), value)


class TensorMachine(RuleBasedStateMachine):
    """TensorCache's contract: every step updates all layers in order (seq_len moves on the last)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = TensorCache.allocate(LAYERS, BATCH, CAPACITY, KV_HEADS, DIM, np.dtype(np.float32))
        self.ref = [np.zeros((BATCH, 0, KV_HEADS, DIM), np.float32)] * (2 * LAYERS)

    @rule(new=st.integers(1, 5), seed=st.integers(0, 2**16))
    def update(self, new: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        if self.cache.seq_len + new > CAPACITY:
            with np.testing.assert_raises(CacheError):
                self.cache.update(0, *_block(rng, new))
            return
        for layer in range(LAYERS):
            k, v = _block(rng, new)
            self.cache.update(layer, k, v)
            self.ref[2 * layer] = np.concatenate([self.ref[2 * layer], k], 1)
            self.ref[2 * layer + 1] = np.concatenate([self.ref[2 * layer + 1], v], 1)

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, self.cache.seq_len), label="n")
        self.cache.truncate(n)
        self.ref = [r[:, :n] for r in self.ref]

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.ref = [r[:, :0] for r in self.ref]

    @invariant()
    def reads_match_reference(self) -> None:
        assert self.cache.seq_len == self.ref[0].shape[1]
        for layer in range(LAYERS):
            got = self.cache.get(layer)
            np.testing.assert_array_equal(np.asarray(got.k), self.ref[2 * layer])
            np.testing.assert_array_equal(np.asarray(got.v), self.ref[2 * layer + 1])


FlatMachine.TestCase.settings = SETTINGS
TensorMachine.TestCase.settings = SETTINGS
TestFlatStateMachine = FlatMachine.TestCase
TestTensorStateMachine = TensorMachine.TestCase
