"""Page bookkeeping shared by the paged-attention backends."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zgen.pallas.common import query_blocks
from zgen.shapes import cdiv


def query_bounds(q_positions: Int[Array, "*lead t"]) -> tuple[Int[Array, " *lead"], Int[Array, " *lead"]]:
    """The first and last position of the real (non-negative) queries along the last axis; both -1
    where there is none."""
    last = jnp.max(q_positions, axis=-1)
    first = jnp.min(jnp.where(q_positions >= 0, q_positions, last[..., None]), axis=-1)
    return first, jnp.maximum(last, -1)


def visible_pages(
    block_tables: Int[Array, "b pages_per_seq"],
    q_positions: Int[Array, "b t"],
    page_mask: Bool[Array, "b pages_per_seq"] | None,
    page_size: int,
    window: int | None,
) -> Bool[Array, "b pages_per_seq"]:
    """Pages that hold a key some query of the row can see: not past its last query, inside the
    window of its first, not masked."""
    first, last = query_bounds(q_positions)
    start = jnp.arange(block_tables.shape[1]) * page_size
    ok = start[None, :] <= last[:, None]
    if window is not None:
        ok &= start[None, :] + page_size > first[:, None] + 1 - window
    return ok if page_mask is None else ok & page_mask


def compact_pages(
    block_tables: Int[Array, "b pages_per_seq"], visible: Bool[Array, "b pages_per_seq"]
) -> tuple[Int[Array, "b pages_per_seq"], Int[Array, "b pages_per_seq"], Int[Array, " b"]]:
    """Move each row's visible pages to the front, in order.

    Returns the compacted page ids, the logical page index (position in the sequence) of each slot,
    and the count of visible pages. Kernels then loop over ``count`` slots with no per-page branch,
    which keeps their loads pipelined, and split work evenly over the pages that are really read.
    """
    n = block_tables.shape[1]
    slot = jnp.arange(n, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(visible, slot, n + slot), axis=1).astype(jnp.int32)
    tables = jnp.take_along_axis(block_tables, order, axis=1)
    return tables, order, jnp.sum(visible, axis=1, dtype=jnp.int32)


# Enough (batch, kv head, query block, split) programs to fill ~132 SMs several times over.
TARGET_PROGRAMS = 1024


def split_count(
    pages_per_seq: int, programs: int, num_splits: int | None, max_pages_per_split: int | None = None, target: int = TARGET_PROGRAMS
) -> int:
    """Splits of a row's pages: ``num_splits``, or enough for ``target`` programs over a grid of
    ``programs`` programs per split, and none longer than ``max_pages_per_split``."""
    longest = 1 if max_pages_per_split is None else cdiv(pages_per_seq, max_pages_per_split)
    return num_splits or min(pages_per_seq, max(1, cdiv(target, programs), longest))


def split_pages(
    block_tables: Int[Array, "b pages_per_seq"],
    page_mask: Bool[Array, "b pages_per_seq"],
    programs: int,
    num_splits: int | None,
    max_pages_per_split: int | None = None,
) -> tuple[int, Int[Array, "b padded"], Int[Array, "b padded"], Int[Array, " b"]]:
    """Compacted tables cut into equal splits for a grid of ``programs`` programs per split (by
    default enough for :data:`TARGET_PROGRAMS`, and no split longer than ``max_pages_per_split``).

    Returns pages per split and the compacted tables and logical page indices (both padded to a
    whole number of splits) and the visible-page counts.
    """
    pps = block_tables.shape[1]
    per_split = cdiv(pps, split_count(pps, programs, num_splits, max_pages_per_split))
    splits = cdiv(pps, per_split)
    tables, logical, count = compact_pages(block_tables, page_mask)
    pad = ((0, 0), (0, splits * per_split - pps))
    return per_split, jnp.pad(tables, pad), jnp.pad(logical, pad), count


def slot_ranges(
    logical: Int[Array, "b slots"],
    count: Int[Array, " b"],
    q_positions: Int[Array, "b blocks t"],
    page_size: int,
    window: int | None,
) -> tuple[Int[Array, "b blocks"], Int[Array, "b blocks"]]:
    """For each block of queries, the compacted slots ``[lo, hi)`` it must read: the visible pages
    from the window of its first query to its last query (compacted slots are in logical order)."""
    first, last = query_bounds(q_positions)
    used = jnp.arange(logical.shape[1])[None, :] < count[:, None]
    page = jnp.where(used, logical, jnp.iinfo(jnp.int32).max)[:, None, :]
    hi = jnp.sum(page <= (last // page_size)[..., None], axis=-1, dtype=jnp.int32)
    if window is None:
        return jnp.zeros_like(hi), hi
    lo = jnp.sum(page < (jnp.maximum(first + 1 - window, 0) // page_size)[..., None], axis=-1, dtype=jnp.int32)
    return jnp.minimum(lo, hi), hi


def group_queries(q: Float[Array, "b h d"], kv_heads: int, rows: int) -> Float[Array, "b kvh rows d"]:
    """Each kv head's query group (one token per sequence) as one tile, zero-padded to ``rows``."""
    tiles, _ = query_blocks(q[:, None], jnp.zeros(q.shape[:1] + (1,), jnp.int32), kv_heads, 1, rows)
    return tiles[:, :, 0]

