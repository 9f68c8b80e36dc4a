"""Weight-only quantized matrices: the layout, quantizing into it, and the matmul that reads it.

A :class:`QuantizedWeight` stands in for a linear layer's ``[out, in]`` matrix. Every ``group_size``
consecutive inputs of a row share a scale (and, in the asymmetric layouts, an offset):
``w = scale * q + offset``. Two storage widths:

* 8 bits: ``values`` int8 ``[out, in]``. zgen's int8 is symmetric (no offsets), one group per row by
  default (per output channel); GGUF Q8_0 is the same with groups of 32.
* 4 bits: ``values`` uint8 ``[out, in / 2]``, two codes 0..15 per byte, always with offsets (min/max
  quantization, which is GGUF Q4_1's form; Q4_0's ``scale * (q - 8)`` is ``offset = -8 * scale``).
  The packing is *planar*: byte ``j`` of a row holds input ``j`` in its low nibble and input
  ``j + in / 2`` in its high nibble, so the matmul splits ``x`` in halves and never interleaves or
  concatenates codes.

The matmul (:func:`quantized_linear`) works inside the traced computation in one of these ways, a
static choice of the weight (``matmul``), so that XLA reads the weights at their stored width:

* ``"dequantize"`` (the dataclass's default; the named formats and GGUF's weights take ``"kernel"``):
  unpack and scale the codes into the activation dtype, then dot — XLA fuses the unpacking into the
  dot's operand. The scale arithmetic runs in float32 and is cast to
  the activation dtype, so a float32 model computes exactly the weights a float checkpoint of the
  dequantized values holds.
* ``"grouped"``: dot the activations with the raw codes group by group (accumulating in float32)
  and apply scales and offsets to the per-group sums: the dot's operand is only a conversion of the
  codes. Per output channel (int8's default) this is a plain dot followed by one scale per column.
* ``"reduce"``: for a step of at most :data:`REDUCE_MAX_ROWS` rows (decode), an elementwise product
  with the dequantized weights summed over the inputs — one reduction that reads each weight once,
  in place of a dot whose operand XLA might not fuse; more rows (prefill) dequantize and dot.
* ``"kernel"``: on a GPU (a model on one device), zgen's Triton kernel
  (:func:`zgen.pallas.quantized_matmul`) for the steps it takes (at most 4 rows, groups of 64 bytes
  or more) and ``"reduce"`` for other decode-sized steps; elsewhere ``"dequantize"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from zgen.errors import ConfigError
from zgen.numerics import matmul_precision

# A leaf is a device array once loaded, a numpy array while a checkpoint is assembled on the host.
Leaf = Any
INT4_GROUP_SIZES = (128, 64, 32)  # the default int4 group: the largest of these a matrix's width allows
MATMULS = ("dequantize", "grouped", "reduce", "kernel")
REDUCE_MAX_ROWS = 8  # "reduce" multiplies and sums for at most this many rows (decode), else dots


@dataclass(frozen=True)
class QuantizedWeight:
    values: Leaf  # int8 [out, in] (bits 8) or uint8 [out, in / 2] (bits 4, planar nibbles)
    scales: Leaf  # [out, in / group_size], float
    offsets: Leaf | None  # like scales; None for symmetric codes
    bits: int = 8
    group_size: int = 32
    matmul: str = "dequantize"  # one of MATMULS

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [out, in] shape of the matrix this stands in for."""
        out, stored = self.values.shape
        return int(out), int(stored) * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        return sum(int(leaf.size) * np.dtype(leaf.dtype).itemsize for leaf in self.leaves())

    def leaves(self) -> list[Leaf]:
        return [self.values, self.scales] + ([] if self.offsets is None else [self.offsets])


jax.tree_util.register_dataclass(
    QuantizedWeight, data_fields=["values", "scales", "offsets"], meta_fields=["bits", "group_size", "matmul"]
)


@dataclass(frozen=True)
class WeightQuantization:
    """How to quantize linear weights at load: ``bits`` 8 or 4; ``group_size`` inputs per scale
    (None: int8 one group per row, int4 the largest of 128/64/32 that the matrix's width allows);
    ``matmul`` how the product is computed (:data:`MATMULS`, see the module notes); ``head_bits``
    the LM head's width (None: it stays in the compute dtype; 8 or 4: quantized like a linear weight
    of that width with default groups). A head tied to the embedding table always stays in the
    compute dtype: its rows are also looked up."""

    bits: int
    group_size: int | None = None
    matmul: str = "dequantize"
    head_bits: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"weight quantization bits must be 8 or 4, got {self.bits!r}")
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1):
            raise ConfigError(f"weight quantization group_size must be a positive integer or None, got {self.group_size!r}")
        if self.matmul not in MATMULS:
            raise ConfigError(f"weight quantization matmul must be one of {', '.join(MATMULS)}, got {self.matmul!r}")
        if self.head_bits not in (None, 4, 8):
            raise ConfigError(f"weight quantization head_bits must be None, 8 or 4, got {self.head_bits!r}")

    def head(self) -> WeightQuantization | None:
        """How the LM head is quantized (None: it is not)."""
        return None if self.head_bits is None else WeightQuantization(self.head_bits, matmul=self.matmul)

    def group_for(self, width: int) -> int:
        """The group size for a matrix of ``width`` inputs (ConfigError when none fits)."""
        # 4-bit halves are planar: each half of a row must hold whole groups.
        span = 2 if self.bits == 4 else 1
        if self.group_size is not None:
            if width % (span * self.group_size):
                raise ConfigError(
                    f"group_size {self.group_size} does not divide a weight of {width} inputs"
                    f"{' into two halves of whole groups' if span == 2 else ''}; choose a divisor of {width // span}"
                )
            return self.group_size
        if self.bits == 8:
            return width
        for size in INT4_GROUP_SIZES:
            if width % (2 * size) == 0:
                return size
        raise ConfigError(
            f"int4 needs a weight width divisible by {2 * INT4_GROUP_SIZES[-1]}; a matrix has {width} inputs: load it "
            "with weights='int8'"
        )


# The named formats take zgen's kernel on a GPU (int8 batch-1 decode 1.50x and int4 1.54x bf16's tokens/s
# at the Llama-3-8B shape, where "dequantize" is slower than bf16: BENCHMARKS.md) and "dequantize" elsewhere.
# Both keep an untied LM head in int8 (a decode step reads it whole: 1.05 GB in bf16 at Llama-3-8B's
# shape, 13 % of int8's bytes), wider than int4's linear weights as GGUF's 4-bit mixes keep theirs.
WEIGHT_FORMATS: dict[str, WeightQuantization] = {
    "int8": WeightQuantization(8, matmul="kernel", head_bits=8),
    "int4": WeightQuantization(4, matmul="kernel", head_bits=8),
}


def scale_dtype_for(compute: jnp.dtype) -> jnp.dtype:
    """Scales in float32 for float32 models, float16 (GGUF's own) for the narrower ones."""
    return jnp.dtype(jnp.float32) if jnp.dtype(compute).itemsize >= 4 else jnp.dtype(jnp.float16)


def pack_nibbles(codes: Leaf) -> Leaf:
    """Planar 4-bit packing of codes 0..15 ``[out, in]`` (numpy or jax, uint8) into ``[out, in / 2]``."""
    half = codes.shape[1] // 2
    return codes[:, :half] | (codes[:, half:] << 4)


def quantize(weight: Float[Array, "out inp"], scheme: WeightQuantization, scale_dtype: jnp.dtype) -> QuantizedWeight:
    """``weight`` quantized per group of inputs; the codes are computed against the stored (rounded)
    scales, so dequantizing gives the nearest representable weights."""
    out, width = weight.shape
    group = scheme.group_for(width)
    w = jnp.asarray(weight, jnp.float32).reshape(out, width // group, group)
    if scheme.bits == 8:
        scale = (jnp.max(jnp.abs(w), axis=-1) / 127.0).astype(scale_dtype)
        stored = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))
        codes = jnp.clip(jnp.round(w / stored[..., None]), -127, 127).astype(jnp.int8)
        return QuantizedWeight(codes.reshape(out, width), scale, None, bits=8, group_size=group, matmul=scheme.matmul)
    low, high = jnp.min(w, axis=-1), jnp.max(w, axis=-1)
    scale = ((high - low) / 15.0).astype(scale_dtype)
    offset = low.astype(scale_dtype)
    stored = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))
    codes = jnp.clip(jnp.round((w - offset.astype(jnp.float32)[..., None]) / stored[..., None]), 0, 15).astype(jnp.uint8)
    return QuantizedWeight(pack_nibbles(codes.reshape(out, width)), scale, offset, bits=4, group_size=group, matmul=scheme.matmul)


def _scaled(codes: jax.Array, scales: jax.Array, offsets: jax.Array | None, group: int, dtype: jnp.dtype) -> jax.Array:
    out, width = codes.shape
    w = codes.astype(jnp.float32).reshape(out, width // group, group) * scales.astype(jnp.float32)[..., None]
    if offsets is not None:
        w = w + offsets.astype(jnp.float32)[..., None]
    return w.astype(dtype).reshape(out, width)


def _halves(weight: QuantizedWeight, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """The two planar halves of a 4-bit matrix, dequantized: inputs [0, in/2) and [in/2, in)."""
    values = jnp.asarray(weight.values)
    groups = weight.scales.shape[1] // 2
    scales, offsets = jnp.asarray(weight.scales), weight.offsets
    halves: list[jax.Array] = []
    for codes, part in ((values & 0xF, slice(None, groups)), (values >> 4, slice(groups, None))):
        halves.append(_scaled(codes, scales[:, part], None if offsets is None else jnp.asarray(offsets)[:, part], weight.group_size, dtype))
    return halves[0], halves[1]


def dequantize(weight: QuantizedWeight, dtype: jnp.dtype = jnp.dtype(jnp.float32)) -> Float[Array, "out inp"]:
    """The full-precision matrix ``weight`` stands for (tests and reference paths; the matmul never builds it)."""
    if weight.bits == 8:
        offsets = None if weight.offsets is None else jnp.asarray(weight.offsets)
        return _scaled(jnp.asarray(weight.values), jnp.asarray(weight.scales), offsets, weight.group_size, dtype)
    low, high = _halves(weight, dtype)
    return jnp.concatenate([low, high], axis=1)


def _grouped_dot(x: jax.Array, codes: jax.Array, scales: jax.Array, offsets: jax.Array | None) -> jax.Array:
    """``x @ (scales * codes + offsets).T`` with the scales applied to per-group sums, in float32."""
    out, width = codes.shape
    groups = scales.shape[1]
    precision = matmul_precision(x.dtype)
    operand = codes.astype(x.dtype)  # small integers: exact in every float dtype
    if groups == 1:
        y = jnp.einsum("...i,oi->...o", x, operand, precision=precision, preferred_element_type=jnp.float32)
        y = y * scales[:, 0].astype(jnp.float32)
    else:
        xg = x.reshape(*x.shape[:-1], groups, width // groups)
        partial = jnp.einsum(
            "...gi,ogi->...og", xg, operand.reshape(out, groups, width // groups), precision=precision,
            preferred_element_type=jnp.float32,
        )
        y = jnp.einsum("...og,og->...o", partial, scales.astype(jnp.float32))
    if offsets is not None:
        sums = x.astype(jnp.float32).reshape(*x.shape[:-1], groups, width // groups).sum(axis=-1)
        y = y + jnp.einsum("...g,og->...o", sums, offsets.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return y


def quantized_linear(x: Float[Array, "*batch inp"], weight: QuantizedWeight) -> Float[Array, "*batch out"]:
    """``x @ W.T`` for the matrix ``weight`` stands for, computed from its codes inside the computation."""

    def dot(a: jax.Array, w: jax.Array) -> jax.Array:
        if weight.matmul == "reduce" and math.prod(a.shape[:-1]) <= REDUCE_MAX_ROWS:
            return jnp.sum(a.astype(jnp.float32)[..., None, :] * w.astype(jnp.float32), axis=-1).astype(a.dtype)
        return jnp.einsum("...i,oi->...o", a, w, precision=matmul_precision(a.dtype))

    values, scales = jnp.asarray(weight.values), jnp.asarray(weight.scales)
    offsets = None if weight.offsets is None else jnp.asarray(weight.offsets)
    if weight.matmul == "grouped":
        if weight.bits == 8:
            return _grouped_dot(x, values, scales, offsets).astype(x.dtype)
        half, groups = values.shape[1], scales.shape[1] // 2
        low = _grouped_dot(x[..., :half], values & 0xF, scales[:, :groups], None if offsets is None else offsets[:, :groups])
        high = _grouped_dot(x[..., half:], values >> 4, scales[:, groups:], None if offsets is None else offsets[:, groups:])
        return (low + high).astype(x.dtype)
    if weight.bits == 8:
        return dot(x, dequantize(weight, x.dtype))
    low, high = _halves(weight, x.dtype)
    half = low.shape[1]
    return dot(x[..., :half], low) + dot(x[..., half:], high)
