"""CompressedKVCache: the lossy truncate rule, errors, and the device state inside compiled plans.

The random-sequence check against numpy pooling lives in
``property_tests/test_compressed_state_machine.py``; here the device state runs a tiny model's prefill
and the on-device decode loop (``ExecutionPlan.decode``), compressing inside the jitted loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.cache.compressed import CompressedBackend, CompressedKVCache, CompressedKVState
from zgen.cache.tensor import DenseKVState
from zgen.config import ModelConfig
from zgen.errors import CacheError
from zgen.graph.decoder import build_decoder
from zgen.graph.plan import DecodeState, ExecutionPlan
from zgen.sampling import SamplingConfig, SamplingFlags, SamplingParams, make_row_keys

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


@pytest.fixture(scope="module")
def tiny() -> tuple[ExecutionPlan, dict[str, jax.Array]]:
    graph = build_decoder(CONFIG)
    rng = np.random.default_rng(1)
    params = {
        name: jnp.asarray(rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 1.0), jnp.float32)
        for name, shape in graph.param_shapes().items()
    }
    return ExecutionPlan(graph, None), params


def _compressed(chunk: int, raw_slots: int | None = None, batch: int = 2) -> CompressedKVState:
    return CompressedBackend(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, chunk, raw_slots=raw_slots).allocate(
        batch, CAPACITY
    )


_JITTED: dict[int, object] = {}


def _forward(plan: ExecutionPlan, *args: object):  # type: ignore[no-untyped-def]
    fn = _JITTED.setdefault(id(plan), jax.jit(plan.forward))
    return fn(*args)  # type: ignore[operator]


def _prefill_all_rows(plan, params, state, tokens: np.ndarray, start: int = 0):  # type: ignore[no-untyped-def]
    batch, length = tokens.shape
    positions = np.broadcast_to(np.arange(start, start + length, dtype=np.int32), (batch, length))
    rows = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
    return _forward(plan, params, state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(rows))


def test_chunk_longer_than_prompt_equals_dense(tiny) -> None:  # type: ignore[no-untyped-def]
    plan, params = tiny
    tokens = np.random.default_rng(0).integers(0, 64, (2, 8)).astype(np.int32)
    dense = DenseKVState.zeros(CONFIG.num_layers, 2, CAPACITY, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)
    want, _ = _prefill_all_rows(plan, params, dense, tokens)
    got, _ = _prefill_all_rows(plan, params, _compressed(chunk=8), tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("raw_slots", [None, 5])
def test_prefill_equals_feeding_tokens_one_by_one(tiny, raw_slots: int | None) -> None:  # type: ignore[no-untyped-def]
    """A query inside a prefill sees what it would have seen had the tokens come one at a time."""
    plan, params = tiny
    tokens = np.random.default_rng(2).integers(0, 64, (2, 10)).astype(np.int32)
    step = 3 if raw_slots is not None else 10  # a 5-slot ring with chunk 3 takes at most 3 tokens a write
    pieces, state = [], _compressed(chunk=3, raw_slots=raw_slots)
    for start in range(0, 10, step):
        logits, state = _prefill_all_rows(plan, params, state, tokens[:, start : start + step], start)
        pieces.append(np.asarray(logits))
    prefill = np.concatenate(pieces, axis=1)
    state = _compressed(chunk=3)
    for t in range(10):
        logits, state = _prefill_all_rows(plan, params, state, tokens[:, t : t + 1], t)
        np.testing.assert_allclose(prefill[:, t], np.asarray(logits)[:, 0], rtol=2e-5, atol=2e-5)
    # and pooling does change the result once chunks are pooled (it is not dense attention)
    dense = DenseKVState.zeros(CONFIG.num_layers, 2, CAPACITY, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)
    exact, _ = _prefill_all_rows(plan, params, dense, tokens)
    assert not np.allclose(prefill[:, -1], np.asarray(exact)[:, -1], atol=1e-3)


def test_write_larger_than_ring_is_refused_at_trace_time(tiny) -> None:  # type: ignore[no-untyped-def]
    plan, params = tiny
    state = _compressed(chunk=3, raw_slots=5)
    assert state.max_write == 3
    with pytest.raises(CacheError, match="at most 3 per write.*prefill in pieces"):
        _prefill_all_rows(plan, params, state, np.zeros((2, 4), np.int32))


def test_decode_loop_compresses_on_device(tiny) -> None:  # type: ignore[no-untyped-def]
    """ExecutionPlan.decode (one lax.while_loop) with the compressed state equals a host-driven greedy loop."""
    plan, params = tiny
    batch, prompt_len, new = 2, 5, 9
    prompt = np.random.default_rng(3).integers(0, 64, (batch, prompt_len)).astype(np.int32)
    positions = np.broadcast_to(np.arange(prompt_len, dtype=np.int32), (batch, prompt_len))
    last = np.full((batch, 1), prompt_len - 1, np.int32)
    logits, state = plan.prefill(params, _compressed(chunk=2), jnp.asarray(prompt), jnp.asarray(positions), jnp.asarray(last))

    configs = [SamplingConfig(temperature=0.0, max_new_tokens=new)] * batch
    decode_state = DecodeState(
        logits=logits[:, 0],
        positions=jnp.full((batch,), prompt_len, jnp.int32),
        step=jnp.asarray(0, jnp.int32),
        finished=jnp.zeros((batch,), bool),
        tokens=jnp.zeros((batch, 16), jnp.int32),
        logprobs=jnp.zeros((batch, 16), jnp.float32),
        row_keys=make_row_keys([0] * batch),
        penalties=None,
        max_new_tokens=jnp.full((batch,), new, jnp.int32),
        stop_ids=jnp.full((batch, 1), -1, jnp.int32),
    )
    out, final_state = plan.decode(
        params, state, decode_state, SamplingParams.from_configs(configs, 64), new, SamplingFlags.from_configs(configs, 64)
    )
    assert isinstance(final_state, CompressedKVState)
    on_device = np.asarray(out.tokens)[:, :new]

    # the same greedy loop driven from the host, one jitted forward per token
    host = _compressed(chunk=2)
    logits, host = _prefill_all_rows(plan, params, host, prompt)
    next_logits = np.asarray(logits)[:, -1]
    chosen = []
    for t in range(new):
        token = next_logits.argmax(-1).astype(np.int32)
        chosen.append(token)
        logits, host = _prefill_all_rows(plan, params, host, token[:, None], prompt_len + t)
        next_logits = np.asarray(logits)[:, 0]
    np.testing.assert_array_equal(on_device, np.stack(chosen, axis=1))
    # 5 + 9 = 14 positions written, chunk 2: chunks 0..5 pooled (two tokens each) on device
    assert np.asarray(final_state.count[0])[0, :7].tolist() == [2, 2, 2, 2, 2, 2, 2]


def test_rewriting_a_position_replaces_it() -> None:
    """Prompt padding written past a row's end is overwritten by the decode tokens, not averaged in."""
    rng = np.random.default_rng(4)
    k = rng.normal(size=(1, 6, 2, 8)).astype(np.float32)
    pads = rng.normal(size=(1, 2, 2, 8)).astype(np.float32)
    positions = np.arange(6, dtype=np.int32)[None]
    direct = _compressed(chunk=4, batch=1).write(0, k, k, positions)
    padded = _compressed(chunk=4, batch=1).write(0, np.concatenate([k[:, :4], pads], 1), np.concatenate([k[:, :4], pads], 1), positions)
    padded = padded.write(0, k[:, 4:], k[:, 4:], positions[:, 4:])
    np.testing.assert_allclose(np.asarray(padded.sum_k[0]), np.asarray(direct.sum_k[0]), rtol=1e-6, atol=1e-6)
    assert np.asarray(padded.count[0]).tolist() == np.asarray(direct.count[0]).tolist()


def _filled(length: int, chunk: int = 4) -> tuple[CompressedKVCache, np.ndarray]:
    cache = CompressedKVCache.allocate(1, 2, CAPACITY, 2, 8, chunk_size=chunk)
    k = np.random.default_rng(5).normal(size=(2, length, 2, 8)).astype(np.float32)
    cache.update(0, k, -k)
    return cache, k


def test_pooling_layout_and_stats() -> None:
    cache, k = _filled(10)
    assert cache.positions(0) == [3, 7, 8, 9]  # chunks [0,4) and [4,8) pooled; [8,10) raw
    stats = cache.stats()
    assert (stats.seq_len, stats.compressed_tokens, stats.raw_tokens, stats.stored_entries, stats.lost_tokens) == (10, 8, 2, 4, 0)
    got = cache.get(0)
    np.testing.assert_allclose(np.asarray(got.k[:, 1]), k[:, 4:8].mean(1), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got.k[:, 2:]), k[:, 8:10])
    np.testing.assert_allclose(np.asarray(got.v[:, 0]), -k[:, 0:4].mean(1), rtol=1e-6)
    # a complete chunk that is still the newest stays raw
    cache, _ = _filled(8)
    assert cache.positions(0) == [3, 4, 5, 6, 7]


def test_truncate_inside_a_pooled_chunk_drops_it() -> None:
    cache, k = _filled(10)
    cache.truncate(6)
    assert cache.seq_len == 6
    assert cache.positions(0) == [3]
    stats = cache.stats()
    assert (stats.compressed_tokens, stats.raw_tokens, stats.stored_entries, stats.lost_tokens) == (4, 0, 1, 2)
    # the chunk refills from position 6; when pooled it is the mean of the tokens it then holds
    more = np.random.default_rng(6).normal(size=(2, 3, 2, 8)).astype(np.float32)
    cache.update(0, more, more)
    assert cache.positions(0) == [3, 7, 8]
    np.testing.assert_allclose(np.asarray(cache.get(0).k[:, 1]), more[:, :2].mean(1), rtol=1e-6)
    assert cache.stats().lost_tokens == 2


def test_truncate_at_a_boundary_and_in_the_raw_chunk_is_exact() -> None:
    cache, k = _filled(11)
    cache.truncate(10)  # inside the raw chunk: exact
    assert cache.positions(0) == [3, 7, 8, 9]
    np.testing.assert_array_equal(np.asarray(cache.get(0).k[:, 2:]), k[:, 8:10])
    cache.truncate(8)  # at a boundary: the pooled chunk [4, 8) stays pooled although it is now the newest
    assert cache.positions(0) == [3, 7]
    assert cache.stats().lost_tokens == 0
    cache.truncate(8)  # to the current length: no change
    assert cache.positions(0) == [3, 7]


def test_errors_say_what_to_do() -> None:
    cache, _ = _filled(5)
    with pytest.raises(CacheError, match=r"n must lie in \[0, 5\]"):
        cache.truncate(6)
    with pytest.raises(CacheError, match=r"must both be \[batch=2, new, kv_heads=2, head_dim=8\]"):
        cache.update(0, np.zeros((2, 1, 3, 8), np.float32), np.zeros((2, 1, 3, 8), np.float32))
    with pytest.raises(CacheError, match="allocate a larger cache"):
        cache.update(0, np.zeros((2, CAPACITY, 2, 8), np.float32), np.zeros((2, CAPACITY, 2, 8), np.float32))
    with pytest.raises(CacheError, match="layer 3 out of range"):
        cache.get(3)
    with pytest.raises(CacheError, match="raw_slots >= chunk_size"):
        CompressedKVCache.allocate(1, 1, 16, 1, 8, chunk_size=4, raw_slots=3)


def test_fork_is_independent() -> None:
    cache, k = _filled(6)
    twin = cache.fork()
    twin.update(0, k[:, :3], k[:, :3])
    cache.truncate(2)
    assert twin.seq_len == 9 and cache.seq_len == 2
    assert twin.positions(0) == [3, 7, 8]
    assert cache.positions(0) == []  # chunk [0, 4) was pooled, so the cut at 2 drops it
    assert cache.stats().lost_tokens == 2
