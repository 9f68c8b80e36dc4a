"""CompressedKVCache against the same chunk pooling done in numpy, under random update/truncate/reset/fork.

The reference applies the documented rule directly (pool every chunk before the newest token's chunk;
truncate keeps pooled chunks wholly before n and raw tokens before n, drops a pooled chunk n cuts),
and every read — ``get``, ``positions``, ``stats`` and the device ``attend`` of the tokens just
written — is checked against it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import hypothesis.strategies as st
import jax
import numpy as np
from hypothesis import settings
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zgen.cache.compressed import CompressedKVCache

# One compilation per (new tokens, window) instead of one per eager op.
_attend = jax.jit(
    lambda state, q, positions, window: state.attend(1, q, positions, sliding_window=window), static_argnums=(3,)
)

LAYERS, BATCH, KV_HEADS, HEADS, DIM, CAPACITY = 2, 2, 2, 4, 4, 24

try:  # property_tests/conftest.py registers "ci"/"thorough" and loads one: inherit it
    settings.get_profile("ci")
    SETTINGS = settings(deadline=None)
except InvalidArgument:  # no shared profiles: keep every property test together well under 3 minutes
    SETTINGS = settings(max_examples=20, stateful_step_count=20, deadline=None)


@dataclass
class RefLayer:
    chunk: int
    length: int = 0
    pooled: dict[int, tuple[np.ndarray, np.ndarray, int]] = field(default_factory=dict)  # chunk -> (k, v, n)
    raw: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # position -> (k, v)
    history: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # every token not lost

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        for t in range(k.shape[1]):
            pos = self.length + t
            self.raw[pos] = (k[:, t], v[:, t])
            self.history[pos] = (k[:, t], v[:, t])
        self.length += k.shape[1]
        recent = (self.length - 1) // self.chunk
        for c in sorted({p // self.chunk for p in self.raw if p // self.chunk < recent}):
            members = [p for p in self.raw if p // self.chunk == c]
            ks = np.stack([self.raw[p][0] for p in members]).astype(np.float64)
            vs = np.stack([self.raw[p][1] for p in members]).astype(np.float64)
            self.pooled[c] = (ks.mean(0), vs.mean(0), len(members))
            for p in members:
                del self.raw[p]

    def truncate(self, n: int) -> None:
        for c in list(self.pooled):
            if (c + 1) * self.chunk > n:
                del self.pooled[c]
                for p in range(c * self.chunk, (c + 1) * self.chunk):
                    self.history.pop(p, None)
        self.raw = {p: kv for p, kv in self.raw.items() if p < n}
        self.history = {p: kv for p, kv in self.history.items() if p < n}
        self.length = n

    def entries(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        size = self.chunk
        out = [(c * size + size - 1, k, v) for c, (k, v, _) in self.pooled.items()]
        out += [(p, k, v) for p, (k, v) in self.raw.items()]
        return sorted(out, key=lambda e: e[0])

    def visible(self, p: int, window: int | None) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """What a query at ``p`` (written in the latest update) sees."""
        size = self.chunk
        own = p // size
        out = [(c * size + size - 1, k, v) for c, (k, v, _) in self.pooled.items() if c < own]
        out += [(q, k, v) for q, (k, v) in self.history.items() if q // size == own and q <= p]
        if window is not None:
            out = [e for e in out if e[0] > p - window]
        return out


def reference_attention(q: np.ndarray, entries: list[tuple[int, np.ndarray, np.ndarray]]) -> np.ndarray:
    """q [B, H, D] over entries of ([B, KVH, D], [B, KVH, D]) -> [B, H, D]."""
    if not entries:
        return np.zeros_like(q)
    k = np.stack([e[1] for e in entries], axis=1).astype(np.float64)  # [B, S, KVH, D]
    v = np.stack([e[2] for e in entries], axis=1).astype(np.float64)
    group = q.shape[1] // k.shape[2]
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    scores = np.einsum("bhd,bshd->bhs", q.astype(np.float64), k) / math.sqrt(q.shape[-1])
    scores -= scores.max(-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhs,bshd->bhd", weights, v)


class CompressedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.chunk = 3
        self.cache = CompressedKVCache.allocate(LAYERS, BATCH, CAPACITY, KV_HEADS, DIM, chunk_size=self.chunk)
        self.ref = [RefLayer(self.chunk) for _ in range(LAYERS)]
        self.others: list[tuple[CompressedKVCache, list[RefLayer]]] = []  # forks, checked too
        self.rng = np.random.default_rng(0)

    def _len(self) -> int:
        return min(r.length for r in self.ref)

    def _block(self, new: int) -> tuple[np.ndarray, np.ndarray]:
        shape = (BATCH, new, KV_HEADS, DIM)
        return self.rng.normal(size=shape).astype(np.float32), self.rng.normal(size=shape).astype(np.float32)

    @rule(new=st.integers(1, 5), seed=st.integers(0, 2**16), window=st.sampled_from([None, 2, 5]))
    def update(self, new: int, seed: int, window: int | None) -> None:
        lengths = {r.length for r in self.ref}
        if len(lengths) != 1 or lengths.pop() + new > CAPACITY:
            return
        self.rng = np.random.default_rng(seed)
        for layer in range(LAYERS):
            k, v = self._block(new)
            self.cache.update(layer, k, v)
            self.ref[layer].append(k, v)
        # the device attend of the tokens just written, as the plan calls it after write
        start = self._len() - new
        q = self.rng.normal(size=(BATCH, new, HEADS, DIM)).astype(np.float32)
        positions = np.broadcast_to(np.arange(start, start + new, dtype=np.int32), (BATCH, new))
        got = np.asarray(_attend(self.cache.state, q, positions, window))
        for t in range(new):
            want = reference_attention(q[:, t], self.ref[1].visible(start + t, window))
            np.testing.assert_allclose(got[:, t], want, rtol=1e-4, atol=1e-4)

    @rule(new=st.integers(1, 3), seed=st.integers(0, 2**16))
    def update_layer_zero_ahead(self, new: int, seed: int) -> None:
        if self.ref[0].length + new > CAPACITY:
            return
        self.rng = np.random.default_rng(seed)
        k, v = self._block(new)
        self.cache.update(0, k, v)
        self.ref[0].append(k, v)

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, self._len()), label="n")
        self.cache.truncate(n)
        for r in self.ref:
            r.truncate(n)

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.ref = [RefLayer(self.chunk) for _ in range(LAYERS)]

    @precondition(lambda self: len(self.others) < 2)
    @rule()
    def fork(self) -> None:
        self.others.append((self.cache, self.ref))
        self.cache, self.ref = self.cache.fork(), copy.deepcopy(self.ref)

    @precondition(lambda self: len(self.others) > 0)
    @rule()
    def switch(self) -> None:
        other = self.others.pop(0)
        self.others.append((self.cache, self.ref))
        self.cache, self.ref = other

    @invariant()
    def reads_match_reference(self) -> None:
        for cache, ref in [(self.cache, self.ref), *self.others]:
            assert cache.seq_len == min(r.length for r in ref)
            for layer in range(LAYERS):
                entries = ref[layer].entries()
                assert cache.positions(layer) == [e[0] for e in entries]
                stats = cache.stats(layer)
                assert stats.seq_len == ref[layer].length
                assert stats.stored_entries == len(entries)
                assert stats.raw_tokens == len(ref[layer].raw)
                assert stats.compressed_tokens == sum(n for _, _, n in ref[layer].pooled.values())
                assert stats.lost_tokens == ref[layer].length - stats.compressed_tokens - stats.raw_tokens
                got = cache.get(layer)
                assert got.k.shape == (BATCH, len(entries), KV_HEADS, DIM)
                if entries:
                    np.testing.assert_allclose(np.asarray(got.k), np.stack([e[1] for e in entries], 1), rtol=1e-5, atol=1e-5)
                    np.testing.assert_allclose(np.asarray(got.v), np.stack([e[2] for e in entries], 1), rtol=1e-5, atol=1e-5)


CompressedMachine.TestCase.settings = SETTINGS
TestCompressedStateMachine = CompressedMachine.TestCase
