"""Flash attention as Pallas kernels on the Triton backend (GPU; interpretable on CPU).

Two kernels, picked by how many query rows share a kv head (``T * H / KVH``):

- prefill, grid ``(batch, q_head, q_block)``: each program streams the key blocks its queries can see
  (bounded by their positions, the row's length and the sliding window) through an online softmax.
  Only the key blocks that straddle a boundary pay for the mask: interior blocks run an unmasked loop.
- decode (few rows, e.g. one token per sequence), grid ``(batch, kv_head, split)``: each program takes
  every query row of one kv head (the head group, padded to 16 rows for the tensor cores) through an
  equal share of the visible key blocks, so K/V are read once per kv head and a batch of one still fills
  the GPU; the splits are merged by log-sum-exp outside (flash-decoding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from zgen.pallas.common import (
    RUNNING_MAX_INIT,
    base2_logits,
    finish_softmax,
    is_query,
    key_block_range,
    merge_partials,
    query_blocks,
    query_positions,
    query_span,
    softmax_rescale,
    ungroup_queries,
    visible,
)
from zgen.pallas.triton_utils import MIN_DOT, dot_nn, dot_nt, load_rotated, own_key_carry, rope_table
from zgen.shapes import cdiv, next_pow2

# Query rows per kv head up to which the decode kernel runs: beyond, the prefill grid has enough programs.
DECODE_MAX_ROWS = 64
# Query and key block of the prefill kernel for float32 inputs (bf16's blocks spill in float32).
F32_BLOCK = 32
# Decode splits: enough (batch, kv head, split) programs to fill ~132 SMs several times over, but each
# split at least MIN_BLOCKS_PER_SPLIT key blocks of the buffer so its loads can pipeline and the f32
# partial outputs stay small next to the K/V they summarize.
TARGET_PROGRAMS = 1024
MIN_BLOCKS_PER_SPLIT = 4
# The appending decode kernel splits the keys down to one block of APPEND_BLOCK_K per split: few rows
# (SmolLM2 at batch 1 has 3 kv heads) otherwise walk their key blocks one after another in 3 programs.
# A buffer of one block keeps one split, which finishes the softmax itself (no merge launch). On an
# H200 (SmolLM2 shape, batch 1) this took a decode step from 0.71 to 0.53 ms at 450 tokens of context
# and from 0.94 to 0.53 ms at 900, against blocks of 64 in one split up to 16 blocks.
APPEND_BLOCK_K = 128
# It aims at fewer programs than the decode kernel's TARGET_PROGRAMS: every split reads its whole
# range of the buffer's blocks (the live length is known on the device only) and the merge reads
# every split's partials. On an H200 (2,048 slots, 450 and 1,000 tokens of context, bf16), 256
# programs against 1,024: Llama-3-8B heads (32/8 of 128) at batch 8 24.6 -> 16.6 and 30.4 -> 20.5 us,
# at batch 64 57.7 -> 49.8 and 88.4 -> 79.8; SmolLM2 (9/3 of 64) at batch 64 19.9 -> 16.8 and
# 31.9 -> 23.9; batch 1 unchanged.
APPEND_TARGET_PROGRAMS = 256
# Bytes of one stage's K and V blocks at most (two stages stay under a Hopper SM's 227 KB of shared memory).
APPEND_BLOCK_BYTES = 64 * 1024


def _attend_block(
    q: Array,
    q_pos: Array,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    length: Array,
    j: Array,
    carry: tuple[Array, Array, Array],
    *,
    block_k: int,
    masked: bool,
    causal: bool,
    window: int | None,
    scale: float,
    soft_cap: float | None,
) -> tuple[Array, Array, Array]:
    """One online-softmax step of the query tile over key block ``j``."""
    m, l, acc = carry
    k = k_ref[pl.ds(j * block_k, block_k), :]
    v = v_ref[pl.ds(j * block_k, block_k), :]
    s = base2_logits(dot_nt(q, k), scale, soft_cap)
    if masked:
        k_pos = j * block_k + jnp.arange(block_k)
        s = jnp.where(visible(q_pos[:, None], k_pos[None, :], length, causal=causal, window=window), s, -jnp.inf)
    m, l, p, alpha = softmax_rescale(m, l, s, base2=True)
    return m, l, acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)


def _init_carry(q: Array) -> tuple[Array, Array, Array]:
    rows = q.shape[0]
    return (
        jnp.full((rows,), RUNNING_MAX_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )


def _prefill_kernel(
    q_ref: jax.Ref,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    pos_ref: jax.Ref,
    length_ref: jax.Ref,
    o_ref: jax.Ref,
    *,
    block_k: int,
    num_k_blocks: int,
    causal: bool,
    window: int | None,
    scale: float,
    soft_cap: float | None,
) -> None:
    length = length_ref[0]
    q = q_ref[...]
    q_pos = pos_ref[...]
    step = functools.partial(
        _attend_block, q, q_pos, k_ref, v_ref, length,
        block_k=block_k, causal=causal, window=window, scale=scale, soft_cap=soft_cap,
    )

    first, last = query_span(q_pos, length)
    lo, hi = key_block_range(
        first, last, length, block_k=block_k, num_k_blocks=num_k_blocks, causal=causal, window=window
    )
    # Key blocks in [full_lo, full_hi) are visible to every real query here (positions first..last).
    full_end = jnp.minimum(length, first + 1) if causal else length
    full_hi = jnp.clip(full_end // block_k, lo, hi)
    full_lo = lo if window is None else jnp.clip((last - window + block_k) // block_k, lo, hi)
    full_hi = jnp.maximum(full_hi, full_lo)

    masked, unmasked = functools.partial(step, masked=True), functools.partial(step, masked=False)
    carry = jax.lax.fori_loop(lo, full_lo, masked, _init_carry(q))
    carry = jax.lax.fori_loop(full_lo, full_hi, unmasked, carry)
    m, l, acc = jax.lax.fori_loop(full_hi, hi, masked, carry)
    out = finish_softmax(acc, m, l, base2=True)[0]
    o_ref[...] = jnp.where(is_query(q_pos, length)[:, None], out, 0.0).astype(o_ref.dtype)


def _decode_kernel(
    q_ref: jax.Ref,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    pos_ref: jax.Ref,
    length_ref: jax.Ref,
    o_ref: jax.Ref,
    lse_ref: jax.Ref,
    *,
    block_k: int,
    num_k_blocks: int,
    num_splits: int,
    causal: bool,
    window: int | None,
    scale: float,
    soft_cap: float | None,
) -> None:
    length = length_ref[0]
    q = q_ref[...]
    q_pos = pos_ref[...]
    first, last = query_span(q_pos, length)
    lo, hi = key_block_range(
        first, last, length, block_k=block_k, num_k_blocks=num_k_blocks, causal=causal, window=window
    )
    # The visible blocks (not the whole buffer) are cut into equal splits: balanced at any row length.
    per_split = (hi - lo + num_splits - 1) // num_splits
    start = lo + pl.program_id(2) * per_split
    step = functools.partial(
        _attend_block, q, q_pos, k_ref, v_ref, length,
        block_k=block_k, masked=True, causal=causal, window=window, scale=scale, soft_cap=soft_cap,
    )
    m, l, acc = jax.lax.fori_loop(start, jnp.minimum(start + per_split, hi), step, _init_carry(q))
    out, lse = finish_softmax(acc, m, l, base2=True)
    real = is_query(q_pos, length)
    o_ref[...] = jnp.where(real[:, None], out, 0.0)
    lse_ref[...] = jnp.where(real, lse, -jnp.inf)


def _pad_keys(k: Array, v: Array, block_k: int) -> tuple[Array, Array]:
    """Keys padded to whole blocks (a copy: callers keep buffers a multiple of the block, as caches do)."""
    pad = -k.shape[1] % block_k
    if not pad:
        return k, v
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    return jnp.pad(k, widths), jnp.pad(v, widths)


def prefill_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kvh d"],
    v: Float[Array, "b s kvh d"],
    lengths: Int[Array, " b"],
    q_positions: Int[Array, "b t"],
    *,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    scale: float,
    interpret: bool = False,
    block_q: int = 128,
    block_k: int = 64,
    num_warps: int | None = None,
    num_stages: int = 3,
) -> Float[Array, "b t h d"]:
    # Defaults = the best config measured on an H200 (jax 0.11.2, 32/8 heads, d=128, causal bf16):
    # q128 k64, 8 warps, 3 stages: 237 TFLOP/s at 4k, 316 at 8k (0.53 of matmul); with 2 stages it was
    # 226 / 269. q128 k128 w8 s2 was within 3% at 4k and 2% slower at 8k: one config for all sizes.
    if jnp.dtype(q.dtype).itemsize > 2:
        # float32 tiles that large spill: a SmolLM2 prefill chunk's call took 2.6 ms inside the model;
        # alone at 512 tokens, q32 k32, 4 warps, 2 stages take 0.30 ms (BENCHMARKS.md, "float32 prefill").
        block_q, block_k = min(block_q, F32_BLOCK), min(block_k, F32_BLOCK)
        num_warps, num_stages = num_warps or 4, min(num_stages, 2)
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bq = min(block_q, max(MIN_DOT, next_pow2(t)))
    bk = min(block_k, max(MIN_DOT, next_pow2(s)))
    pad_q = ((0, 0), (0, -t % bq))
    q = jnp.pad(q, (*pad_q, (0, 0), (0, 0)))
    positions = jnp.pad(q_positions, pad_q, constant_values=-1)  # padding queries see nothing
    k, v = _pad_keys(k, v, bk)
    kernel = functools.partial(
        _prefill_kernel,
        block_k=bk,
        num_k_blocks=k.shape[1] // bk,
        causal=causal,
        window=sliding_window,
        scale=scale,
        soft_cap=soft_cap,
    )
    kv_spec = pl.BlockSpec((None, k.shape[1], None, d), lambda b, h, i: (b, 0, h // g, 0))
    q_spec = pl.BlockSpec((None, bq, None, d), lambda b, h, i: (b, i, h, 0))
    out = pl.pallas_call(
        kernel,
        grid=(b, h, q.shape[1] // bq),
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, 1), lambda b, h, i: (b, 0)),
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or (4 if d <= 64 else 8), num_stages=num_stages
        ),
        interpret=interpret,
        name="zgen_flash_attention",
    )(q, k, v, positions, lengths[:, None])
    return out[:, :t]


def _decode_splits(
    batch: int, kv_heads: int, num_k_blocks: int, min_blocks: int = MIN_BLOCKS_PER_SPLIT, target: int = TARGET_PROGRAMS
) -> int:
    """Key splits of a decode kernel: about ``target`` programs, each at least ``min_blocks`` key blocks."""
    return max(1, min(cdiv(target, batch * kv_heads), cdiv(num_k_blocks, min_blocks)))


def _split_specs(rows: int, d: int) -> list[pl.BlockSpec]:
    """Blocks of a split-K decode kernel's partial outputs (grid ``(batch, kv_head, split)``)."""
    return [
        pl.BlockSpec((None, None, None, rows, d), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
    ]


def _split_shapes(b: int, kvh: int, splits: int, rows: int, d: int) -> list[jax.ShapeDtypeStruct]:
    """Each split's f32 output over its own keys and their log-sum-exp, merged outside (``merge_partials``)."""
    return [
        jax.ShapeDtypeStruct((b, kvh, splits, rows, d), jnp.float32),
        jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32),
    ]


def decode_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kvh d"],
    v: Float[Array, "b s kvh d"],
    lengths: Int[Array, " b"],
    q_positions: Int[Array, "b t"],
    *,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    scale: float,
    interpret: bool = False,
    block_k: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Float[Array, "b t h d"]:
    # Defaults follow the paged decode kernel's measured best (64-token steps, 4 warps, 3 stages);
    # still to be timed on the GPU for this contiguous layout.
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    rows = max(MIN_DOT, next_pow2(t * g))
    bk = min(block_k, max(MIN_DOT, next_pow2(s)))
    k, v = _pad_keys(k, v, bk)
    num_k_blocks = k.shape[1] // bk
    splits = num_splits or _decode_splits(b, kvh, num_k_blocks)
    # All queries of a sequence in one tile per kv head: row t * G + i is query head j * G + i at query t.
    tiles, tile_positions = query_blocks(q, q_positions, kvh, t, rows)
    grouped, positions = tiles[:, :, 0], tile_positions[:, 0]
    kernel = functools.partial(
        _decode_kernel,
        block_k=bk,
        num_k_blocks=num_k_blocks,
        num_splits=splits,
        causal=causal,
        window=sliding_window,
        scale=scale,
        soft_cap=soft_cap,
    )
    kv_spec = pl.BlockSpec((None, k.shape[1], None, d), lambda b, h, s: (b, 0, h, 0))
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda b, h, s: (b, h, 0, 0)),
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, rows), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
        ],
        out_specs=_split_specs(rows, d),
        out_shape=_split_shapes(b, kvh, splits, rows, d),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="zgen_flash_decode",
    )(grouped, k, v, positions, lengths[:, None])
    return ungroup_queries(merge_partials(out, lse)[:, :, None], t, h, t).astype(q.dtype)


def _append_decode_kernel(
    heads_ref: jax.Ref,
    rope_ref: jax.Ref,
    pos_ref: jax.Ref,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    *out_refs: jax.Ref,
    kv_heads: int,
    group: int,
    rows: int,
    capacity: int,
    block_k: int,
    num_k_blocks: int,
    num_splits: int,
    window: int | None,
    scale: float,
    soft_cap: float | None,
) -> None:
    """One query token per row: store its key/value in slot ``pos`` and attend over slots ``0..pos``.

    ``heads_ref`` holds the row's query heads, then its new keys, then its new values, before RoPE;
    ``rope_ref`` the rotation at ``pos`` (``rope_table``). The stored slots ``< pos`` come from the buffer and the token's own
    key from registers, so no program waits for the write: split 0 stores the slot after its loop
    (another split may load that slot meanwhile, old or new, and masks it either way)."""
    o_ref, k_out_ref, v_out_ref = out_refs[0], out_refs[-2], out_refs[-1]
    kv_head, split = pl.program_id(1), pl.program_id(2)
    num_heads = kv_heads * group
    pos = pos_ref[0]
    real = pos >= 0
    row = jnp.arange(rows)
    in_group = row < group
    lanes = jnp.arange(heads_ref.shape[-1])[None, :]
    # The head group (any size) read as a power-of-two tile for the tensor cores; padding rows are 0.
    q = load_rotated(heads_ref, kv_head * group + row, rope_ref, in_group[:, None])
    # The token's own key and value as the cache will hold them (what the other keys are read as).
    own_row = jnp.full((1,), num_heads + kv_head, jnp.int32)
    k_new = load_rotated(heads_ref, own_row, rope_ref).astype(k_ref.dtype)  # [1, d]
    v_new = pltriton.load(heads_ref.at[(own_row + kv_heads)[:, None], lanes]).astype(v_ref.dtype)
    q_pos = jnp.where(in_group, pos, -1)
    lo, hi = key_block_range(pos, pos, pos, block_k=block_k, num_k_blocks=num_k_blocks, causal=True, window=window)
    per_split = (hi - lo + num_splits - 1) // num_splits
    start = lo + split * per_split
    step = functools.partial(
        _attend_block, q, q_pos, k_ref, v_ref, pos,
        block_k=block_k, masked=True, causal=True, window=window, scale=scale, soft_cap=soft_cap,
    )
    carry = own_key_carry(q, k_new, v_new, (split == 0) & real & in_group, scale=scale, soft_cap=soft_cap)
    m, l, acc = jax.lax.fori_loop(start, jnp.minimum(start + per_split, hi), step, carry)
    out, lse = finish_softmax(acc, m, l, base2=True)
    if num_splits == 1:  # the finished output, written straight into the group's rows
        pltriton.store(o_ref.at[row[:, None], lanes], out.astype(o_ref.dtype), mask=in_group[:, None])
    else:
        o_ref[...] = out
        out_refs[1][...] = lse

    @pl.when((split == 0) & real & (pos < capacity))
    def _store() -> None:
        k_out_ref[pl.ds(pos, 1), :] = k_new
        v_out_ref[pl.ds(pos, 1), :] = v_new


def append_decode_attention(
    q: Float[Array, "b 1 h d"],
    k_new: Float[Array, "b 1 kvh d"],
    v_new: Float[Array, "b 1 kvh d"],
    k_cache: Float[Array, "b s kvh d"],
    v_cache: Float[Array, "b s kvh d"],
    positions: Int[Array, "b 1"],
    *,
    inv_freq: Float[Array, " half"] | None = None,
    sliding_window: int | None,
    soft_cap: float | None,
    scale: float,
    interpret: bool = False,
    block_k: int = APPEND_BLOCK_K,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,  # SmolLM2 batch 1 on an H200: 0.511 ms/token against 0.528-0.532 with 3, 0.540 with 1
) -> tuple[Float[Array, "b 1 h d"], Float[Array, "b s kvh d"], Float[Array, "b s kvh d"]]:
    """A decode step's RoPE, cache write and attention in one kernel (the buffers are updated in place).

    ``q`` and ``k_new`` come before RoPE (rotate-half with ``inv_freq`` at each row's position; none
    without it); a row at a negative position writes nothing and gets zeros. The kernel takes q, k and
    v as one array of heads: the projection's output as it is, where separate (or rotated) operands
    would each cost a copy. Buffers of more than one key block are split over the keys (down to one
    block a split, see :data:`APPEND_BLOCK_K`) and merged by log-sum-exp outside, as in
    :func:`decode_attention`; with one split the kernel writes the finished output.
    """
    b, _, h, d = q.shape
    s, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    rows = max(MIN_DOT, next_pow2(g))
    # The largest power of two that divides the buffer (the kernel writes it in place: no padding), and
    # whose K and V blocks fit shared memory twice over (pipelined): float32 heads of 128 take blocks of 64.
    bk = min(block_k, s & -s, APPEND_BLOCK_BYTES // (2 * d * k_cache.dtype.itemsize))
    if bk < MIN_DOT:
        raise ValueError(f"a cache of {s} slots is not a whole number of {MIN_DOT}-slot key blocks")
    num_k_blocks = s // bk
    splits = num_splits or _decode_splits(b, kvh, num_k_blocks, min_blocks=1, target=APPEND_TARGET_PROGRAMS)
    kernel = functools.partial(
        _append_decode_kernel, kv_heads=kvh, group=g, rows=rows, capacity=s, block_k=bk, num_k_blocks=num_k_blocks,
        num_splits=splits, window=sliding_window, scale=scale, soft_cap=soft_cap,
    )
    heads = jnp.concatenate([q, k_new, v_new], axis=2)[:, 0]  # [b, h + 2 kvh, d]
    rope = rope_table(positions[:, 0], inv_freq, d)
    kv_spec = pl.BlockSpec((None, s, None, d), lambda b, h, i: (b, 0, h, 0))
    if splits == 1:
        out_specs: list[pl.BlockSpec] = [pl.BlockSpec((None, None, g, d), lambda b, h, i: (b, h, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, kvh, g, d), q.dtype)]
    else:
        out_specs, out_shape = _split_specs(rows, d), _split_shapes(b, kvh, splits, rows, d)
    *outs, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[
            pl.BlockSpec((None, h + 2 * kvh, d), lambda b, h, i: (b, 0, 0)),
            pl.BlockSpec((None, 2, d), lambda b, h, i: (b, 0, 0)),
            pl.BlockSpec((None, 1), lambda b, h, i: (b, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[*out_specs, kv_spec, kv_spec],
        out_shape=[*out_shape, jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={3: len(out_shape), 4: len(out_shape) + 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="zgen_append_decode",
    )(heads, rope, positions.astype(jnp.int32), k_cache, v_cache)
    out = outs[0] if splits == 1 else merge_partials(outs[0], outs[1])[:, :, :g].astype(q.dtype)
    return out.reshape(b, 1, h, d), k_cache, v_cache


def flash_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s kvh d"],
    v: Float[Array, "b s kvh d"],
    lengths: Int[Array, " b"],
    *,
    q_positions: Int[Array, "b t"] | None = None,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    scale: float,
    interpret: bool = False,
    block_q: int = 128,
    block_k: int = 64,
    num_warps: int | None = None,
    num_stages: int = 3,
    num_splits: int | None = None,
) -> Float[Array, "b t h d"]:
    """The decode kernel when each kv head has at most ``DECODE_MAX_ROWS`` query rows, else prefill.

    ``block_q`` applies to prefill only, ``num_splits`` to decode only; ``num_warps=None`` is each
    kernel's default.
    """
    b, t, h, _ = q.shape
    positions = query_positions(q_positions, b, t)
    if t * (h // k.shape[2]) <= DECODE_MAX_ROWS:
        return decode_attention(
            q, k, v, lengths, positions, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap,
            scale=scale, interpret=interpret, block_k=block_k, num_splits=num_splits,
            num_warps=num_warps or 4, num_stages=num_stages,
        )
    return prefill_attention(
        q, k, v, lengths, positions, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap,
        scale=scale, interpret=interpret, block_q=block_q, block_k=block_k, num_warps=num_warps,
        num_stages=num_stages,
    )
