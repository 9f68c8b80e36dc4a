"""Slot handles of a compressed SlotKVManager against the same chunk pooling done in numpy, under random
update/truncate/reset/release of several handles sharing the manager's rows.

The reference applies the documented rule directly (pool every chunk before the newest token's chunk;
truncate keeps pooled chunks wholly before n and raw tokens before n, drops a pooled chunk n cuts),
and every read — the handle's ``get``, the state's ``stored_positions`` and ``stats`` of the handle's
row, and the device ``attend`` of the tokens just written (every row of the state in the batch, the
others padding) — is checked against it. A row given back and taken by the next sequence starts empty;
a half-written step (layer 0 ahead) counts nothing and refuses a truncate. The raw ring is either the
whole capacity or smaller than it (so it wraps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import event, settings
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from zgen.cache.compressed import CompressedKVState
from zgen.cache.slots import SlotHandle, SlotKVManager
from zgen.errors import CacheError, PoolExhaustedError

# One compilation per (rows, window) instead of one per eager op.
_attend = jax.jit(
    lambda state, q, positions, window: state.attend(1, q, positions, sliding_window=window), static_argnums=(3,)
)

LAYERS, KV_HEADS, HEADS, DIM, CAPACITY, CHUNK = 2, 2, 4, 4, 24, 3
MAX_SLOTS, MAX_HANDLES = 3, 4
MAX_NEW = 5  # tokens per update; the attend check pads its queries to this many

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


class Entry:
    """A live handle and its reference, one :class:`RefLayer` per layer."""

    def __init__(self, handle: SlotHandle) -> None:
        self.handle = handle
        self.ref = [RefLayer(CHUNK) for _ in range(LAYERS)]

    def __repr__(self) -> str:
        return f"Entry(slot={self.handle.slot}, seq_len={self.handle.seq_len})"


class CompressedMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.manager: SlotKVManager | None = None
        self.live: list[Entry] = []

    @initialize(target=handles, raw_slots=st.sampled_from([None, 8]))
    def start(self, raw_slots: int | None) -> Entry:
        """A manager of up to MAX_SLOTS rows; the raw ring holds every position, or 8 (a write of up to 6 tokens)."""
        self.manager = SlotKVManager(
            "compressed",
            lambda rows, capacity: CompressedKVState.zeros(
                LAYERS, rows, capacity, KV_HEADS, DIM, jnp.float32, chunk_size=CHUNK, raw_slots=raw_slots
            ),
            num_layers=LAYERS,
            max_len=CAPACITY,
            max_slots=MAX_SLOTS,
            capacity=CAPACITY,
        )
        return self._new()

    def _new(self) -> Entry:
        assert self.manager is not None
        entry = Entry(self.manager.new_handle())
        self.live.append(entry)
        return entry

    def _state(self) -> CompressedKVState:
        assert self.manager is not None and isinstance(self.manager.state, CompressedKVState)
        return self.manager.state

    def _block(self, rng: np.random.Generator, new: int) -> tuple[np.ndarray, np.ndarray]:
        shape = (1, new, KV_HEADS, DIM)
        return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)

    def _fits(self, entry: Entry, new: int) -> bool:
        assert self.manager is not None
        has_row = entry.handle.slot is not None or self.manager.slots_in_use < MAX_SLOTS
        return has_row and entry.handle.seq_len + new <= CAPACITY

    @precondition(lambda self: len(self.live) < MAX_HANDLES)
    @rule(target=handles)
    def new_handle(self) -> Entry:
        return self._new()

    @rule(entry=handles, new=st.integers(1, MAX_NEW), seed=st.integers(0, 2**16), window=st.sampled_from([None, 2, 5]))
    def update(self, entry: Entry, new: int, seed: int, window: int | None) -> None:
        rng = np.random.default_rng(seed)
        blocks = [self._block(rng, new) for _ in range(LAYERS)]
        if not self._fits(entry, new):
            before = (entry.handle.seq_len, entry.handle.slot)
            with np.testing.assert_raises((CacheError, PoolExhaustedError)):
                entry.handle.update(0, jnp.asarray(blocks[0][0]), jnp.asarray(blocks[0][1]))
            assert (entry.handle.seq_len, entry.handle.slot) == before
            event("update refused (no row, or past the capacity)")
            return
        start = entry.handle.seq_len
        for layer, (k, v) in enumerate(blocks):
            entry.handle.update(layer, jnp.asarray(k), jnp.asarray(v))
            entry.ref[layer].append(k, v)
        # the device attend of the tokens just written, as a step calls it after write: every row of
        # the state in the batch, the rows of other sequences (and the padding) at position -1
        assert entry.handle.slot is not None
        state = self._state()
        rows = state.count[0].shape[0]
        q = rng.normal(size=(rows, MAX_NEW, HEADS, DIM)).astype(np.float32)
        positions = np.full((rows, MAX_NEW), -1, np.int32)
        positions[entry.handle.slot, :new] = np.arange(start, start + new)
        got = np.asarray(_attend(state, q, positions, window))[entry.handle.slot]
        for t in range(new):
            want = reference_attention(q[entry.handle.slot, t][None], entry.ref[1].visible(start + t, window))
            np.testing.assert_allclose(got[t], want[0], rtol=1e-4, atol=1e-4)

    @rule(entry=handles, new=st.integers(1, 3), seed=st.integers(0, 2**16))
    def half_written_step(self, entry: Entry, new: int, seed: int) -> None:
        """Layer 0 ahead of layer 1 within a step: the length does not move, a truncate or a layer given
        other tokens is refused, and finishing the step counts it."""
        if not self._fits(entry, new):
            return
        rng = np.random.default_rng(seed)
        blocks = [self._block(rng, new) for _ in range(LAYERS)]
        length = entry.handle.seq_len
        entry.handle.update(0, jnp.asarray(blocks[0][0]), jnp.asarray(blocks[0][1]))
        entry.ref[0].append(*blocks[0])
        assert entry.handle.seq_len == length
        with np.testing.assert_raises(CacheError):
            entry.handle.truncate(length)
        with np.testing.assert_raises(CacheError):
            entry.handle.update(1, jnp.asarray(blocks[1][0][:, :0]), jnp.asarray(blocks[1][1][:, :0]))
        entry.handle.update(1, jnp.asarray(blocks[1][0]), jnp.asarray(blocks[1][1]))
        entry.ref[1].append(*blocks[1])

    @rule(entry=handles, data=st.data())
    def truncate(self, entry: Entry, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, entry.handle.seq_len), label="n")
        entry.handle.truncate(n)
        for r in entry.ref:
            r.truncate(n)

    @rule(entry=handles)
    def reset(self, entry: Entry) -> None:
        entry.handle.reset()
        entry.ref = [RefLayer(CHUNK) for _ in range(LAYERS)]

    @precondition(lambda self: len(self.live) > 1)
    @rule(entry=consumes(handles))
    def release(self, entry: Entry) -> None:
        entry.handle.release()
        self.live.remove(entry)
        with np.testing.assert_raises(CacheError):
            entry.handle.get(0)

    @invariant()
    def reads_match_reference(self) -> None:
        slots = [e.handle.slot for e in self.live if e.handle.slot is not None]
        assert len(set(slots)) == len(slots), "two sequences share a row"
        for e in self.live:
            assert e.handle.seq_len == min(r.length for r in e.ref)
            if e.handle.slot is None:
                assert e.handle.seq_len == 0
                continue
            state, row, length = self._state(), e.handle.slot, e.handle.seq_len
            for layer in range(LAYERS):
                ref = e.ref[layer]
                entries = ref.entries()
                assert state.stored_positions(layer, row, length) == [p for p, _, _ in entries]
                stats = state.stats(layer, row, length)
                assert stats.seq_len == ref.length
                assert stats.stored_entries == len(entries)
                assert stats.raw_tokens == len(ref.raw)
                assert stats.compressed_tokens == sum(n for _, _, n in ref.pooled.values())
                assert stats.compressed_chunks == len(ref.pooled)
                assert stats.lost_tokens == ref.length - stats.compressed_tokens - stats.raw_tokens
                got = e.handle.get(layer)
                assert got.k.shape == (1, len(entries), KV_HEADS, DIM)
                if entries:
                    np.testing.assert_allclose(np.asarray(got.k), np.stack([k for _, k, _ in entries], 1), rtol=1e-5, atol=1e-5)
                    np.testing.assert_allclose(np.asarray(got.v), np.stack([v for _, _, v in entries], 1), rtol=1e-5, atol=1e-5)

    @invariant()
    def rows_hold_nothing_stale(self) -> None:
        """Each row's chunk counts add up to exactly the tokens its sequence stores, and its ring names no
        position past the sequence's end; a row no sequence holds (never taken, released, reset) is empty.
        A rewrite at the same position replaces its earlier value, so stale tokens would otherwise only
        show once a later sequence pools a chunk they sit in."""
        if self.manager is None or self.manager.state is None:
            return
        state = self._state()
        held = {e.handle.slot: e for e in self.live if e.handle.slot is not None}
        for row in range(state.count[0].shape[0]):
            for layer in range(LAYERS):
                counts = np.asarray(state.count[layer])[row]
                ring = np.asarray(state.ring_pos[layer])[row]
                entry = held.get(row)
                if entry is None:
                    assert counts.sum() == 0 and (ring == -1).all(), f"row {row} holds tokens of a finished sequence"
                    continue
                ref = entry.ref[layer]
                assert counts.sum() == len(ref.raw) + sum(n for _, _, n in ref.pooled.values())
                assert (ring < ref.length).all(), f"row {row} keeps a token past its sequence's end"

    def teardown(self) -> None:
        for e in self.live:
            e.handle.release()
        if self.manager is not None:
            assert self.manager.slots_in_use == 0


CompressedMachine.TestCase.settings = SETTINGS
TestCompressedStateMachine = CompressedMachine.TestCase
