"""Paged decode attention as a Mosaic GPU kernel (Hopper): TMA-pipelined pages, WGMMA dots.

Grid ``(batch, kv_head, split)`` like the Triton kernel. One warpgroup per program: the query group
(padded to the 64 rows a WGMMA needs) sits in shared memory; ``emit_pipeline`` streams the split's
compacted pages into shared memory with TMA, ``max_concurrent_steps`` pages ahead, the page id read
from the block table in the index map; each page is two WGMMAs around an online softmax.
Unquantized pages only (bf16/f16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Bool, Float, Int

from zgen.errors import ConfigError
from zgen.pallas.common import RUNNING_MAX_INIT, broadcast_rows, merge_partials, softmax_rescale, soft_cap as apply_soft_cap
from zgen.pallas.mosaic_gpu_utils import ROW_LAYOUT, Ref, swizzled
from zgen.pallas.paged_attention.common import group_queries, split_pages
from zgen.pallas.paged_attention.layouts import KVPages, leading_shape

ROWS = 64  # WGMMA's M


def supports(k_pages: KVPages, q: Array) -> bool:
    return (
        isinstance(k_pages, jax.Array)
        and k_pages.dtype == q.dtype
        and jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and q.shape[-1] % 64 == 0
        and q.shape[1] // k_pages.shape[0] <= ROWS
        and k_pages.shape[2] % 64 == 0
    )


def _body(
    q_gmem: Ref,
    k_gmem: Ref,
    v_gmem: Ref,
    tables_gmem: Ref,
    logical_gmem: Ref,
    count_gmem: Ref,
    length_gmem: Ref,
    o_gmem: Ref,
    lse_gmem: Ref,
    *,
    page_size: int,
    per_split: int,
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> None:
    b, h, split = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("s")
    length, count = length_gmem[b], count_gmem[b]
    first = split * per_split
    steps = jnp.clip(count - first, 0, per_split)  # only the visible pages of this split are read
    head_dim = q_gmem.shape[-1]

    def scoped(q_smem: Ref, o_smem: Ref, lse_smem: Ref, barrier: Ref) -> None:
        plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, barrier)
        plgpu.barrier_wait(barrier)

        def step(idx: tuple[Array, ...], k_smem: Ref, v_smem: Ref, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            m, l, acc = carry
            slot = first + idx[0]

            def qk(acc_ref: Ref) -> Array:
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.WGMMAAccumulatorRef((ROWS, page_size), jnp.float32))
            s = apply_soft_cap(s * scale, soft_cap)
            col = plgpu.broadcasted_iota(jnp.int32, (ROWS, page_size), 1, layout=plgpu.Layout.WGMMA)
            pos = logical_gmem[b, slot] * page_size + col
            ok = pos < length
            if window is not None:
                ok &= pos >= length - window
            s = jnp.where(ok, s, -jnp.inf)
            m, l, p, alpha = softmax_rescale(m, l, s)
            p16 = p.astype(v_smem.dtype)

            def pv(acc_ref: Ref) -> Array:
                plgpu.wgmma(acc_ref, p16, v_smem)
                return acc_ref[...]

            # A fresh accumulator plus a register add: decode is memory-bound, the add is free.
            pv_tile = pl.run_scoped(pv, plgpu.WGMMAAccumulatorRef((ROWS, head_dim), jnp.float32))
            return m, l, acc * broadcast_rows(alpha, acc.shape) + pv_tile

        spec = plgpu.BlockSpec(
            (page_size, head_dim), lambda i: (tables_gmem[b, first + i], 0), transforms=swizzled()
        )
        # The loop carry must start in the layouts the WGMMA results have.
        init = (
            plgpu.layout_cast(jnp.full((ROWS,), RUNNING_MAX_INIT, jnp.float32), ROW_LAYOUT),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), ROW_LAYOUT),
            plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        )
        m, l, acc = plgpu.emit_pipeline(
            step, grid=(steps,), in_specs=[spec, spec], max_concurrent_steps=min(2, per_split), init_carry=init
        )(k_gmem.at[h], v_gmem.at[h])
        seen = l > 0
        safe_l = jnp.where(seen, l, 1.0)
        o_smem[...] = acc / broadcast_rows(safe_l, acc.shape)
        lse_smem[...] = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[b, h, split])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((ROWS, head_dim), q_gmem.dtype, transforms=swizzled()),
        plgpu.SMEM((ROWS, head_dim), jnp.float32),
        plgpu.SMEM((ROWS,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
    )


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
    num_splits: int | None = None,
) -> Float[Array, "b h d"]:
    if not supports(k_pages, q):
        raise ConfigError(
            "implementation='mosaic_gpu' paged decode takes bf16/f16 pages with page_size and head_dim multiples of 64; "
            "pass implementation=None to let zgen choose"
        )
    assert isinstance(k_pages, jax.Array) and isinstance(v_pages, jax.Array)
    b, h, d = q.shape
    kvh, num_pages, page_size = leading_shape(k_pages)
    g = h // kvh
    qg = group_queries(q, kvh, ROWS)
    per_split, tables, logical, count = split_pages(block_tables, page_mask, b * kvh, num_splits)
    splits = tables.shape[1] // per_split
    body = functools.partial(
        _body,
        page_size=page_size,
        per_split=per_split,
        scale=scale,
        soft_cap=soft_cap,
        window=sliding_window,
    )
    # Pages of one head as rows: block (page_size, D) at block index (page id, 0).
    rows = (kvh, num_pages * page_size, d)
    out, lse = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((b, kvh, splits, ROWS, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, ROWS), jnp.float32),
        ),
        grid=(b, kvh, splits),
        grid_names=("b", "h", "s"),
    )(qg, k_pages.reshape(rows), v_pages.reshape(rows), tables, logical, count, lengths)
    return merge_partials(out, lse)[:, :, :g].reshape(b, h, d).astype(q.dtype)
