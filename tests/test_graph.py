"""The typed graph rejects mis-wired architectures at build time, naming the node."""

from __future__ import annotations

import pytest

from zgen.config import ModelConfig
from zgen.errors import GraphTypeError
from zgen.graph.core import Graph, i32
from zgen.graph.decoder import build_decoder
from zgen.graph.nodes import Embed, GatedMLP, RMSNorm

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
