"""Decoder-only transformer graphs: Llama, Mistral, Qwen2 and Qwen3 share one shape.

They differ only in switches of :class:`~zgen.config.ModelConfig`: q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3), a sliding window (Mistral), Llama-3.1 RoPE scaling and tied embeddings.
"""

from __future__ import annotations

from zgen.config import ModelConfig, rope_inverse_frequencies
from zgen.graph.core import Graph, i32
from zgen.graph.nodes import AddRMSNorm, Attention, Embed, GatedMLP, LMHead, RMSNorm, SelectRows

# Graph inputs: the token ids, their positions, and which rows to return logits for.
TOKENS, POSITIONS, LOGIT_ROWS = "tokens", "positions", "logit_rows"
LOGITS = "logits"
HIDDEN = "final_norm"  # the last hidden states, after the final norm


def build_decoder(config: ModelConfig, shards: int = 1) -> Graph:
    """The model's graph; ``shards`` > 1 reads fused weights laid out for tensor parallelism
    (:func:`zgen.sharding.shard_major`)."""
    c = config
    graph = Graph()
    tokens = graph.add_input(TOKENS, i32("batch", "seq"))
    positions = graph.add_input(POSITIONS, i32("batch", "seq"))
    rows = graph.add_input(LOGIT_ROWS, i32("batch", "rows"))
    inv_freq = tuple(rope_inverse_frequencies(c))
    h = graph.add(Embed("embed", (tokens,), c.vocab_size, c.hidden_size))
    normed = graph.add(RMSNorm("layers.0.attn_norm", (h,), c.hidden_size, c.rms_norm_eps, "layers.0.input_norm"))
    for i in range(c.num_layers):
        p = f"layers.{i}"
        attn = graph.add(
            Attention(
                f"{p}.attn",
                (normed, positions),
                layer=i,
                hidden=c.hidden_size,
                num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                inv_freq=inv_freq,
                prefix=p,
                bias=c.attention_bias,
                qk_norm_eps=c.rms_norm_eps if c.qk_norm else None,
                shards=shards,
            )
        )
        # Each residual add also yields the norm the next block reads (the next layer's input norm,
        # after the last layer the final norm).
        h = graph.add(AddRMSNorm(f"{p}.attn_residual", (h, attn), c.hidden_size, c.rms_norm_eps, f"{p}.post_norm", f"{p}.mlp_norm"))
        mlp = graph.add(GatedMLP(f"{p}.mlp", (f"{p}.mlp_norm",), c.hidden_size, c.intermediate_size, p, shards))
        last = i == c.num_layers - 1
        normed = HIDDEN if last else f"layers.{i + 1}.attn_norm"
        weight = "final_norm" if last else f"layers.{i + 1}.input_norm"
        h = graph.add(AddRMSNorm(f"{p}.mlp_residual", (h, mlp), c.hidden_size, c.rms_norm_eps, weight, normed))
    selected = graph.add(SelectRows("select_rows", (HIDDEN, rows), c.hidden_size))
    head_weight = "embed" if c.tie_word_embeddings else "lm_head"
    graph.add(LMHead(LOGITS, (selected,), c.hidden_size, c.vocab_size, head_weight))
    graph.set_outputs(LOGITS)
    return graph


def hidden_state_graph(graph: Graph) -> Graph:
    """A decoder graph cut after the final norm: hidden states ``[batch, seq, hidden]`` at every
    position instead of logits at chosen rows (what embeddings pool)."""
    out = Graph()
    for name, type_ in graph.inputs.items():
        if name != LOGIT_ROWS:
            out.add_input(name, type_)
    for node in graph.nodes:
        out.add(node)
        if HIDDEN in node.outputs():
            break
    out.set_outputs(HIDDEN)
    return out


def residual_stream(layer: int) -> str:
    """The node holding decoder layer ``layer``'s output (the residual stream after it); the last
    layer's is the last hidden state before the final norm."""
    return f"layers.{layer}.mlp_residual"


def feature_graph(graph: Graph, layers: tuple[int, ...]) -> Graph:
    """The decoder graph with more outputs: its logits, then the residual stream after each of
    ``layers`` at every position (what an EAGLE head reads: the last layer's, or a low, middle and
    high layer's to fuse)."""
    out = Graph()
    for name, type_ in graph.inputs.items():
        out.add_input(name, type_)
    for node in graph.nodes:
        out.add(node)
    out.set_outputs(LOGITS, *(residual_stream(layer) for layer in layers))
    return out
