"""The nodes decoder-only transformers are built from."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from zgen.graph.core import ForwardContext, Node, TensorType, act, i32, linear, param
from zgen.numerics import rms_norm


# How a node computes ``x @ W.T`` for one of its weights (named relative to its prefix): plainly, or
# with a per-row low-rank correction once a graph transform (``zgen.lora``) has rewired the node.
Project = Callable[[str, jax.Array], jax.Array]


def plain_projection(params: Mapping[str, jax.Array], prefix: str, ctx: ForwardContext) -> Project:
    return lambda name, x: linear(x, param(params, prefix, name), ctx)


@dataclass
class Embed(Node):
    name: str
    inputs: tuple[str, ...]
    vocab: int
    hidden: int
    weight: str = "embed"

    def input_types(self) -> tuple[TensorType, ...]:
        return (i32("batch", "seq"),)

    def output_type(self) -> TensorType:
        return act("batch", "seq", self.hidden)

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {self.weight: (self.vocab, self.hidden)}

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        return jnp.take(params[self.weight], args[0], axis=0)


@dataclass
class RMSNorm(Node):
    name: str
    inputs: tuple[str, ...]
    size: int
    eps: float
    weight: str

    def input_types(self) -> tuple[TensorType, ...]:
        return (act("batch", "seq", self.size),)

    def output_type(self) -> TensorType:
        return act("batch", "seq", self.size)

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {self.weight: (self.size,)}

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        return rms_norm(args[0], params[self.weight], self.eps)


@dataclass
class AddRMSNorm(Node):
    """A residual add and the RMS norm of its sum: the sum is this node's value, the norm the value
    ``normed``. Computed together so the context can run both as one kernel (XLA makes each add and
    norm three small launches: the add, the sum of squares, the scaling)."""

    name: str
    inputs: tuple[str, ...]  # (residual stream, block output)
    size: int
    eps: float
    weight: str
    normed: str

    def input_types(self) -> tuple[TensorType, ...]:
        return (act("batch", "seq", self.size), act("batch", "seq", self.size))

    def output_type(self) -> TensorType:
        return act("batch", "seq", self.size)

    def outputs(self) -> dict[str, TensorType]:
        return {self.name: self.output_type(), self.normed: self.output_type()}

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {self.weight: (self.size,)}

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        return self.apply_outputs(params, args, ctx)[0]

    def apply_outputs(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> tuple[jax.Array, ...]:
        return ctx.add_rms_norm(args[0], args[1], params[self.weight], self.eps)


@dataclass
class Attention(Node):
    """Grouped-query self-attention over the KV cache: project, (q/k norm), RoPE, cache write, attend, project.

    Inputs: hidden [batch, seq, hidden] and positions [batch, seq]. The cache decides which keys are
    visible (causal by position, sliding window) and how they are stored.
    """

    name: str
    inputs: tuple[str, ...]
    layer: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inv_freq: tuple[float, ...]
    prefix: str
    bias: bool = False
    qk_norm_eps: float | None = None  # set for Qwen3's per-head q/k RMSNorm
    shards: int = 1  # qkv rows laid out shard-major for tensor parallelism: per shard its q, k, v heads

    def input_types(self) -> tuple[TensorType, ...]:
        return (act("batch", "seq", self.hidden), i32("batch", "seq"))

    def output_type(self) -> TensorType:
        return act("batch", "seq", self.hidden)

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            f"{self.prefix}.qkv": (rows, self.hidden),
            f"{self.prefix}.o": (self.hidden, self.num_heads * self.head_dim),
        }
        if self.bias:
            shapes[f"{self.prefix}.qkv_bias"] = (rows,)
        if self.qk_norm_eps is not None:
            shapes[f"{self.prefix}.q_norm"] = (self.head_dim,)
            shapes[f"{self.prefix}.k_norm"] = (self.head_dim,)
        return shapes

    first_projection: ClassVar[str] = "qkv"

    def linear_weights(self) -> tuple[str, ...]:
        return (f"{self.prefix}.qkv", f"{self.prefix}.o")

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        x, positions = args
        project = plain_projection(params, self.prefix, ctx)
        return self.attend(params, project("qkv", x), positions, ctx, project)

    def from_projection(
        self, params: Mapping[str, jax.Array], qkv: jax.Array, args: Sequence[jax.Array], ctx: ForwardContext
    ) -> jax.Array:
        """The node's value from its input's qkv projection (computed elsewhere, see :class:`~zgen.graph.fusion.NormedBlock`);
        ``args``: the node's other inputs (positions)."""
        return self.attend(params, qkv, args[0], ctx, plain_projection(params, self.prefix, ctx))

    def attend(
        self, params: Mapping[str, jax.Array], qkv: jax.Array, positions: jax.Array, ctx: ForwardContext, project: Project
    ) -> jax.Array:
        """From the qkv projection on: bias, heads, (q/k norm), the cache's write and attention, and
        the output projection ``project("o", ...)``."""
        batch, seq, _ = qkv.shape
        if self.bias:
            qkv = qkv + param(params, self.prefix, "qkv_bias")
        q_size = self.num_heads * self.head_dim
        if self.shards == 1:
            # Slices of one array of heads, so that a consumer taking them together again (the fused
            # decode kernel) gets the projection's output itself, not a copy.
            heads = qkv.reshape(batch, seq, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            kv_start = self.num_heads + self.num_kv_heads
            q, k, v = heads[:, :, : self.num_heads], heads[:, :, self.num_heads : kv_start], heads[:, :, kv_start:]
        else:
            qs, ks = q_size // self.shards, self.num_kv_heads * self.head_dim // self.shards  # per shard
            per_shard = qs + 2 * ks  # (named, not -1: a feed of zero tokens is a valid shape)
            qkv = qkv.reshape(batch, seq, self.shards, per_shard)  # one shard's heads are contiguous: no data moves between devices
            q = qkv[..., :qs].reshape(batch, seq, self.num_heads, self.head_dim)
            k = qkv[..., qs : qs + ks].reshape(batch, seq, self.num_kv_heads, self.head_dim)
            v = qkv[..., qs + ks :].reshape(batch, seq, self.num_kv_heads, self.head_dim)
        if self.qk_norm_eps is not None:
            q = rms_norm(q, param(params, self.prefix, "q_norm"), self.qk_norm_eps)
            k = rms_norm(k, param(params, self.prefix, "k_norm"), self.qk_norm_eps)
        inv_freq = jnp.asarray(np.asarray(self.inv_freq, dtype=np.float32))
        # q and k go to the cache un-rotated: it applies RoPE (in a fused decode kernel, in registers),
        # and formats that quantize keys before RoPE rotate them after reading them back.
        out = ctx.write_and_attend(self.layer, q, k, v, positions, inv_freq)
        return project("o", out.reshape(batch, seq, q_size))


@dataclass
class GatedMLP(Node):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    name: str
    inputs: tuple[str, ...]
    hidden: int
    intermediate: int
    prefix: str
    shards: int = 1  # gate_up rows laid out shard-major for tensor parallelism: per shard its gate, up columns

    def input_types(self) -> tuple[TensorType, ...]:
        return (act("batch", "seq", self.hidden),)

    def output_type(self) -> TensorType:
        return act("batch", "seq", self.hidden)

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {
            f"{self.prefix}.gate_up": (2 * self.intermediate, self.hidden),
            f"{self.prefix}.down": (self.hidden, self.intermediate),
        }

    first_projection: ClassVar[str] = "gate_up"

    def linear_weights(self) -> tuple[str, ...]:
        return (f"{self.prefix}.gate_up", f"{self.prefix}.down")

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        project = plain_projection(params, self.prefix, ctx)
        return self.feed_forward(project("gate_up", args[0]), project)

    def from_projection(
        self, params: Mapping[str, jax.Array], gate_up: jax.Array, args: Sequence[jax.Array], ctx: ForwardContext
    ) -> jax.Array:
        """The node's value from its input's gate/up projection (computed elsewhere, see :class:`~zgen.graph.fusion.NormedBlock`)."""
        del args  # the MLP has no other inputs
        return self.feed_forward(gate_up, plain_projection(params, self.prefix, ctx))

    def feed_forward(self, gate_up: jax.Array, project: Project) -> jax.Array:
        """From the gate/up projection on: the gated activation and ``project("down", ...)``."""
        lead = gate_up.shape[:-1]
        gate, up = jnp.split(gate_up.reshape(*lead, self.shards, 2 * self.intermediate // self.shards), 2, axis=-1)
        return project("down", jax.nn.silu(gate.reshape(*lead, self.intermediate)) * up.reshape(*lead, self.intermediate))


@dataclass
class SelectRows(Node):
    """Keep the sequence rows whose logits are wanted (the last prompt token in prefill)."""

    name: str
    inputs: tuple[str, ...]
    hidden: int

    def input_types(self) -> tuple[TensorType, ...]:
        return (act("batch", "seq", self.hidden), i32("batch", "rows"))

    def output_type(self) -> TensorType:
        return act("batch", "rows", self.hidden)

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        hidden, rows = args
        return jnp.take_along_axis(hidden, rows[..., None], axis=1)


@dataclass
class LMHead(Node):
    """Project to vocabulary logits in float32; reads the embedding matrix when embeddings are tied."""

    name: str
    inputs: tuple[str, ...]
    hidden: int
    vocab: int
    weight: str

    def input_types(self) -> tuple[TensorType, ...]:
        return (act("batch", "rows", self.hidden),)

    def output_type(self) -> TensorType:
        return TensorType(("batch", "rows", self.vocab), "float32")

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {self.weight: (self.vocab, self.hidden)}

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        return linear(args[0], params[self.weight], ctx).astype(jnp.float32)
