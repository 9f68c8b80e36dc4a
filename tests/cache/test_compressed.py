"""The compressed cache: the lossy truncate rule, errors, its rows as slot handles, and the device state
inside compiled steps.

The random-sequence check against numpy pooling lives in
``property_tests/test_compressed_state_machine.py``; here the device state runs a tiny model's prefill
and the on-device decode loop (:func:`zgen.runtime.step.decode_loop`), compressing inside the jitted loop.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.cache.base import StepRow
from zgen.cache.compressed import CompressedKVState, CompressionStats
from zgen.cache.slots import SlotHandle, SlotKVManager
from zgen.cache.tensor import DenseKVState
from zgen.config import ModelConfig
from zgen.errors import CacheError, ConfigError, PoolExhaustedError
from zgen.graph.decoder import build_decoder
from zgen.runtime.sampling import SamplingConfig, SamplingFlags, SamplingParams, make_row_keys
from zgen.runtime.step import DecodeLoop, ModelSpec, decode_loop, forward

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
CAPACITY = 32

Params = dict[str, jax.Array]


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelSpec, Params]:
    graph = build_decoder(CONFIG)
    rng = np.random.default_rng(1)
    params = {
        name: jnp.asarray(rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 1.0), jnp.float32)
        for name, shape in graph.param_shapes().items()
    }
    return ModelSpec(graph, None), params


def _compressed(chunk: int, raw_slots: int | None = None, batch: int = 2) -> CompressedKVState:
    return CompressedKVState.zeros(
        CONFIG.num_layers, batch, CAPACITY, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32, chunk_size=chunk, raw_slots=raw_slots
    )


_JITTED: dict[int, Callable[..., Any]] = {}


def _prefill_all_rows(spec: ModelSpec, params: Params, state: Any, tokens: np.ndarray, start: int = 0) -> tuple[jax.Array, Any]:
    """Feed ``tokens [B, T]`` at ``start``.. in every row; logits at every position and the new state."""
    step = _JITTED.setdefault(id(spec), jax.jit(partial(forward, spec)))
    batch, length = tokens.shape
    positions = np.broadcast_to(np.arange(start, start + length, dtype=np.int32), (batch, length))
    rows = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
    return step(params, state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(rows))


def test_chunk_longer_than_prompt_equals_dense(tiny: tuple[ModelSpec, Params]) -> None:
    spec, params = tiny
    tokens = np.random.default_rng(0).integers(0, 64, (2, 8)).astype(np.int32)
    dense = DenseKVState.zeros(CONFIG.num_layers, 2, CAPACITY, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)
    want, _ = _prefill_all_rows(spec, params, dense, tokens)
    got, _ = _prefill_all_rows(spec, params, _compressed(chunk=8), tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("raw_slots", [None, 5])
def test_prefill_equals_feeding_tokens_one_by_one(tiny: tuple[ModelSpec, Params], raw_slots: int | None) -> None:
    """A query inside a prefill sees what it would have seen had the tokens come one at a time."""
    spec, params = tiny
    tokens = np.random.default_rng(2).integers(0, 64, (2, 10)).astype(np.int32)
    step = 3 if raw_slots is not None else 10  # a 5-slot ring with chunk 3 takes at most 3 tokens a write
    pieces, state = [], _compressed(chunk=3, raw_slots=raw_slots)
    for start in range(0, 10, step):
        logits, state = _prefill_all_rows(spec, params, state, tokens[:, start : start + step], start)
        pieces.append(np.asarray(logits))
    prefill = np.concatenate(pieces, axis=1)
    state = _compressed(chunk=3)
    for t in range(10):
        logits, state = _prefill_all_rows(spec, params, state, tokens[:, t : t + 1], t)
        np.testing.assert_allclose(prefill[:, t], np.asarray(logits)[:, 0], rtol=2e-5, atol=2e-5)
    # and pooling does change the result once chunks are pooled (it is not dense attention)
    dense = DenseKVState.zeros(CONFIG.num_layers, 2, CAPACITY, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)
    exact, _ = _prefill_all_rows(spec, params, dense, tokens)
    assert not np.allclose(prefill[:, -1], np.asarray(exact)[:, -1], atol=1e-3)


def test_write_larger_than_ring_is_refused_at_trace_time(tiny: tuple[ModelSpec, Params]) -> None:
    spec, params = tiny
    state = _compressed(chunk=3, raw_slots=5)
    assert state.max_write == 3
    with pytest.raises(CacheError, match="at most 3 per write.*prefill in pieces"):
        _prefill_all_rows(spec, params, state, np.zeros((2, 4), np.int32))


def test_decode_loop_compresses_on_device(tiny: tuple[ModelSpec, Params]) -> None:
    """decode_loop (one lax.while_loop) with the compressed state equals a host-driven greedy loop."""
    spec, params = tiny
    batch, prompt_len, new = 2, 5, 9
    prompt = np.random.default_rng(3).integers(0, 64, (batch, prompt_len)).astype(np.int32)
    _, state = _prefill_all_rows(spec, params, _compressed(chunk=2), prompt[:, :-1])

    # The loop feeds the prompt's last token, then each draw: `new` draws fed back and one more drawn.
    draws = new + 1
    configs = [SamplingConfig(temperature=0.0, max_new_tokens=draws)] * batch
    loop = DecodeLoop(
        token=jnp.asarray(prompt[:, -1]),
        position=jnp.full((batch,), prompt_len - 1, jnp.int32),
        done=jnp.zeros((batch,), bool),
        last_step=jnp.full((batch,), draws - 1, jnp.int32),
        stop_ids=jnp.full((batch, 1), -1, jnp.int32),
        keys=jax.random.key_data(make_row_keys([0] * batch)),
        penalties=None,
        out_tokens=jnp.full((batch, draws), -1, jnp.int32),
        out_logprobs=jnp.zeros((batch, draws), jnp.float32),
        step=jnp.asarray(0, jnp.int32),
        max_steps=jnp.asarray(draws, jnp.int32),
        exit_on_finish=jnp.asarray(False),
        done_at_start=jnp.asarray(0, jnp.int32),
    )
    run = jax.jit(partial(decode_loop, spec), static_argnames=("flags",))
    out, final_state = run(
        params, state, loop, SamplingParams.from_configs(configs, 64), flags=SamplingFlags.from_configs(configs, 64)
    )
    assert isinstance(final_state, CompressedKVState)
    assert int(out.step) == draws and bool(jnp.all(out.done))
    on_device = np.asarray(out.out_tokens)

    # the same greedy loop driven from the host, one jitted forward per token
    logits, host = _prefill_all_rows(spec, params, _compressed(chunk=2), prompt)
    next_logits = np.asarray(logits)[:, -1]
    chosen = []
    for t in range(new):
        token = next_logits.argmax(-1).astype(np.int32)
        chosen.append(token)
        logits, host = _prefill_all_rows(spec, params, host, token[:, None], prompt_len + t)
        next_logits = np.asarray(logits)[:, 0]
    chosen.append(next_logits.argmax(-1).astype(np.int32))
    np.testing.assert_array_equal(on_device, np.stack(chosen, axis=1))
    # 5 + 9 = 14 positions written, chunk 2: chunks 0..6 hold two tokens each, on device as on the host
    assert np.asarray(final_state.count[0])[0, :7].tolist() == [2, 2, 2, 2, 2, 2, 2]
    for layer in range(CONFIG.num_layers):
        np.testing.assert_array_equal(np.asarray(final_state.count[layer]), np.asarray(host.count[layer]))
        np.testing.assert_array_equal(np.asarray(final_state.ring_pos[layer]), np.asarray(host.ring_pos[layer]))
        device_view, host_view = final_state.layer_view(layer), host.layer_view(layer)
        np.testing.assert_allclose(np.asarray(device_view.k), np.asarray(host_view.k), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(device_view.v), np.asarray(host_view.v), rtol=1e-5, atol=1e-5)


def test_rewriting_a_position_replaces_it() -> None:
    """Prompt padding written past a row's end is overwritten by the decode tokens, not averaged in."""
    rng = np.random.default_rng(4)
    k = jnp.asarray(rng.normal(size=(1, 6, 2, 8)), jnp.float32)
    pads = jnp.asarray(rng.normal(size=(1, 2, 2, 8)), jnp.float32)
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    direct = _compressed(chunk=4, batch=1).write(0, k, k, positions)
    head = jnp.concatenate([k[:, :4], pads], 1)
    padded = _compressed(chunk=4, batch=1).write(0, head, head, positions)
    padded = padded.write(0, k[:, 4:], k[:, 4:], positions[:, 4:])
    np.testing.assert_allclose(np.asarray(padded.sum_k[0]), np.asarray(direct.sum_k[0]), rtol=1e-6, atol=1e-6)
    assert np.asarray(padded.count[0]).tolist() == np.asarray(direct.count[0]).tolist()


# -- rows of a compressed SlotKVManager -----------------------------------------------------------------


def _manager(chunk: int = 4, rows: int = 2, raw_slots: int | None = None) -> SlotKVManager:
    """A one-layer compressed cache of ``rows`` rows (2 kv heads x 8 dims), positions [0, CAPACITY)."""
    return SlotKVManager(
        "compressed",
        lambda batch, capacity: CompressedKVState.zeros(1, batch, capacity, 2, 8, jnp.float32, chunk_size=chunk, raw_slots=raw_slots),
        num_layers=1,
        max_len=CAPACITY,
        max_slots=rows,
        capacity=CAPACITY,
    )


def _filled(length: int, chunk: int = 4) -> tuple[SlotKVManager, list[SlotHandle], jax.Array]:
    """Two sequences of ``length`` tokens (keys ``k[row]``, values ``-k[row]``) in the rows of one cache."""
    manager = _manager(chunk)
    k = jnp.asarray(np.random.default_rng(5).normal(size=(2, length, 2, 8)), jnp.float32)
    handles = [manager.new_handle() for _ in range(2)]
    for row, handle in enumerate(handles):
        handle.update(0, k[row : row + 1], -k[row : row + 1])
    return manager, handles, k


def _state(manager: SlotKVManager) -> CompressedKVState:
    assert isinstance(manager.state, CompressedKVState)
    return manager.state


def _positions(manager: SlotKVManager, handle: SlotHandle) -> list[int]:
    """Position of each entry ``handle.get(0)`` returns (a pooled entry: its chunk's last token)."""
    assert handle.slot is not None
    return _state(manager).stored_positions(0, handle.slot, handle.seq_len)


def _stats(manager: SlotKVManager, handle: SlotHandle) -> CompressionStats:
    assert handle.slot is not None
    return _state(manager).stats(0, handle.slot, handle.seq_len)


def test_pooling_layout_and_stats() -> None:
    manager, handles, k = _filled(10)
    assert manager.kind == "compressed" and not manager.pages and [h.slot for h in handles] == [0, 1]
    for row, handle in enumerate(handles):
        assert _positions(manager, handle) == [3, 7, 8, 9]  # chunks [0,4) and [4,8) pooled; [8,10) raw
        stats = _stats(manager, handle)
        assert (stats.seq_len, stats.compressed_tokens, stats.raw_tokens, stats.stored_entries, stats.lost_tokens) == (10, 8, 2, 4, 0)
        got = handle.get(0)
        assert got.k.shape == (1, 4, 2, 8)
        np.testing.assert_allclose(np.asarray(got.k[0, 1]), k[row, 4:8].mean(0), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(got.k[0, 2:]), k[row, 8:10])
        np.testing.assert_allclose(np.asarray(got.v[0, 0]), -k[row, 0:4].mean(0), rtol=1e-6)
    # a complete chunk that is still the newest stays raw
    manager, handles, _ = _filled(8)
    assert _positions(manager, handles[0]) == [3, 4, 5, 6, 7]


def test_truncate_inside_a_pooled_chunk_drops_it() -> None:
    manager, handles, _ = _filled(10)
    more = jnp.asarray(np.random.default_rng(6).normal(size=(2, 3, 2, 8)), jnp.float32)
    for row, handle in enumerate(handles):
        handle.truncate(6)
        assert handle.seq_len == 6
        assert _positions(manager, handle) == [3]
        stats = _stats(manager, handle)
        assert (stats.compressed_tokens, stats.raw_tokens, stats.stored_entries, stats.lost_tokens) == (4, 0, 1, 2)
        # the chunk refills from position 6; when pooled it is the mean of the tokens it then holds
        handle.update(0, more[row : row + 1], more[row : row + 1])
        assert _positions(manager, handle) == [3, 7, 8]
        np.testing.assert_allclose(np.asarray(handle.get(0).k[0, 1]), more[row, :2].mean(0), rtol=1e-6)
        assert _stats(manager, handle).lost_tokens == 2


def test_truncate_at_a_boundary_and_in_the_raw_chunk_is_exact() -> None:
    manager, handles, k = _filled(11)
    handle = handles[0]
    handle.truncate(10)  # inside the raw chunk: exact
    assert _positions(manager, handle) == [3, 7, 8, 9]
    np.testing.assert_array_equal(np.asarray(handle.get(0).k[0, 2:]), k[0, 8:10])
    handle.truncate(8)  # at a boundary: the pooled chunk [4, 8) stays pooled although it is now the newest
    assert _positions(manager, handle) == [3, 7]
    assert _stats(manager, handle).lost_tokens == 0
    handle.truncate(8)  # to the current length: no change
    assert _positions(manager, handle) == [3, 7]


def test_errors_say_what_to_do() -> None:
    manager, handles, _ = _filled(5)
    handle = handles[0]
    with pytest.raises(CacheError, match=r"n must be in \[0, seq_len\]"):
        handle.truncate(6)
    with pytest.raises(CacheError, match=r"shaped \[1, new, kv_heads=2, head_dim=8\]"):
        handle.update(0, jnp.zeros((1, 1, 3, 8)), jnp.zeros((1, 1, 3, 8)))
    with pytest.raises(CacheError, match=r"shaped \[1, new, kv_heads=2, head_dim=8\]"):
        handle.update(0, jnp.zeros((2, 1, 2, 8)), jnp.zeros((2, 1, 2, 8)))  # one sequence per handle
    with pytest.raises(CacheError, match=f"holds {CAPACITY} positions"):
        handle.update(0, jnp.zeros((1, CAPACITY, 2, 8)), jnp.zeros((1, CAPACITY, 2, 8)))
    with pytest.raises(CacheError, match=r"layer 3 outside \[0, 1\)"):
        handle.get(3)
    assert handle.seq_len == 5 and _positions(manager, handle) == [3, 4]  # the refused calls changed nothing
    with pytest.raises(PoolExhaustedError, match="all 2 rows"):
        manager.new_handle().reserve(1)
    with pytest.raises(ConfigError, match="cannot mask tokens"):
        manager.step_state([StepRow(handle, 5, 1, masked=np.asarray([0]))], 2, 1)
    with pytest.raises(CacheError, match="raw_slots >= chunk_size"):
        CompressedKVState.zeros(1, 1, 16, 1, 8, jnp.float32, chunk_size=4, raw_slots=3)
    handle.release()
    with pytest.raises(CacheError, match="released"):
        handle.get(0)


def test_rows_are_independent() -> None:
    """What a fork of the old batch handle checked, between rows: a row that grows and a row that is
    cut (lossily, inside a pooled chunk) do not see each other's changes, and a released row is reused."""
    manager, (grown, cut), k = _filled(6)
    more = k[1:2]  # any tokens
    grown.update(0, more[:, :3], more[:, :3])
    cut.truncate(2)
    assert grown.seq_len == 9 and cut.seq_len == 2
    assert _positions(manager, grown) == [3, 7, 8]
    np.testing.assert_allclose(np.asarray(grown.get(0).k[0, 0]), k[0, :4].mean(0), rtol=1e-6)
    assert _positions(manager, cut) == []  # chunk [0, 4) was pooled, so the cut at 2 drops it
    assert _stats(manager, cut).lost_tokens == 2
    cut.release()
    assert manager.slots_in_use == 1
    again = manager.new_handle()
    again.update(0, more[:, :1], -more[:, :1])
    assert again.slot == 1 and _positions(manager, again) == [0]  # the row starts empty
    np.testing.assert_array_equal(np.asarray(again.get(0).k[0]), more[0, :1])
    assert _positions(manager, grown) == [3, 7, 8]
