"""Page bookkeeping and key rotation (RoPE) shared by the paged-attention backends."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def visible_pages(
    block_tables: Int[Array, "b pages_per_seq"],
    lengths: Int[Array, " b"],
    page_mask: Bool[Array, "b pages_per_seq"] | None,
    page_size: int,
    window: int | None,
) -> Bool[Array, "b pages_per_seq"]:
    """Pages that hold at least one visible key: inside the length, inside the window, not masked."""
    start = jnp.arange(block_tables.shape[1]) * page_size
    ok = start[None, :] < lengths[:, None]
    if window is not None:
        ok &= start[None, :] + page_size > lengths[:, None] - window
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


# Enough (batch, kv head, split) programs to fill ~132 SMs several times over when batch x heads is small.
TARGET_PROGRAMS = 1024


def split_pages(
    block_tables: Int[Array, "b pages_per_seq"],
    page_mask: Bool[Array, "b pages_per_seq"],
    kv_heads: int,
    num_splits: int | None,
) -> tuple[int, Int[Array, "b padded"], Int[Array, "b padded"], Int[Array, " b"]]:
    """Compacted tables cut into equal splits for a ``(batch, kv_head, split)`` kernel grid.

    Returns pages per split and the compacted tables, logical page indices (both padded to a whole
    number of splits) and visible-page counts.
    """
    b, pps = block_tables.shape
    splits = num_splits or min(pps, max(1, -(-TARGET_PROGRAMS // (b * kv_heads))))
    per_split = -(-pps // splits)
    splits = -(-pps // per_split)
    tables, logical, count = compact_pages(block_tables, page_mask)
    pad = ((0, 0), (0, splits * per_split - pps))
    return per_split, jnp.pad(tables, pad), jnp.pad(logical, pad), count


def group_queries(q: Float[Array, "b h d"], kv_heads: int, rows: int) -> Float[Array, "b kvh rows d"]:
    """Each kv head's query group as one tile, zero-padded to the ``rows`` a matrix unit needs."""
    b, h, d = q.shape
    g = h // kv_heads
    return jnp.pad(q.reshape(b, kv_heads, g, d), ((0, 0), (0, 0), (0, rows - g), (0, 0)))


def rope_cos_sin(
    positions: Int[Array, "*lead"], inv_freq: Float[Array, " half"]
) -> tuple[Float[Array, "*lead half"], Float[Array, "*lead half"]]:
    """Cosines and sines of the rotary angles ``position * inv_freq``, in float32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def rotate_halves(
    x1: Float[Array, "*lead half"], x2: Float[Array, "*lead half"], cos: Float[Array, "*lead half"], sin: Float[Array, "*lead half"]
) -> tuple[Float[Array, "*lead half"], Float[Array, "*lead half"]]:
    """Rotate-half RoPE on the two halves of head vectors (dim ``d`` pairs with dim ``d + D/2``).

    Kernels call it on matching tiles of the halves, so they never shuffle lanes across a tile.
    """
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def apply_rope(x: Float[Array, "*lead d"], positions: Int[Array, "*lead"], inv_freq: Float[Array, " half"]) -> Float[Array, "*lead d"]:
    """Rotate-half RoPE of head vectors ``x`` at ``positions`` (broadcast against ``x``'s leading
    dims), computed in float32 and returned in ``x``'s dtype."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate(rotate_halves(x1, x2, cos, sin), axis=-1).astype(x.dtype)
