"""TracingCacheProvider records a compiled step's cache dataflow at trace time."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.cache.base import KVState
from zgen.cache.compressed import CompressedKVState
from zgen.cache.tensor import DenseKVState
from zgen.cache.tracing import CacheTrace, TracingCacheProvider
from zgen.config import ModelConfig
from zgen.graph.decoder import build_decoder
from zgen.model import random_model
from zgen.runtime.runner import runner_for
from zgen.runtime.step import ModelSpec, forward

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    sliding_window=16,
)
BATCH, SEQ, CAPACITY = 2, 8, 32


Step = Callable[[dict[str, jax.Array], KVState, jax.Array, jax.Array, jax.Array], tuple[jax.Array, KVState]]


@pytest.fixture(scope="module")
def tiny() -> tuple[Step, dict[str, jax.Array]]:
    """The step function of a tiny random model (sliding window 16) and its parameters."""
    graph = build_decoder(CONFIG)
    rng = np.random.default_rng(0)
    params = {
        name: jnp.asarray(rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 1.0), jnp.float32)
        for name, shape in graph.param_shapes().items()
    }
    return partial(forward, ModelSpec(graph, CONFIG.sliding_window)), params


def _inputs() -> tuple[jax.Array, jax.Array, jax.Array]:
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (BATCH, SEQ)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (BATCH, SEQ))
    return tokens, positions, jnp.full((BATCH, 1), SEQ - 1, jnp.int32)


def _dense() -> DenseKVState:
    return DenseKVState.zeros(CONFIG.num_layers, BATCH, CAPACITY, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)


def test_eval_shape_of_prefill_records_each_layers_write_then_attend(tiny: tuple[Step, dict[str, jax.Array]]) -> None:
    step, params = tiny
    traced = TracingCacheProvider(_dense())
    logits, out_state = jax.eval_shape(step, params, traced, *_inputs())
    assert logits.shape == (BATCH, 1, CONFIG.vocab_size)
    assert isinstance(out_state, TracingCacheProvider) and isinstance(out_state.inner, DenseKVState)
    assert out_state.trace is traced.trace

    events = traced.trace.events
    assert [(e.op, e.layer) for e in events] == [
        (op, layer) for layer in range(CONFIG.num_layers) for op in ("write", "attend")
    ]
    kv = (BATCH, SEQ, CONFIG.num_kv_heads, CONFIG.head_dim)
    for e in events:
        assert e.traced and e.dtype == "float32" and e.positions_shape == (BATCH, SEQ) and e.state == "DenseKVState"
        if e.op == "write":
            assert e.shape == kv and e.v_shape == kv and e.out_shape is None
        else:
            q = (BATCH, SEQ, CONFIG.num_heads, CONFIG.head_dim)
            assert e.shape == q and e.out_shape == q and e.sliding_window == CONFIG.sliding_window
    assert traced.trace.per_layer() == {layer: {"write": 1, "attend": 1} for layer in range(CONFIG.num_layers)}

    table = traced.describe()
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["#", "op", "layer"]
    assert "(2, 8, 2, 8)" in lines[2] and "write" in lines[2]
    assert "(2, 8, 4, 8)" in lines[3] and "attend" in lines[3] and "16" in lines[3]
    assert lines[-1] == "per layer: 0: 1w/1a, 1: 1w/1a, 2: 1w/1a"


def test_jit_runs_the_wrapped_state_unchanged_and_records_once(tiny: tuple[Step, dict[str, jax.Array]]) -> None:
    step, params = tiny
    trace = CacheTrace()
    compiled = jax.jit(step)
    want_logits, want_state = compiled(params, _dense(), *_inputs())
    got_logits, got_state = compiled(params, TracingCacheProvider(_dense(), trace), *_inputs())
    np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
    assert isinstance(got_state, TracingCacheProvider)
    for a, b in zip(jax.tree_util.tree_leaves(got_state.unwrap()), jax.tree_util.tree_leaves(want_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(trace.events) == 2 * CONFIG.num_layers
    compiled(params, got_state, *_inputs())  # same log, same shapes: the cached executable, no new trace
    assert len(trace.events) == 2 * CONFIG.num_layers


def test_a_runners_compiled_step_records_once_and_donates_the_inner_state() -> None:
    """Through the runtime's Runner (ahead-of-time compiled, the state donated): the wrapper comes back
    around the new state, the log holds one trace, and a second call reuses the executable."""
    model = random_model(CONFIG, dtype="float32")
    runner = runner_for(model)
    trace = CacheTrace()
    given = _dense()
    logits, state = runner.forward(TracingCacheProvider(given, trace), *_inputs())
    assert logits.shape == (BATCH, 1, CONFIG.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))
    assert isinstance(state, TracingCacheProvider) and state.trace is trace
    assert isinstance(state.unwrap(), DenseKVState)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(given))
    assert trace.per_layer() == {layer: {"write": 1, "attend": 1} for layer in range(CONFIG.num_layers)}
    want, _ = runner.forward(_dense(), *_inputs())
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
    runner.forward(state, *_inputs())
    assert len(trace.events) == 2 * CONFIG.num_layers


def test_wrapper_is_a_pytree_over_the_inner_state_in_a_loop() -> None:
    """Its leaves are the inner state's; it threads through a lax.fori_loop carry, recording the body once."""
    inner = CompressedKVState.zeros(2, BATCH, CAPACITY, 2, 8, jnp.float32, chunk_size=4)
    traced = TracingCacheProvider(inner)
    assert len(jax.tree_util.tree_leaves(traced)) == len(jax.tree_util.tree_leaves(inner))

    def body(step: jax.Array, state: TracingCacheProvider) -> TracingCacheProvider:
        k = jnp.ones((BATCH, 1, 2, 8)) * step
        positions = jnp.full((BATCH, 1), step, jnp.int32)
        state = state.write(1, k, k, positions)
        state.attend(1, jnp.ones((BATCH, 1, 4, 8)), positions, sliding_window=None)
        return state

    final = jax.jit(lambda s: jax.lax.fori_loop(0, 6, body, s))(traced)
    assert isinstance(final, TracingCacheProvider) and isinstance(final.inner, CompressedKVState)
    assert [(e.op, e.layer, e.state) for e in traced.trace.events] == [
        ("write", 1, "CompressedKVState"), ("attend", 1, "CompressedKVState")
    ]
    assert np.asarray(final.inner.count[1])[0, :2].tolist() == [4, 2]  # six tokens, chunk 4


def test_eager_calls_are_marked_untraced() -> None:
    traced = TracingCacheProvider(_dense())
    k = jnp.zeros((BATCH, 2, CONFIG.num_kv_heads, CONFIG.head_dim))
    traced = traced.write(0, k, k, jnp.zeros((BATCH, 2), jnp.int32))
    assert traced.capacity == CAPACITY
    assert [e.traced for e in traced.trace.events] == [False]
    assert "no" in traced.describe().splitlines()[2]
