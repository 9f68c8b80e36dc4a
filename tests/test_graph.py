"""The typed graph rejects mis-wired architectures at build time, naming the node."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.config import ModelConfig
from zgen.errors import GraphTypeError
from zgen.graph.core import ForwardContext, Graph, i32
from zgen.graph.decoder import HIDDEN, build_decoder, hidden_state_graph, residual_stream
from zgen.graph.nodes import AddRMSNorm, Embed, GatedMLP, RMSNorm

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def test_decoder_graph_type_checks_and_declares_params() -> None:
    graph = build_decoder(CONFIG)
    shapes = graph.param_shapes()
    assert shapes["layers.1.qkv"] == ((4 + 2 * 2) * 8, 32)
    assert shapes["layers.0.gate_up"] == (96, 32)
    assert "logits" in graph.describe()


def test_hidden_size_mismatch_names_the_node() -> None:
    graph = Graph()
    tokens = graph.add_input("tokens", i32("batch", "seq"))
    h = graph.add(Embed("embed", (tokens,), vocab=64, hidden=32))
    with pytest.raises(GraphTypeError, match="'bad_norm'.*size 32 != 48"):
        graph.add(RMSNorm("bad_norm", (h,), size=48, eps=1e-5, weight="w"))


def test_dtype_mismatch_is_rejected() -> None:
    graph = Graph()
    tokens = graph.add_input("tokens", i32("batch", "seq"))
    with pytest.raises(GraphTypeError, match="'mlp'.*dtypes differ"):
        graph.add(GatedMLP("mlp", (tokens,), hidden=32, intermediate=48, prefix="p"))


def test_symbolic_dimensions_must_agree() -> None:
    graph = Graph()
    a = graph.add_input("a", i32("batch", "seq"))
    b = graph.add_input("b", i32("batch", "other"))
    graph.add(Embed("embed_a", (a,), vocab=64, hidden=32, weight="e"))
    with pytest.raises(GraphTypeError, match="'embed_b'.*'seq' is already bound"):
        graph.add(Embed("embed_b", (b,), vocab=64, hidden=32, weight="e"))


def test_unknown_input_and_duplicate_names() -> None:
    graph = Graph()
    graph.add_input("tokens", i32("batch", "seq"))
    with pytest.raises(GraphTypeError, match="unknown value 'nope'"):
        graph.add(Embed("embed", ("nope",), vocab=64, hidden=32))
    with pytest.raises(GraphTypeError, match="already exists"):
        graph.add_input("tokens", i32("batch", "seq"))


def test_a_residual_add_also_yields_the_next_norm() -> None:
    """Each ``AddRMSNorm`` gives the residual stream (its own name, what feature taps read) and the
    norm the next block reads; the last one gives the final norm, where the hidden-state graph ends.
    Run on the graph's own XLA form, the pair is the add and the norm as separate operations."""
    graph = build_decoder(CONFIG)
    assert graph.type_of("layers.0.mlp_norm") == graph.type_of("layers.0.attn_residual")
    assert "layers.0.mlp_residual(layers.0.attn_residual, layers.0.mlp) -> act[batch, seq, 32], layers.1.attn_norm:" in graph.describe()
    hidden = hidden_state_graph(graph)
    assert hidden.nodes[-1].name == residual_stream(CONFIG.num_layers - 1) and hidden.outputs == (HIDDEN,)

    rng = np.random.default_rng(0)
    x, delta = (jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.float32) for _ in range(2))
    weight = jnp.asarray(rng.standard_normal(32), jnp.float32)
    node = AddRMSNorm("sum", ("x", "delta"), size=32, eps=1e-5, weight="w", normed="normed")
    total, normed = node.apply_outputs({"w": weight}, [x, delta], _NoCache())
    np.testing.assert_array_equal(total, x + delta)
    rms = jnp.sqrt(jnp.mean((x + delta) ** 2, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(normed, (x + delta) / rms * weight, rtol=1e-6, atol=1e-6)


def test_a_second_value_may_not_reuse_a_name() -> None:
    graph = Graph()
    tokens = graph.add_input("tokens", i32("batch", "seq"))
    h = graph.add(Embed("embed", (tokens,), vocab=64, hidden=32))
    with pytest.raises(GraphTypeError, match="'embed' already exists"):
        graph.add(AddRMSNorm("sum", (h, h), size=32, eps=1e-5, weight="w", normed="embed"))
    assert [node.name for node in graph.nodes] == ["embed"]


class _NoCache(ForwardContext):
    def write_and_attend(self, *args: object) -> jax.Array:
        raise AssertionError("no attention here")
