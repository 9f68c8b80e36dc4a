"""The typed graph rejects mis-wired architectures at build time, naming the node."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.config import ModelConfig
from zgen.errors import GraphTypeError
from zgen.graph.core import ForwardContext, Graph, i32
from zgen.graph.decoder import HIDDEN, LOGIT_ROWS, POSITIONS, TOKENS, build_decoder, hidden_state_graph, residual_stream
from zgen.graph.fusion import NormedBlock, fuse_norms
from zgen.graph.nodes import AddRMSNorm, Attention, Embed, GatedMLP, RMSNorm
from zgen.lora.graph import inject_lora
from zgen.model import random_model
from zgen.pallas.norm_linear import add_rms_norm_linear
from zgen.rope import rotary

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


class _SelfAttention(ForwardContext):
    """Causal attention over the fed tokens alone (no cache), in the graph's own XLA ops."""

    def write_and_attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, inv_freq: jax.Array
    ) -> jax.Array:
        q, k = rotary(q, positions, inv_freq), rotary(k, positions, inv_freq)
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
        causal = positions[:, None, :, None] >= positions[:, None, None, :]
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1), v)


class _FusedKernel(_SelfAttention):
    """Runs each fused norm and projection through the kernel (interpreted on CPU)."""

    def add_rms_norm_linear(self, x, delta, norm_weight, eps, weight):  # type: ignore[no-untyped-def]
        return add_rms_norm_linear(x, delta, norm_weight, eps, weight, implementation="triton")


def test_norms_fuse_into_the_blocks_that_read_them() -> None:
    """``fuse_norms`` merges each norm into the attention or MLP node reading it: every value keeps
    its name (the residual streams feature taps read) and the graph computes the same logits, to the
    bit through the base context's ops and within rounding through the fused kernel. The final norm
    (read by the row selection) and LoRA's nodes (which project the norm themselves) stay apart."""
    graph = build_decoder(CONFIG)
    fused = fuse_norms(graph)
    kinds = [type(node).__name__ for node in fused.nodes]
    assert kinds == ["Embed", *["NormedBlock"] * 2 * CONFIG.num_layers, "AddRMSNorm", "SelectRows", "LMHead"]
    first = fused.nodes[1]
    assert isinstance(first, NormedBlock) and isinstance(first.norm, RMSNorm) and isinstance(first.block, Attention)
    assert fused.type_of(residual_stream(0)) == graph.type_of(residual_stream(0))
    assert "layers.0.mlp_norm" not in fused.describe() and fused.param_shapes() == graph.param_shapes()
    assert not any(isinstance(node, NormedBlock) for node in fuse_norms(inject_lora(graph)).nodes)

    model = random_model(CONFIG, dtype="float32")
    rng = np.random.default_rng(1)
    feeds = {
        TOKENS: jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 1)), jnp.int32),
        POSITIONS: jnp.zeros((2, 1), jnp.int32),
        LOGIT_ROWS: jnp.zeros((2, 1), jnp.int32),
    }
    (want,) = graph.run(model.params, feeds, _SelfAttention())
    (same,) = fused.run(model.params, feeds, _SelfAttention())
    np.testing.assert_array_equal(same, want)
    (kernel,) = jax.jit(lambda p, f: fused.run(p, f, _FusedKernel()))(model.params, feeds)
    np.testing.assert_allclose(kernel, want, rtol=1e-5, atol=1e-5)
