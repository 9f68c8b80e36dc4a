"""LoRA injection as a graph transform: :func:`inject_lora` rewires a decoder's attention and MLP nodes
so every projection adds a per-row low-rank correction, gathered by slot as S-LoRA and Punica do.

The rewired graph takes one more input, ``adapter_slots`` (int32 ``[batch]``: the adapter slot of each
row, 0 = a slot of zeros for rows without one), and reads, beside the base weights, for each adapted
fused weight ``W`` (``layers.{i}.qkv`` ...) a bank of pairs ``W.lora_a`` [slots, R, in] and
``W.lora_b`` [slots, out, R] (scales folded into ``B``; built by :func:`zgen.lora.bank.stack_mixes`).
A row computes ``x W^T + (x A[s]^T) B[s]^T`` with ``s`` its slot: by gathering each row's pair
(prefill, or few rows), or when decoding more rows than slots by computing every slot's features and
keeping the row's own, so each bank is read once per step. Weights without a bank entry stay
plain, so one graph serves every set of adapters; only the bank's shapes pick the compiled program.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import jax
import jax.numpy as jnp

from zgen.graph.core import ForwardContext, Graph, Node, TensorType, i32, linear, param
from zgen.graph.nodes import Attention, GatedMLP, Project
from zgen.numerics import matmul_precision

ADAPTER_SLOTS = "adapter_slots"


def bank_names(fused_weight: str) -> tuple[str, str]:
    """Parameter names of the A and B banks of a fused weight (``layers.3.qkv``)."""
    return f"{fused_weight}.lora_a", f"{fused_weight}.lora_b"


def lora_projection(params: Mapping[str, jax.Array], prefix: str, slots: jax.Array) -> Project:
    def project(name: str, x: jax.Array) -> jax.Array:
        weight = param(params, prefix, name)
        y = linear(x, weight)
        a_name, b_name = bank_names(f"{prefix}.{name}")
        if a_name not in params:
            return y
        a_bank, b_bank = params[a_name].astype(x.dtype), params[b_name].astype(x.dtype)
        precision = matmul_precision(x.dtype, a_bank.dtype)
        batch, seq = x.shape[:2]
        if seq == 1 and a_bank.shape[0] <= batch:
            # Decoding more rows than slots: every slot's features for every row, the other slots'
            # zeroed, so each bank is read once per step rather than once per row.
            low = jnp.einsum("bti,sri->btsr", x, a_bank, precision=precision)
            mine = slots[:, None, None, None] == jnp.arange(a_bank.shape[0])[None, None, :, None]
            delta = jnp.einsum("btsr,sor->bto", jnp.where(mine, low, 0), b_bank, precision=precision)
        else:  # few rows, or many tokens per row: gather each row's own pair
            a = jnp.take(a_bank, slots, axis=0)  # [B, R, in]
            b = jnp.take(b_bank, slots, axis=0)  # [B, out, R]
            delta = jnp.einsum("btr,bor->bto", jnp.einsum("bti,bri->btr", x, a, precision=precision), b, precision=precision)
        return y + delta.astype(y.dtype)

    return project


@dataclass
class LoraAttention(Attention):
    """:class:`~zgen.graph.nodes.Attention` whose projections add each row's adapter correction."""

    def input_types(self) -> tuple[TensorType, ...]:
        return (*super().input_types(), i32("batch"))

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        x, positions, slots = args
        project = lora_projection(params, self.prefix, slots)
        return self.attend(params, project("qkv", x), positions, ctx, project)


@dataclass
class LoraGatedMLP(GatedMLP):
    """:class:`~zgen.graph.nodes.GatedMLP` whose projections add each row's adapter correction."""

    def input_types(self) -> tuple[TensorType, ...]:
        return (*super().input_types(), i32("batch"))

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        x, slots = args
        project = lora_projection(params, self.prefix, slots)
        return self.feed_forward(project("gate_up", x), project)


def inject_lora(graph: Graph) -> Graph:
    """A copy of ``graph`` with every attention and MLP node adapter-aware (module docstring)."""
    out = Graph()
    for name, type_ in graph.inputs.items():
        out.add_input(name, type_)
    out.add_input(ADAPTER_SLOTS, i32("batch"))
    for node in graph.nodes:
        out.add(_rewired(node))
    out.set_outputs(*graph.outputs)
    return out


def _rewired(node: Node) -> Node:
    kind = {Attention: LoraAttention, GatedMLP: LoraGatedMLP}.get(type(node))
    if kind is None:
        return node
    values: dict[str, Any] = {f.name: getattr(node, f.name) for f in fields(node)}  # pyright: ignore[reportArgumentType]
    values["inputs"] = (*node.inputs, ADAPTER_SLOTS)
    return kind(**values)
