"""Slot handles of a ``tensor`` and a ``flat`` SlotKVManager against plain numpy arrays.

Several handles share one manager (more handles than rows, so a row is sometimes refused), under random
updates through the ``CacheProvider`` surface, steps as the runtime runs them (``reserve``, the
manager's ``step_state``, a compiled write of every layer, ``absorb``), half-written steps, truncates,
resets and releases. Rows and capacity grow as sequences arrive and lengthen (``tensor``: capacity by
powers of two up to the context; ``flat``: the whole context from the start).

Both kinds are lossless, so every read must equal the reference exactly; arrays that reads handed out
earlier keep their values across later writes, truncates and growth (the manager donates its state to
compiled updates); a released row is free for the next sequence and no write reaches another row.
"""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import event, settings
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from zgen.cache.base import StepRow
from zgen.cache.slots import SlotHandle, SlotKVManager
from zgen.cache.tensor import DenseKVState
from zgen.errors import CacheError, PoolExhaustedError

LAYERS, KV_HEADS, DIM, MAX_LEN = 2, 3, 4, 12
MAX_SLOTS, MIN_CAPACITY, MAX_HANDLES = 3, 4, 4
STEP_TOKENS = 4  # a step's width in tokens (rows feeding fewer are padded at position -1)

try:  # property_tests/conftest.py registers "ci"/"thorough" and loads one: inherit it
    settings.get_profile("ci")
    SETTINGS = settings(deadline=None)
except InvalidArgument:  # no shared profiles: keep every property test together well under 3 minutes
    SETTINGS = settings(max_examples=20, stateful_step_count=20, deadline=None)


@jax.jit
def _write_every_layer(state: DenseKVState, k: jax.Array, v: jax.Array, positions: jax.Array) -> DenseKVState:
    """What a compiled step does to the state: write each layer's K/V at the rows' positions."""
    for layer in range(LAYERS):
        state = state.write(layer, k[layer], v[layer], positions)
    return state


def _tokens(rng: np.random.Generator, lead: tuple[int, ...]) -> np.ndarray:
    return rng.normal(size=(*lead, KV_HEADS, DIM)).astype(np.float32)


class Entry:
    """A live handle and what it must hold: per layer K and V ``[1, seq_len, KV_HEADS, DIM]``."""

    def __init__(self, handle: SlotHandle) -> None:
        self.handle = handle
        self.k = [np.zeros((1, 0, KV_HEADS, DIM), np.float32) for _ in range(LAYERS)]
        self.v = [np.zeros((1, 0, KV_HEADS, DIM), np.float32) for _ in range(LAYERS)]

    def append(self, k: list[np.ndarray], v: list[np.ndarray]) -> None:
        self.k = [np.concatenate([old, new], 1) for old, new in zip(self.k, k, strict=True)]
        self.v = [np.concatenate([old, new], 1) for old, new in zip(self.v, v, strict=True)]

    def cut(self, n: int) -> None:
        self.k, self.v = [x[:, :n] for x in self.k], [x[:, :n] for x in self.v]

    def __repr__(self) -> str:
        return f"Entry(slot={self.handle.slot}, seq_len={self.handle.seq_len})"


class SlotMachine(RuleBasedStateMachine):
    """The rules and invariants of both kinds; a subclass names its kind."""

    kind = ""
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.manager: SlotKVManager | None = None
        self.live: list[Entry] = []
        self.handed_out: list[tuple[jax.Array, np.ndarray]] = []  # (array from a read, its value then)

    @initialize(target=handles)
    def start(self) -> Entry:
        self.manager = SlotKVManager(
            self.kind,
            lambda rows, capacity: DenseKVState.zeros(LAYERS, rows, capacity, KV_HEADS, DIM, jnp.float32),
            num_layers=LAYERS,
            max_len=MAX_LEN,
            max_slots=MAX_SLOTS,
            capacity=MAX_LEN if self.kind == "flat" else None,
            min_capacity=MIN_CAPACITY,
        )
        return self._new()

    def _new(self) -> Entry:
        assert self.manager is not None
        entry = Entry(self.manager.new_handle())
        self.live.append(entry)
        return entry

    def _snapshot(self, entry: Entry) -> tuple[int, int | None, int, int]:
        assert self.manager is not None
        return entry.handle.seq_len, entry.handle.slot, self.manager.slots_in_use, self.manager.capacity

    @precondition(lambda self: len(self.live) < MAX_HANDLES)
    @rule(target=handles)
    def new_handle(self) -> Entry:
        return self._new()

    @rule(entry=handles, new=st.integers(1, 5), seed=st.integers(0, 2**16))
    def update(self, entry: Entry, new: int, seed: int) -> None:
        """Append ``new`` tokens to every layer in order (the CacheProvider surface)."""
        rng = np.random.default_rng(seed)
        k, v = _tokens(rng, (LAYERS, 1, new)), _tokens(rng, (LAYERS, 1, new))
        before = self._snapshot(entry)
        try:
            entry.handle.update(0, k[0], v[0])
        except PoolExhaustedError:
            assert before[1] is None and before[2] == MAX_SLOTS, "a row was refused while one was free"
            event("update found every row taken")
            assert self._snapshot(entry) == before
            return
        except CacheError:
            assert entry.handle.seq_len + new > MAX_LEN, "an update within the context was refused"
            event("update past the context refused")
            assert self._snapshot(entry) == before
            return
        for layer in range(1, LAYERS):
            entry.handle.update(layer, k[layer], v[layer])
        entry.append(list(k), list(v))

    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def step(self, data: st.DataObject, seed: int) -> None:
        """One compiled step over some handles, as the runtime runs it: each reserves the tokens it feeds
        (a handle refused a row or room sits the step out, unchanged), the manager lays out the step's
        state, a compiled write fills every layer (other rows feed position -1), the manager takes it back."""
        assert self.manager is not None
        chosen = data.draw(st.lists(st.sampled_from(self.live), min_size=1, max_size=3, unique_by=id), label="handles")
        rng = np.random.default_rng(seed)
        fed: list[tuple[Entry, int, int]] = []  # (entry, start, count)
        for entry in chosen:
            count = data.draw(st.integers(1, STEP_TOKENS), label="count")
            before = self._snapshot(entry)
            try:
                entry.handle.reserve(count)
            except (PoolExhaustedError, CacheError):
                event("a handle sat a step out")
                assert self._snapshot(entry) == before
                continue
            fed.append((entry, before[0], count))
        if not fed:
            return
        handles = [entry.handle for entry, _, _ in fed]
        width, index = self.manager.layout(handles)
        assert index == [h.slot for h in handles] and width > max(index)  # every row of the state, each at its slot
        rows = [StepRow(entry.handle, start, count) for entry, start, count in fed]
        state = self.manager.step_state(rows, width, STEP_TOKENS)
        assert isinstance(state, DenseKVState) and state.capacity >= max(h.seq_len for h in handles)
        k, v = _tokens(rng, (LAYERS, width, STEP_TOKENS)), _tokens(rng, (LAYERS, width, STEP_TOKENS))
        positions = np.full((width, STEP_TOKENS), -1, np.int32)
        for (entry, start, count), row in zip(fed, index, strict=True):
            positions[row, :count] = np.arange(start, start + count)
            entry.append([k[layer, row : row + 1, :count] for layer in range(LAYERS)], [v[layer, row : row + 1, :count] for layer in range(LAYERS)])
        self.manager.absorb(_write_every_layer(state, jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions)))

    @rule(entry=handles, new=st.integers(1, 3), seed=st.integers(0, 2**16), data=st.data())
    def half_written_step(self, entry: Entry, new: int, seed: int, data: st.DataObject) -> None:
        """Layer 0 written, the others not yet: nothing counts until the last layer is; a layer given
        other tokens than layer 0, or a truncate, is refused; then the step completes."""
        assert self.manager is not None
        if entry.handle.seq_len + new > MAX_LEN or (entry.handle.slot is None and self.manager.slots_in_use == MAX_SLOTS):
            return
        rng = np.random.default_rng(seed)
        k, v = _tokens(rng, (LAYERS, 1, new)), _tokens(rng, (LAYERS, 1, new))
        length = entry.handle.seq_len
        entry.handle.update(0, k[0], v[0])
        assert entry.handle.seq_len == length
        layer = data.draw(st.integers(1, LAYERS - 1), label="layer")
        with np.testing.assert_raises(CacheError):
            entry.handle.update(layer, k[layer][:, : new - 1], v[layer][:, : new - 1])
        with np.testing.assert_raises(CacheError):
            entry.handle.truncate(length)
        for layer in range(LAYERS):  # what is counted has not moved
            np.testing.assert_array_equal(np.asarray(entry.handle.get(layer).k), entry.k[layer])
        for layer in range(1, LAYERS):
            entry.handle.update(layer, k[layer], v[layer])
        entry.append(list(k), list(v))

    @rule(entry=handles, data=st.data())
    def truncate(self, entry: Entry, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, entry.handle.seq_len), label="n")
        entry.handle.truncate(n)
        entry.cut(n)

    @rule(entry=handles)
    def truncate_past_end_is_refused(self, entry: Entry) -> None:
        with np.testing.assert_raises(CacheError):
            entry.handle.truncate(entry.handle.seq_len + 1)

    @rule(entry=handles)
    def reset(self, entry: Entry) -> None:
        entry.handle.reset()
        assert entry.handle.slot is None and entry.handle.seq_len == 0
        entry.cut(0)

    @precondition(lambda self: len(self.live) > 1)
    @rule(entry=consumes(handles))
    def release(self, entry: Entry) -> None:
        entry.handle.release()
        entry.handle.release()  # idempotent
        self.live.remove(entry)
        with np.testing.assert_raises(CacheError):
            entry.handle.get(0)
        with np.testing.assert_raises(CacheError):
            entry.handle.reserve(1)

    @rule(entry=handles, layer=st.integers(0, LAYERS - 1))
    def keep_a_read(self, entry: Entry, layer: int) -> None:
        if entry.handle.slot is not None:
            got = entry.handle.get(layer)
            self.handed_out += [(got.k, np.array(got.k)), (got.v, np.array(got.v))]

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def reads_match_reference(self) -> None:
        for e in self.live:
            assert e.handle.seq_len == e.k[0].shape[1]
            if e.handle.slot is None:
                assert e.handle.seq_len == 0
                with np.testing.assert_raises(CacheError):
                    e.handle.get(0)
                continue
            for layer in range(LAYERS):
                got = e.handle.get(layer)
                np.testing.assert_array_equal(np.asarray(got.k), e.k[layer])
                np.testing.assert_array_equal(np.asarray(got.v), e.v[layer])
        for array, value in self.handed_out:  # earlier reads are unaffected by what came after
            np.testing.assert_array_equal(np.asarray(array), value)

    @invariant()
    def rows_and_capacity(self) -> None:
        if self.manager is None:
            return
        slots = [e.handle.slot for e in self.live if e.handle.slot is not None]
        assert len(set(slots)) == len(slots), "two sequences share a row"
        assert self.manager.slots_in_use == len(slots), "a released or reset handle kept its row"
        state = self.manager.state
        if state is None:
            assert not slots
            return
        assert isinstance(state, DenseKVState)
        rows = state.k[0].shape[0]
        assert rows <= MAX_SLOTS and all(slot < rows for slot in slots)
        assert rows in (1, 2, MAX_SLOTS), "rows grow by powers of two up to max_slots"
        capacity = self.manager.capacity
        assert capacity == state.capacity and max((e.handle.seq_len for e in self.live), default=0) <= capacity <= MAX_LEN
        if self.kind == "flat":
            assert capacity == MAX_LEN
        else:
            assert capacity in (MIN_CAPACITY, 2 * MIN_CAPACITY, MAX_LEN), "capacity grows by powers of two up to max_len"

    def teardown(self) -> None:
        for e in self.live:
            e.handle.release()
        if self.manager is not None:
            assert self.manager.slots_in_use == 0


class TensorMachine(SlotMachine):
    kind = "tensor"


class FlatMachine(SlotMachine):
    kind = "flat"


TensorMachine.TestCase.settings = SETTINGS
FlatMachine.TestCase.settings = SETTINGS
TestTensorStateMachine = TensorMachine.TestCase
TestFlatStateMachine = FlatMachine.TestCase
