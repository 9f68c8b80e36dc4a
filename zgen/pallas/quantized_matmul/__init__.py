"""Weight-only quantized matrix products for decode steps (a few rows against int8/int4 weights)."""

from zgen.pallas.quantized_matmul.api import quantized_matmul, supports

__all__ = ["quantized_matmul", "supports"]
