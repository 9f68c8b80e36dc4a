"""Paged attention for long query chunks: each row's pages gathered into one contiguous buffer
(dequantized, coded keys decoded) once per call, then :func:`~zgen.pallas.flash_attention`.

The paged kernel tiles keys by page and walks every visible page once per query block, dequantizing
it each time: a prefill chunk of ``T`` queries reads and dequantizes each page ``T / block_t`` times
(64 rows of a query tile: 16 tokens of a 4-query group), which made prefill into q4 pages 5.8x
slower than into the dense cache at 8,000 tokens (BENCHMARKS.md, "KV formats end to end"). Here
the pages are read once and the flash kernel's tiles (128 queries x 64 keys) do the rest. The price
is a transient full-precision copy of the rows' pages, at most :data:`MAX_GATHER_BYTES` at a time:
a batch whose copy would be larger is gathered and attended a group of rows after another (a layer's
K and V of 32 rows of 32,000 tokens at Llama-3-8B's shape are 3.9 GiB in bf16: groups of 8). The
caller keeps the paged kernel for decode, short chunks, masked pages (a page mask cannot be expressed
as causal positions) and rows too long for one row's copy to fit (:func:`fits`).
"""

from __future__ import annotations

import jax
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


def fits(num_queries: int, row_bytes: int) -> bool:
    """Whether a call with ``num_queries`` per row, one row of whose gathered copy takes ``row_bytes``,
    should gather."""
    return num_queries >= MIN_QUERIES and row_bytes <= MAX_GATHER_BYTES


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
    b = q.shape[0]
    groups = -(-gathered_bytes(b, block_tables.shape[1], k_pages, q.dtype) // MAX_GATHER_BYTES)
    attend = lambda q, tables, positions: _attend(  # noqa: E731
        q, k_pages, v_pages, tables, positions, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        key_calibration=key_calibration,
    )
    if groups <= 1:
        return attend(q, block_tables, q_positions)
    # One group after another (a loop, not unrolled calls XLA could run side by side): one copy at a
    # time. Padding rows (position -1) fill the last group; their outputs are zeros and dropped.
    rows = -(-b // groups)
    pad = groups * rows - b
    grouped = (
        jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill).reshape(groups, rows, *x.shape[1:])
        for x, fill in ((q, 0), (block_tables, 0), (q_positions, -1))
    )
    out = jax.lax.map(lambda group: attend(*group), tuple(grouped))
    return out.reshape(groups * rows, *q.shape[1:])[:b]


def _attend(
    q: Float[Array, "b t h d"],
    k_pages: KVPages,
    v_pages: KVPages,
    block_tables: Int[Array, "b pages_per_seq"],
    q_positions: Int[Array, "b t"],
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    key_calibration: KeyCalibration | None,
) -> Float[Array, "b t h d"]:
    """The rows' pages gathered into one buffer (keys decoded), then flash attention."""
    k = gather_sequences(k_pages, block_tables, q.dtype)
    v = gather_sequences(v_pages, block_tables, q.dtype)
    if key_calibration is not None:
        slots = jnp.arange(k.shape[1])[None, :, None]
        k = key_calibration.decode(k, slots, head_axis=-2, dot_dtype=q.dtype).astype(q.dtype)
    return flash_attention(q, k, v, q_positions=q_positions, sliding_window=sliding_window, soft_cap=soft_cap, scale=scale)
