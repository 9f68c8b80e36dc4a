"""A typed compute graph: nodes with declared input/output tensor types, checked as the graph is built.

A shape is a tuple of dimensions; a dimension is either a fixed size (int) or a symbol (str) such as
``"batch"`` or ``"seq"`` that is bound on first use and must agree everywhere after. Adding a node
whose inputs do not match what it declares raises :class:`GraphTypeError` naming the node, so a
mis-wired architecture fails when it is built, not deep inside XLA.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.errors import GraphTypeError
from zgen.numerics import add_rms_norm, matmul_precision, rms_norm
from zgen.quantized_weights import QuantizedWeight, quantized_linear

Dim = int | str


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str  # "act" for the plan's activation dtype, else a numpy dtype name ("int32")

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


def act(*shape: Dim) -> TensorType:
    return TensorType(tuple(shape), "act")


def i32(*shape: Dim) -> TensorType:
    return TensorType(tuple(shape), "int32")


class ForwardContext(ABC):
    """What nodes may read besides their inputs while a plan is traced: the KV cache state."""

    @abstractmethod
    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        inv_freq: Float[Array, " half"],
    ) -> Float[Array, "B T H D"]:
        """Store the new K/V of ``layer`` and attend to the cache with ``q``.

        Neither ``q`` nor ``k`` is rotated yet: the context applies RoPE with ``inv_freq``
        (rotate-half) to both, to keys when it stores them or, for storage formats that quantize keys
        before RoPE, after it reads them back.
        """

    def add_rms_norm(
        self, x: Float[Array, "B T E"], delta: Float[Array, "B T E"], weight: Float[Array, " E"], eps: float
    ) -> tuple[Float[Array, "B T E"], Float[Array, "B T E"]]:
        """``x + delta`` and its RMS norm (:func:`zgen.numerics.add_rms_norm`); a context may run
        both as one kernel."""
        return add_rms_norm(x, delta, weight, eps)

    def quantized_linear(self, x: Float[Array, "*rows inp"], weight: QuantizedWeight) -> Float[Array, "*rows out"]:
        """``x @ W.T`` for a quantized weight (:func:`zgen.quantized_weights.quantized_linear`); a
        context may run it as a kernel."""
        return quantized_linear(x, weight)

    def add_rms_norm_linear(
        self,
        x: Float[Array, "B T E"],
        delta: Float[Array, "B T E"] | None,
        norm_weight: Float[Array, " E"],
        eps: float,
        weight: jax.Array | QuantizedWeight,
    ) -> tuple[Float[Array, "B T E"] | None, Float[Array, "B T out"]]:
        """:meth:`add_rms_norm` (the plain RMS norm of ``x`` without ``delta``, and no sum) and the
        projection of the norm by ``weight``: what a norm and the block reading it start with; a
        context may run both as one kernel."""
        if delta is None:
            return None, linear(rms_norm(x, norm_weight, eps), weight, self)
        total, normed = self.add_rms_norm(x, delta, norm_weight, eps)
        return total, linear(normed, weight, self)


def linear(x: jax.Array, weight: jax.Array | QuantizedWeight, ctx: ForwardContext | None = None) -> jax.Array:
    """x @ weight.T with weight in the checkpoint's [out, in] layout (or quantized in that shape, then
    through ``ctx``, which may run a kernel)."""
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight) if ctx is None else ctx.quantized_linear(x, weight)
    precision = matmul_precision(x.dtype, weight.dtype)
    return jnp.einsum("...i,oi->...o", x, weight, precision=precision)  # pyright: ignore[reportUnknownMemberType]


class Node(ABC):
    """One typed operation. ``inputs`` name the values it consumes (graph inputs or other nodes)."""

    name: str
    inputs: tuple[str, ...]

    @abstractmethod
    def input_types(self) -> tuple[TensorType, ...]: ...

    @abstractmethod
    def output_type(self) -> TensorType: ...

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Parameters this node reads, by name relative to the node's param prefix."""
        return {}

    def linear_weights(self) -> tuple[str, ...]:
        """Parameters (among :meth:`param_shapes`) this node reads only as ``[out, in]`` matmul weights
        through :func:`linear`: the ones a weight quantization may replace."""
        return ()

    @abstractmethod
    def apply(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> jax.Array: ...

    def outputs(self) -> dict[str, TensorType]:
        """The values this node produces, by name: its own, first, then any it computes with it."""
        return {self.name: self.output_type()}

    def apply_outputs(self, params: Mapping[str, jax.Array], args: Sequence[jax.Array], ctx: ForwardContext) -> tuple[jax.Array, ...]:
        """The values of :meth:`outputs`, in its order."""
        return (self.apply(params, args, ctx),)


@dataclass
class Graph:
    """Values in topological order: named inputs first, then nodes in the order they were added."""

    inputs: dict[str, TensorType] = field(default_factory=lambda: {})
    nodes: list[Node] = field(default_factory=lambda: [])
    outputs: tuple[str, ...] = ()
    _types: dict[str, TensorType] = field(default_factory=lambda: {})
    _bindings: dict[str, int | str] = field(default_factory=lambda: {})

    def add_input(self, name: str, type_: TensorType) -> str:
        self._check_new(name)
        self.inputs[name] = type_
        self._types[name] = type_
        return name

    def add(self, node: Node) -> str:
        outputs = node.outputs()
        for name in outputs:
            self._check_new(name)
        declared = node.input_types()
        if len(declared) != len(node.inputs):
            raise GraphTypeError(
                f"node {node.name!r} declares {len(declared)} inputs but is wired to {len(node.inputs)}"
            )
        for position, (source, expected) in enumerate(zip(node.inputs, declared, strict=True)):
            if source not in self._types:
                raise GraphTypeError(f"node {node.name!r}: input {position} names unknown value {source!r}")
            self._unify(node.name, position, source, self._types[source], expected)
        self.nodes.append(node)
        self._types.update(outputs)
        return node.name

    def set_outputs(self, *names: str) -> None:
        for name in names:
            if name not in self._types:
                raise GraphTypeError(f"graph output {name!r} is not a value of the graph")
        self.outputs = names

    def type_of(self, name: str) -> TensorType:
        return self._types[name]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for node in self.nodes:
            for key, shape in node.param_shapes().items():
                shapes[key] = shape
        return shapes

    def linear_weights(self) -> tuple[str, ...]:
        return tuple(name for node in self.nodes for name in node.linear_weights())

    def run(self, params: Mapping[str, jax.Array], feeds: Mapping[str, jax.Array], ctx: ForwardContext) -> tuple[jax.Array, ...]:
        """Evaluate the graph (under a JAX trace this builds the XLA program once)."""
        values: dict[str, jax.Array] = dict(feeds)
        for node in self.nodes:
            values.update(zip(node.outputs(), node.apply_outputs(params, [values[name] for name in node.inputs], ctx), strict=True))
        return tuple(values[name] for name in self.outputs)

    def describe(self) -> str:
        lines = [f"input  {name}: {t}" for name, t in self.inputs.items()]
        for node in self.nodes:
            produced = ", ".join(str(t) if name == node.name else f"{name}: {t}" for name, t in node.outputs().items())
            lines.append(f"{type(node).__name__:<12} {node.name}({', '.join(node.inputs)}) -> {produced}")
        return "\n".join(lines)

    def _check_new(self, name: str) -> None:
        if name in self._types:
            raise GraphTypeError(f"a value named {name!r} already exists in the graph")

    def _unify(self, node: str, position: int, source: str, actual: TensorType, expected: TensorType) -> None:
        def fail(why: str) -> GraphTypeError:
            return GraphTypeError(
                f"node {node!r}: input {position} ({source!r}) has type {actual} but the node expects "
                f"{expected}: {why}"
            )

        if actual.dtype != expected.dtype:
            raise fail("dtypes differ")
        if len(actual.shape) != len(expected.shape):
            raise fail("ranks differ")
        for have, want in zip(actual.shape, expected.shape, strict=True):
            if isinstance(want, str):
                bound = self._bindings.setdefault(want, have)
                if bound != have:
                    raise fail(f"dimension {want!r} is already bound to {bound}")
            elif have != want:
                raise fail(f"size {have} != {want}")


def param(params: Mapping[str, Any], prefix: str, name: str) -> jax.Array:
    return params[f"{prefix}.{name}" if prefix else name]
