"""Paged decode on TPU: jax's own Mosaic TPU paged-attention kernel, for the cases it covers.

Its page layout is ours (``[kv_heads, num_pages, page_size, D]``, one table row per sequence), so no
copy is needed. It masks by length only, does not scale the query and knows none of our quantized
layouts: ``supports`` says when to use it, and the api falls back to XLA otherwise.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention
from jaxtyping import Array, Bool, Float, Int

from zgen.pallas.paged_attention.layouts import KVPages


def supports(k_pages: KVPages, *, page_mask_given: bool, sliding_window: int | None) -> bool:
    return isinstance(k_pages, jax.Array) and not page_mask_given and sliding_window is None


def _pages_per_block(pages_per_seq: int, page_size: int) -> int:
    """Largest divisor of pages_per_seq that keeps a compute block near 512 tokens."""
    best = 1
    for n in range(1, pages_per_seq + 1):
        if pages_per_seq % n == 0 and n * page_size <= max(512, page_size):
            best = n
    return best


def paged_decode_attention(
    q: Float[Array, "b h d"],
    k_pages: KVPages,
    v_pages: KVPages,
    block_tables: Int[Array, "b pages_per_seq"],
    lengths: Int[Array, " b"],
    page_mask: Bool[Array, "b pages_per_seq"],
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    interpret: bool = False,
) -> Float[Array, "b h d"]:
    del page_mask, sliding_window  # only called when `supports` holds: pages are masked by length alone
    assert isinstance(k_pages, jax.Array) and isinstance(v_pages, jax.Array)
    page_size = k_pages.shape[2]
    scope = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with scope:
        out = tpu_paged_attention(
            (q.astype(jnp.float32) * scale).astype(q.dtype),
            k_pages.astype(q.dtype),
            v_pages.astype(q.dtype),
            lengths,
            block_tables,
            attn_logits_soft_cap=soft_cap,
            pages_per_compute_block=_pages_per_block(block_tables.shape[1], page_size),
        )
    return jnp.where(lengths[:, None, None] > 0, out, 0).astype(q.dtype)
