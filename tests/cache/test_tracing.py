"""TracingCacheProvider records a compiled plan's cache dataflow at trace time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.cache.compressed import CompressedKVState
from zgen.cache.tensor import DenseKVState
from zgen.cache.tracing import CacheTrace, TracingCacheProvider
from zgen.config import ModelConfig
from zgen.graph.decoder import build_decoder
from zgen.graph.plan import ExecutionPlan

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


@pytest.fixture(scope="module")
def tiny() -> tuple[ExecutionPlan, dict[str, jax.Array]]:
    graph = build_decoder(CONFIG)
    rng = np.random.default_rng(0)
    params = {
        name: jnp.asarray(rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 1.0), jnp.float32)
        for name, shape in graph.param_shapes().items()
    }
    return ExecutionPlan(graph, CONFIG.sliding_window), params


def _inputs() -> tuple[jax.Array, jax.Array, jax.Array]:
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (BATCH, SEQ)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (BATCH, SEQ))
    return tokens, positions, jnp.full((BATCH, 1), SEQ - 1, jnp.int32)


def _dense() -> DenseKVState:
    return DenseKVState.zeros(CONFIG.num_layers, BATCH, CAPACITY, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)


def test_eval_shape_of_prefill_records_each_layers_write_then_attend(tiny) -> None:  # type: ignore[no-untyped-def]
    plan, params = tiny
    traced = TracingCacheProvider(_dense())
    logits, out_state = jax.eval_shape(plan.forward, params, traced, *_inputs())
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


def test_jit_runs_the_wrapped_state_unchanged_and_records_once(tiny) -> None:  # type: ignore[no-untyped-def]
    plan, params = tiny
    trace = CacheTrace()
    forward = jax.jit(plan.forward)
    want_logits, want_state = forward(params, _dense(), *_inputs())
    got_logits, got_state = forward(params, TracingCacheProvider(_dense(), trace), *_inputs())
    np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
    assert isinstance(got_state, TracingCacheProvider)
    for a, b in zip(jax.tree_util.tree_leaves(got_state.unwrap()), jax.tree_util.tree_leaves(want_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(trace.events) == 2 * CONFIG.num_layers
    forward(params, got_state, *_inputs())  # same log, same shapes: the cached executable, no new trace
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
    assert isinstance(final, TracingCacheProvider)
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
