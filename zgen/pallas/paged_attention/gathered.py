"""Paged attention for long query chunks: each row's pages gathered into one contiguous buffer
(dequantized, coded keys decoded) once per call, then :func:`~zgen.pallas.flash_attention`.

The paged kernel tiles keys by page and walks every visible page once per query block, dequantizing
it each time: a prefill chunk of ``T`` queries reads and dequantizes each page ``T / block_t`` times
(64 rows of a query tile: 16 tokens of a 4-query group), which made prefill into q4 pages 5.8x
slower than into the dense cache at 8,000 tokens (BENCHMARKS.md, "KV formats end to end"). Here
the pages are read once and the flash kernel's tiles (128 queries x 64 keys) do the rest. The price
is a transient full-precision copy of the rows' pages, so :func:`fits` bounds it and the caller
keeps the paged kernel for decode, short chunks and masked pages (a page mask cannot be expressed
as causal positions).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.pallas.flash_attention import flash_attention
from zgen.pallas.paged_attention.layouts import KeyCalibration, KVPages, gather_sequences, head_dim_of, leading_shape

# Query chunks at least this long per row go through the gather (shorter ones -- decode, verification
# -- read each page only a few times in the paged kernel).
MIN_QUERIES = 64
# Largest transient K + V copy the gather may make (bytes).
MAX_GATHER_BYTES = 1 << 30


def gathered_bytes(batch: int, pages_per_seq: int, pages: KVPages, dtype: jnp.dtype) -> int:
    """Bytes of the dequantized K and V copies of ``batch`` rows of ``pages_per_seq`` pages."""
    kv_heads, _, page_size = leading_shape(pages)
    return 2 * batch * pages_per_seq * page_size * kv_heads * head_dim_of(pages) * jnp.dtype(dtype).itemsize


def fits(num_queries: int, copy_bytes: int) -> bool:
    """Whether a call with ``num_queries`` per row and a gathered copy of ``copy_bytes`` should gather."""
    return num_queries >= MIN_QUERIES and copy_bytes <= MAX_GATHER_BYTES


def paged_attention(
    q: Float[Array, "b t h d"],
    k_pages: KVPages,
    v_pages: KVPages,
    block_tables: Int[Array, "b pages_per_seq"],
    q_positions: Int[Array, "b t"],
    pages: object,
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    key_calibration: KeyCalibration | None = None,
) -> Float[Array, "b t h d"]:
    """The backend (see the module docstring). ``block_tables`` must name a readable page at every
    slot (the API points invisible entries at page 0); keys past a query's position are invisible by
    causality, so the visible-page mask ``pages`` is not needed."""
    del pages
    k = gather_sequences(k_pages, block_tables, q.dtype)
    v = gather_sequences(v_pages, block_tables, q.dtype)
    if key_calibration is not None:
        slots = jnp.arange(k.shape[1])[None, :, None]
        k = key_calibration.decode(k, slots, head_axis=-2, dot_dtype=q.dtype).astype(q.dtype)
    return flash_attention(q, k, v, q_positions=q_positions, sliding_window=sliding_window, soft_cap=soft_cap, scale=scale)
