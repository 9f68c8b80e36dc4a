"""Causal prefill on Hopper: zgen's own Mosaic GPU kernel (TMA, WGMMA, warp specialization), bf16 or f16.

One program per (query tile, query head, batch row); a tile is ``CONSUMERS x BLOCK_Q`` queries. Three
warpgroups: a producer streams the tile's key/value blocks of ``block_kv`` rows from HBM into a ring
of ``stages`` shared-memory slots with TMA (``*_ready`` barriers), and each of two consumers owns
``BLOCK_Q`` query rows and runs the online softmax over the blocks with two WGMMAs per block, handing
each slot back (``*_free`` barriers, one arrival per consumer) once both read it. The consumers
alternate on the tensor cores (FlashAttention-3's ping-pong: ``turn`` is a barrier both must reach,
and consumer 1 starts one phase behind), so one's softmax overlaps the other's matrix products.
Causality: a consumer reads only blocks up to its last row and masks only the blocks that cross the
diagonal; query tiles run heaviest (last) first, so the short tiles fill the tail of the launch.

jax's bundled kernel (``attention_mgpu``) has the same shape but keeps float16 shared-memory tiles
whatever the input dtype, so it cannot run bf16. Right-padded ragged rows fit causal self-attention:
a valid query never sees a key past its own position, so padding keys only reach padding queries,
whose outputs are zeroed. Everything else (``q_positions``, windows, soft caps, head_dim > 128) goes to
the Triton kernel (``supports`` decides).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from zgen.errors import ConfigError
from zgen.pallas.common import RUNNING_MAX_INIT, broadcast_rows, is_query
from zgen.pallas.mosaic_gpu_utils import ROW_LAYOUT, Ref, swizzled
from zgen.shapes import cdiv

BLOCK_Q = 64  # query rows per consumer warpgroup: WGMMA's M
CONSUMERS = 2
BLOCK_KV, STAGES = 128, 2
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def supports(
    q: Array,
    k: Array,
    *,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    q_positions: Array | None = None,
) -> bool:
    """Causal self-attention from slot 0 in bf16/f16 with head_dim 64 or 128 (the shared-memory ring
    of two 128-row key and value blocks must fit beside the query tiles)."""
    return (
        causal
        and q_positions is None
        and sliding_window is None
        and soft_cap is None
        and q.shape[1] == k.shape[1]
        and q.shape[-1] in (64, 128)
        and jnp.dtype(q.dtype) in DTYPES
        and jnp.dtype(k.dtype) == jnp.dtype(q.dtype)
    )


def _body(
    q_gmem: Ref,
    k_gmem: Ref,
    v_gmem: Ref,
    o_gmem: Ref,
    smem: tuple[Ref, Ref, Ref],
    ready: tuple[Ref, Ref, Ref],
    free: tuple[Ref, Ref],
    turn: Ref,
    *,
    tiles: int,
    group: int,
    block_kv: int,
    stages: int,
    scale: float,
) -> None:
    q_smem, k_smem, v_smem = smem
    k_ready, v_ready, q_ready = ready
    k_free, v_free = free
    tile = tiles - 1 - jax.lax.axis_index("tile")  # heaviest first (the tile axis varies slowest)
    head, row = jax.lax.axis_index("head"), jax.lax.axis_index("b")
    wg = jax.lax.axis_index("wg")
    tile_start = tile * (CONSUMERS * BLOCK_Q)
    blocks = pl.cdiv(tile_start + CONSUMERS * BLOCK_Q, block_kv)  # what the later consumer reads

    def handoff() -> None:
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < CONSUMERS)
    def _consume() -> None:
        plgpu.set_max_registers(232, action="increase")
        my_q = q_smem.at[wg]
        q_start = tile_start + wg * BLOCK_Q
        needed = pl.cdiv(q_start + BLOCK_Q, block_kv)
        unmasked = q_start // block_kv  # blocks wholly at or below the diagonal
        plgpu.copy_gmem_to_smem(q_gmem.at[row, pl.ds(q_start, BLOCK_Q), head], my_q, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        # The running max is kept in scaled log2 units: each probability is exp2 of one fused multiply-add.
        log2_scale = scale * math.log2(math.e)

        def step(j: Array, carry: tuple[Array, Array, Array], *, masked: bool) -> tuple[Array, Array, Array]:
            m, l, acc = carry
            slot = jax.lax.rem(j, stages)
            plgpu.barrier_wait(k_ready.at[slot])

            def qk(acc_ref: Ref) -> Array:
                plgpu.wgmma(acc_ref, my_q, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                handoff()  # the other consumer takes the tensor cores while this one waits
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.WGMMAAccumulatorRef((BLOCK_Q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA) + q_start
                cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA) + j * block_kv
                s = jnp.where(cols <= rows, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * log2_scale)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * log2_scale - broadcast_rows(m_new, s.shape))
            l = l * alpha + p.sum(axis=1)
            acc = acc * broadcast_rows(alpha, acc.shape)
            p_dot = p.astype(q_smem.dtype)
            plgpu.barrier_wait(v_ready.at[slot])
            handoff()  # softmax done: wait for the tensor cores

            def pv(acc_ref: Ref) -> None:
                plgpu.wgmma(acc_ref, p_dot, v_smem.at[slot])

            acc = pl.run_state(pv)(plgpu.WGMMAAccumulatorRef.init(acc))  # the accumulator's final value
            plgpu.barrier_arrive(v_free.at[slot])
            return m_new, l, acc  # type: ignore[return-value]  # run_state returns the value, typed as the ref

        def release(j: Array, _: None) -> None:
            """A block the other consumer still reads: hand the slot back and keep the turns in step."""
            slot = jax.lax.rem(j, stages)
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            handoff()
            handoff()

        carry = (
            plgpu.layout_cast(jnp.full((BLOCK_Q,), RUNNING_MAX_INIT, jnp.float32), ROW_LAYOUT),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), ROW_LAYOUT),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q, my_q.shape[-1]), jnp.float32), plgpu.Layout.WGMMA),
        )
        pl.when(wg == 1)(handoff)  # consumer 1 runs one phase behind
        carry = jax.lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
        _, l, acc = jax.lax.fori_loop(unmasked, needed, functools.partial(step, masked=True), carry)
        jax.lax.fori_loop(needed, blocks, release, None)
        pl.when(wg == 0)(handoff)  # and consumer 0 ends one later, so both reach it equally often
        my_q[...] = (acc / broadcast_rows(l, acc.shape)).astype(my_q.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_q, o_gmem.at[row, pl.ds(q_start, BLOCK_Q), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _produce() -> None:
        plgpu.set_max_registers(40, action="decrease")
        kv_head = jax.lax.div(head, group)

        def fetch(j: Array | int, slot: Array | int) -> None:
            block = (row, pl.ds(j * block_kv, block_kv), kv_head)
            plgpu.copy_gmem_to_smem(k_gmem.at[block], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_gmem.at[block], v_smem.at[slot], v_ready.at[slot])

        for j in range(stages):
            pl.when(j < blocks)(functools.partial(fetch, j, j))

        @pl.loop(stages, jnp.maximum(blocks, stages))
        def _refill(j: Array) -> None:
            slot = jax.lax.rem(j, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            fetch(j, slot)


def flash_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kvh d"],
    v: Float[Array, "b s kvh d"],
    lengths: Int[Array, " b"],
    *,
    q_positions: None = None,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    scale: float,
    block_kv: int = BLOCK_KV,
    stages: int = STAGES,
) -> Float[Array, "b t h d"]:
    if not supports(q, k, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap, q_positions=q_positions):
        raise ConfigError(
            "implementation='mosaic_gpu' prefill covers causal bf16/f16 self-attention with head_dim 64 or 128, "
            "without window, soft cap or q_positions; pass implementation=None to let zgen choose"
        )
    b, t, h, d = q.shape
    multiple = math.lcm(CONSUMERS * BLOCK_Q, block_kv)
    padded = cdiv(t, multiple) * multiple
    pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
    tiles = padded // (CONSUMERS * BLOCK_Q)
    body = functools.partial(
        _body, tiles=tiles, group=h // k.shape[2], block_kv=block_kv, stages=stages, scale=scale
    )

    def entry(q_gmem: Ref, k_gmem: Ref, v_gmem: Ref, o_gmem: Ref) -> None:
        ring = lambda: plgpu.SMEM((stages, block_kv, d), q.dtype, transforms=swizzled())  # noqa: E731
        pl.run_scoped(
            lambda *scoped: body(q_gmem, k_gmem, v_gmem, o_gmem, *scoped),
            (plgpu.SMEM((CONSUMERS, BLOCK_Q, d), q.dtype, transforms=swizzled()), ring(), ring()),
            (
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=CONSUMERS),
            ),
            (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=CONSUMERS),
            collective_axes="wg",
        )

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((b, padded, h, d), q.dtype),
        grid=(h, b, tiles),
        grid_names=("head", "b", "tile"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*(jnp.pad(x, pad) for x in (q, k, v)))[:, :t]
    real = is_query(jnp.arange(t)[None, :], lengths[:, None])
    return jnp.where(real[:, :, None, None], out, 0).astype(q.dtype)
