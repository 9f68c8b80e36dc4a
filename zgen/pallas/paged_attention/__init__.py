"""Paged decode attention over (optionally quantized) KV pages."""

from zgen.pallas.paged_attention.api import paged_decode_attention
from zgen.pallas.paged_attention.layouts import (
    Fp8Pages,
    KVPages,
    Q3Pages,
    Q4Pages,
    QuantizedPages,
    quantize,
    quantize_fp8,
    quantize_q3,
    quantize_q4,
)

__all__ = [
    "Fp8Pages",
    "KVPages",
    "Q3Pages",
    "Q4Pages",
    "QuantizedPages",
    "paged_decode_attention",
    "quantize",
    "quantize_fp8",
    "quantize_q3",
    "quantize_q4",
]
