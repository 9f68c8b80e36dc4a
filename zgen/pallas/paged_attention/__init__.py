"""Paged attention (decode, verification, chunked prefill) over (optionally quantized) KV pages."""

from zgen.pallas.paged_attention.api import append_and_attend, paged_attention, paged_decode_attention
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
    "append_and_attend",
    "paged_attention",
    "paged_decode_attention",
    "quantize",
    "quantize_fp8",
    "quantize_q3",
    "quantize_q4",
]
