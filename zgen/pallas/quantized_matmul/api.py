"""``quantized_matmul``: ``x @ W.T`` for a :class:`~zgen.quantized_weights.QuantizedWeight`, read at its
stored width.

XLA's forms (:func:`zgen.quantized_weights.quantized_linear`) read int8 codes at ~2.7 TB/s on an H200
and int4 at ~1.3 TB/s (unpacking nibbles). The Triton kernels take a decode step's few rows on the
CUDA cores, each program loading its whole slice of codes at once and accumulating dequantized
products elementwise (Llama-3-8B batch-1 decode: int8 1.38x bf16's tokens/s against a byte bound
of 1.87x; BENCHMARKS.md, "Weight-only quantization"); more rows (and GGUF's narrow groups) as dot
operands on the tensor cores, with each group's scale and offset applied to per-group sums.
"""

from __future__ import annotations

import math

from jaxtyping import Array, Float

from zgen.errors import ConfigError
from zgen.pallas.common import interpret_pallas
from zgen.pallas.triton_utils import MIN_DOT
from zgen.quantized_weights import QuantizedWeight, quantized_linear

# The kernel serves steps of at most this many rows (decode, verification); prefill keeps XLA's dot.
MAX_ROWS = 16


def supports(x: Array, weight: QuantizedWeight) -> bool:
    """Whether the kernel takes this product: few rows, groups and outputs its tiles can cover."""
    out, _ = weight.shape
    rows = math.prod(x.shape[:-1])
    # A group is read in power-of-two chunks of at least MIN_DOT columns.
    return 0 < rows <= MAX_ROWS and weight.group_size & -weight.group_size >= MIN_DOT and out % MIN_DOT == 0


def quantized_matmul(
    x: Float[Array, "*rows inp"], weight: QuantizedWeight, *, implementation: str = "triton"
) -> Float[Array, "*rows out"]:
    """``x @ W.T`` for the matrix ``weight`` stands for, in ``x``'s dtype.

    ``implementation``: "triton" (the kernel; interpreted on CPU; products it does not
    :func:`supports` go to XLA) or "xla" / "reference" (:func:`zgen.quantized_weights.quantized_linear`).
    """
    if x.shape[-1] != weight.shape[1]:
        raise ConfigError(f"quantized_matmul: x has {x.shape[-1]} inputs, the weight {weight.shape[1]}")
    if implementation in ("xla", "reference") or (implementation == "triton" and not supports(x, weight)):
        return quantized_linear(x, weight)
    if implementation == "triton":
        from zgen.pallas.quantized_matmul import triton

        return triton.quantized_matmul(x, weight, interpret=interpret_pallas())
    raise ConfigError(f"unknown quantized_matmul implementation {implementation!r}; choose triton, xla or reference")
