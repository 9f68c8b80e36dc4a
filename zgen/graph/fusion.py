"""Graph fusion: a norm and the block that reads it, as one node.

Each decoder block starts by normalizing the residual stream and projecting the norm (attention's
qkv, the MLP's gate/up). :func:`fuse_norms` merges such a norm node into the block that is its only
reader, so the context can compute the norm inside the projection
(:meth:`~zgen.graph.core.ForwardContext.add_rms_norm_linear`: one kernel on a GPU, where a decode
step's launches cost more than their bytes). The fused graph computes the same values under the same
names, less the norms no one else reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax

from zgen.graph.core import ForwardContext, Graph, Node, TensorType, param
from zgen.graph.nodes import AddRMSNorm, Attention, GatedMLP, RMSNorm


@dataclass
class NormedBlock(Node):
    """``norm`` (:class:`RMSNorm` or :class:`AddRMSNorm`) and ``block`` (:class:`Attention` or
    :class:`GatedMLP`), the only reader of the norm, as one node. Its inputs are the norm's, then
    the block's others; its values are the block's, then the residual sum of an :class:`AddRMSNorm`."""

    name: str
    inputs: tuple[str, ...]
    norm: RMSNorm | AddRMSNorm
    block: Attention | GatedMLP

    @classmethod
    def of(cls, norm: RMSNorm | AddRMSNorm, block: Attention | GatedMLP) -> NormedBlock:
        return cls(block.name, (*norm.inputs, *block.inputs[1:]), norm, block)

    def input_types(self) -> tuple[TensorType, ...]:
        return (*self.norm.input_types(), *self.block.input_types()[1:])

    def output_type(self) -> TensorType:
        return self.block.output_type()

    def outputs(self) -> dict[str, TensorType]:
        sums = {self.norm.name: self.norm.output_type()} if isinstance(self.norm, AddRMSNorm) else {}
        return {**self.block.outputs(), **sums}

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {**self.norm.param_shapes(), **self.block.param_shapes()}

    def linear_weights(self) -> tuple[str, ...]:
        return self.block.linear_weights()

    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array:
        return self.apply_outputs(params, args, ctx)[0]

    def apply_outputs(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> tuple[jax.Array, ...]:
        count = len(self.norm.inputs)
        x, delta = args[0], (args[1] if count == 2 else None)
        weight = param(params, self.block.prefix, self.block.first_projection)
        total, projected = ctx.add_rms_norm_linear(x, delta, params[self.norm.weight], self.norm.eps, weight)
        out = self.block.from_projection(params, projected, args[count:], ctx)
        return (out,) if total is None else (out, total)


def _normed_value(node: Node) -> str | None:
    """The value holding a norm node's norm (None for other nodes)."""
    if type(node) is AddRMSNorm:
        return node.normed
    return node.name if type(node) is RMSNorm else None


def fuse_norms(graph: Graph) -> Graph:
    """A copy of ``graph`` in which every norm read only by the next node, an :class:`Attention` or
    :class:`GatedMLP` taking it as its first input, is merged with that node (:class:`NormedBlock`).
    Subclasses of those nodes (LoRA's, which project the norm themselves) are left as they are."""
    readers = Counter(name for node in graph.nodes for name in node.inputs)
    readers.update(graph.outputs)
    out = Graph()
    for name, type_ in graph.inputs.items():
        out.add_input(name, type_)
    nodes, i = graph.nodes, 0
    while i < len(nodes):
        node, after = nodes[i], nodes[i + 1] if i + 1 < len(nodes) else None
        normed = _normed_value(node)
        if (
            normed is not None
            and (type(after) is Attention or type(after) is GatedMLP)
            and after.inputs[0] == normed
            and readers[normed] == 1
        ):
            assert isinstance(node, (RMSNorm, AddRMSNorm))
            out.add(NormedBlock.of(node, after))
            i += 2
        else:
            out.add(node)
            i += 1
    out.set_outputs(*graph.outputs)
    return out
