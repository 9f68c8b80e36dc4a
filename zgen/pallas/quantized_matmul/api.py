"""``quantized_matmul``: ``x @ W.T`` for a :class:`~zgen.quantized_weights.QuantizedWeight`, read at its
stored width.

XLA's forms (:func:`zgen.quantized_weights.quantized_linear`) read int8 codes at ~2.7 TB/s on an H200
and int4 at ~1.3 TB/s (unpacking nibbles). The Triton kernel takes a decode step's few rows on the
CUDA cores, making codes floats by bit operations on 32-bit words (int8 at ~3.4 TB/s on an H200's
widest product; BENCHMARKS.md, "Weight-only quantization"); other products go to XLA's
multiply-and-sum (``matmul="reduce"``: its fastest form for decode-sized steps) or, for prefill, its
dot. ``implementation="triton-mma"`` sends 4-bit codes of up to 16 bf16/f16 rows to the tensor cores
instead (:mod:`.triton_mma`); it is not the default until timed and checked on a GPU.
"""

from __future__ import annotations

import dataclasses
import math

from jaxtyping import Array, Float

from zgen.errors import ConfigError
from zgen.pallas.common import interpret_pallas
from zgen.pallas.quantized_matmul import triton, triton_mma
from zgen.quantized_weights import QuantizedWeight, quantized_linear


def supports(x: Array, weight: QuantizedWeight) -> bool:
    """Whether the kernel takes this product: a decode step's few rows, groups of 64 bytes or more."""
    rows = math.prod(x.shape[:-1])
    return rows > 0 and triton.launch(rows, weight) is not None


def quantized_matmul(
    x: Float[Array, "*rows inp"], weight: QuantizedWeight, *, implementation: str = "triton"
) -> Float[Array, "*rows out"]:
    """``x @ W.T`` for the matrix ``weight`` stands for, in ``x``'s dtype.

    ``implementation``: "triton" (the kernel; interpreted on CPU; products it does not
    :func:`supports` go to XLA's ``"reduce"`` form), "triton-mma" (4-bit products
    :func:`triton_mma.launch` takes on the tensor cores, others as "triton") or "xla" / "reference"
    (:func:`zgen.quantized_weights.quantized_linear` with the weight's own form).
    """
    if x.shape[-1] != weight.shape[1]:
        raise ConfigError(f"quantized_matmul: x has {x.shape[-1]} inputs, the weight {weight.shape[1]}")
    if implementation in ("xla", "reference"):
        return quantized_linear(x, weight)
    if implementation == "triton-mma" and triton_mma.launch(math.prod(x.shape[:-1]), weight, x.dtype) is not None:
        return triton_mma.quantized_matmul(x, weight, interpret=interpret_pallas())
    if implementation in ("triton", "triton-mma"):
        if not supports(x, weight):
            return quantized_linear(x, dataclasses.replace(weight, matmul="reduce"))
        return triton.quantized_matmul(x, weight, interpret=interpret_pallas())
    raise ConfigError(f"unknown quantized_matmul implementation {implementation!r}; choose triton, triton-mma, xla or reference")
