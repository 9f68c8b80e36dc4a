"""The page write's kernels on the Pallas Triton backend (aliased pools, updated in place).

``store_tokens``: one program per (token, kv head) copies that head's slab of the token (a power of
two elements) into its slot of the pool.

``write_kv``: a layer's whole write in one launch. Grid ``(row blocks, kv heads)``: each program
takes ``ROWS`` tokens of one kv head and, for K and V alike, codes them (coded formats: the key's
centre rotated to its position is subtracted, the channels scaled, K and V Hadamard-rotated),
quantizes them into the pool's layout and stores every leaf into the tokens' slots. The rotation is
dots with Sylvester's ``D/2`` matrix on the halves' sum and difference (f32 operands as three
bfloat16 parts), so a token's codes do not depend on the other rows of its block; they round differently from the butterfly of
:func:`~zgen.pallas.paged_attention.layouts.hadamard`, so a value on a rounding boundary of its
4-bit group may take the neighbouring code (the tests bound how often).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int, Shaped

from zgen.pallas.paged_attention.layouts import FP8_MAX, Fp8Pages, KeyCalibration, KVPages, Q4Pages, sylvester
from zgen.rope import rope_cos_sin


def _store_kernel(slots_ref: jax.Ref, tokens_ref: jax.Ref, pool_ref: jax.Ref, out_ref: jax.Ref) -> None:
    del pool_ref  # the same buffer as out_ref
    token, head = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[token]

    @pl.when(slot >= 0)
    def _() -> None:
        out_ref[head, slot, :] = tokens_ref[token, head, :]


@functools.partial(jax.jit, static_argnames=("interpret",))
def store_tokens(
    pool: Shaped[Array, "kvh pages page_size *rest"],
    tokens: Shaped[Array, "b t kvh *rest"],
    page: Int[Array, "b t"],
    offset: Int[Array, "b t"],
    *,
    interpret: bool = False,
) -> Shaped[Array, "kvh pages page_size *rest"]:
    kvh, pages, page_size = pool.shape[:3]
    slab = math.prod(pool.shape[3:])
    # Float8 goes through its bits (a uint8 view), which Triton stores like any byte.
    storage = jnp.uint8 if jnp.issubdtype(pool.dtype, jnp.floating) and pool.dtype.itemsize == 1 else pool.dtype
    flat_pool = jax.lax.bitcast_convert_type(pool, storage).reshape(kvh, pages * page_size, slab)
    flat_tokens = jax.lax.bitcast_convert_type(tokens.astype(pool.dtype), storage).reshape(-1, kvh, slab)
    inside = (page >= 0) & (page < pages)
    slots = jnp.where(inside, page * page_size + offset, -1).reshape(-1).astype(jnp.int32)
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, h: (0,) * x.ndim)  # noqa: E731 - programs index slots themselves
    stored = pl.pallas_call(
        _store_kernel,
        grid=(flat_tokens.shape[0], kvh),
        in_specs=[whole(slots), whole(flat_tokens), whole(flat_pool)],
        out_specs=whole(flat_pool),
        out_shape=jax.ShapeDtypeStruct(flat_pool.shape, storage),
        input_output_aliases={2: 0},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="zgen_store_tokens",
    )(slots, flat_tokens, flat_pool)
    return jax.lax.bitcast_convert_type(stored.reshape(pool.shape), pool.dtype)


# Tokens per program: Triton's dots need 16 rows.
ROWS = 16
_Q4_LEVELS = 15.0


def _round_half_even(x: Array) -> Array:
    """``jnp.round`` (ties to even) from floor, which Triton lowers."""
    low = jnp.floor(x)
    frac = x - low
    odd = low - 2.0 * jnp.floor(low * 0.5) == 1.0
    return low + jnp.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)


def _q4_tiles(halves: Sequence[Array], group: int) -> tuple[Array, Array, Array]:
    """Q4 of a block's two halves ``[ROWS, D/2]`` f32: the packed bytes ``[ROWS, D/2]`` and the
    ``[ROWS, groups]`` bf16 scales and mins, as :func:`~zgen.pallas.paged_attention.layouts.quantize_q4`."""
    half = halves[0].shape[1]
    per_half = half // group
    column = jax.lax.broadcasted_iota(jnp.int32, halves[0].shape, 1) // group
    scales: list[Array] = []
    zeros: list[Array] = []
    codes: list[Array] = []
    for x in halves:
        scale_cols = jnp.zeros_like(x)
        zero_cols = jnp.zeros_like(x)
        for g in range(per_half):
            inside = column == g
            lo = jnp.min(jnp.where(inside, x, jnp.inf), axis=1)
            hi = jnp.max(jnp.where(inside, x, -jnp.inf), axis=1)
            scale = jnp.where(hi > lo, (hi - lo) / _Q4_LEVELS, 1.0).astype(jnp.bfloat16)
            zero = lo.astype(jnp.bfloat16)
            scales.append(scale)
            zeros.append(zero)
            scale_cols = jnp.where(inside, scale.astype(jnp.float32)[:, None], scale_cols)
            zero_cols = jnp.where(inside, zero.astype(jnp.float32)[:, None], zero_cols)
        code = jnp.clip(_round_half_even((x - zero_cols) / scale_cols), 0.0, _Q4_LEVELS)
        codes.append(code.astype(jnp.uint8))
    packed = codes[0] | (codes[1] << 4)
    groups = len(scales)
    slot = jax.lax.broadcasted_iota(jnp.int32, (halves[0].shape[0], groups), 1)
    scale_tile = jnp.zeros(slot.shape, jnp.bfloat16)
    zero_tile = jnp.zeros(slot.shape, jnp.bfloat16)
    for g in range(groups):
        scale_tile = jnp.where(slot == g, scales[g][:, None], scale_tile)
        zero_tile = jnp.where(slot == g, zeros[g][:, None], zero_tile)
    return packed, scale_tile, zero_tile


def _rotate(halves: Sequence[Array], hadamard_half: Array) -> list[Array]:
    """The orthonormal Hadamard rotation of ``[ROWS, D]`` given as halves: ``H_D = [[H, H], [H, -H]]``.

    Each operand is split into three bfloat16 parts (together the f32 value) dotted with the ``±1``
    matrix on the tensor cores: the products are exact and sum in f32. An IEEE f32 dot (CUDA cores)
    made the decode write 2-3x slower on an H200.
    """
    x1, x2 = halves
    norm = (2 * x1.shape[1]) ** -0.5

    def dot(a: Array) -> Array:
        total = jnp.zeros(a.shape, jnp.float32)
        for _ in range(3):
            part = a.astype(jnp.bfloat16)
            total += jnp.dot(part, hadamard_half, preferred_element_type=jnp.float32)
            a = a - part.astype(jnp.float32)
        return total * norm

    return [dot(x1 + x2), dot(x1 - x2)]


def _write_kernel(
    *refs: jax.Ref, layout: str, coded: bool, tokens: int, head_dim: int, group: int, num_leaves: int
) -> None:
    slots_ref, positions_ref, k_ref, v_ref = refs[:4]
    coding = refs[4:9] if coded else ()
    outs = refs[len(refs) - 2 * num_leaves :]  # the aliased pool leaves: K's, then V's
    block, head = pl.program_id(0), pl.program_id(1)
    rows = block * ROWS + jax.lax.broadcasted_iota(jnp.int32, (ROWS,), 0)
    inside = rows < tokens
    rows = jnp.minimum(rows, tokens - 1)  # padding rows read the last token and store nothing
    slots = slots_ref[rows]
    keep = inside & (slots >= 0)
    # Dropped rows point one past the pool: the kernel masks them, the interpreter's scatter drops them.
    slots = jnp.where(keep, slots, outs[0].shape[1])
    half = head_dim // 2
    # Every index is an array (rows x columns): the interpreter stores masked tiles only so.
    column = jax.lax.broadcasted_iota(jnp.int32, (1, half), 1)
    lo, hi = column, column + half

    def halves(ref: jax.Ref) -> list[Array]:
        return [ref[rows[:, None], head, cols].astype(jnp.float32) for cols in (lo, hi)]

    k, v = halves(k_ref), halves(v_ref)
    if coding:
        center_ref, sink_ref, key_scale_ref, rope_ref, hadamard_ref = coding
        # The centre's RoPE angles come computed (by XLA): the kernel's own sin/cos took a quarter of its time.
        cos, sin = rope_ref[rows[:, None], lo], rope_ref[rows[:, None], hi]
        at_sink = (positions_ref[rows] == 0)[:, None]
        c1 = jnp.where(at_sink, sink_ref[head, lo], center_ref[head, lo])
        c2 = jnp.where(at_sink, sink_ref[head, hi], center_ref[head, hi])
        shift1, shift2 = c1 * cos - c2 * sin, c2 * cos + c1 * sin  # rotate-half RoPE of the centre
        k = [(k[0] - shift1) * key_scale_ref[head, lo], (k[1] - shift2) * key_scale_ref[head, hi]]
        hadamard_half = hadamard_ref[...]
        k, v = _rotate(k, hadamard_half), _rotate(v, hadamard_half)

    def store(ref: jax.Ref, value: Array, columns: Array | None = None) -> None:
        if columns is None:  # one value per token
            pltriton.store(ref.at[head, slots], value.astype(ref.dtype), mask=keep)
        else:
            index = ref.at[head, slots[:, None], columns]
            pltriton.store(index, value.astype(ref.dtype), mask=jnp.broadcast_to(keep[:, None], value.shape))

    def code_and_store(x: list[Array], leaves: Sequence[jax.Ref]) -> None:
        if layout == "plain":
            store(leaves[0], x[0], lo)
            store(leaves[0], x[1], hi)
        elif layout == "fp8":
            amax = jnp.maximum(jnp.max(jnp.abs(x[0]), axis=1), jnp.max(jnp.abs(x[1]), axis=1))
            scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
            for part, columns in ((x[0], lo), (x[1], hi)):
                as_fp8 = (part / scale[:, None]).astype(jnp.float8_e4m3fn)
                store(leaves[0], jax.lax.bitcast_convert_type(as_fp8, jnp.uint8), columns)
            store(leaves[1], scale)
        else:
            packed, scale_tile, zero_tile = _q4_tiles(x, group)
            groups = jax.lax.broadcasted_iota(jnp.int32, (1, scale_tile.shape[1]), 1)
            store(leaves[0], packed, lo)
            store(leaves[1], scale_tile, groups)
            store(leaves[2], zero_tile, groups)

    code_and_store(k, outs[:num_leaves])
    code_and_store(v, outs[num_leaves:])


def _leaves(pool: KVPages) -> tuple[str, list[Array]]:
    """The layout's name and its leaves as the kernel stores them: ``[kv_heads, slots, ...]``, float8 as bytes."""
    if isinstance(pool, Fp8Pages):
        values = jax.lax.bitcast_convert_type(pool.values, jnp.uint8)
        return "fp8", [values, pool.scale]
    if isinstance(pool, Q4Pages):
        return "q4", [pool.packed, pool.scale, pool.zero]
    assert isinstance(pool, jax.Array)
    return "plain", [pool]


def _rebuild(pool: KVPages, leaves: Sequence[Array]) -> KVPages:
    if isinstance(pool, Fp8Pages):
        return Fp8Pages(values=jax.lax.bitcast_convert_type(leaves[0], pool.values.dtype), scale=leaves[1])
    if isinstance(pool, Q4Pages):
        return Q4Pages(packed=leaves[0], scale=leaves[1], zero=leaves[2])
    return leaves[0]


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(
    k_pool: KVPages,
    v_pool: KVPages,
    k: Float[Array, "b t kvh d"],
    v: Float[Array, "b t kvh d"],
    slots: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    key_coding: KeyCalibration | None,
    *,
    interpret: bool = False,
) -> tuple[KVPages, KVPages]:
    layout, k_leaves = _leaves(k_pool)
    _, v_leaves = _leaves(v_pool)
    kvh, pages, page_size = k_leaves[0].shape[:3]
    head_dim = k.shape[-1]
    flat = lambda leaf: leaf.reshape(kvh, pages * page_size, *leaf.shape[3:])  # noqa: E731
    pools = [flat(leaf) for leaf in k_leaves + v_leaves]
    tokens = k.shape[0] * k.shape[1]
    inputs = [slots.reshape(-1), positions.reshape(-1).astype(jnp.int32), k.reshape(tokens, kvh, head_dim), v.reshape(tokens, kvh, head_dim)]
    group = head_dim // k_leaves[1].shape[-1] if layout == "q4" else 0
    if key_coding is not None:
        half = jnp.asarray(sylvester(head_dim // 2), jnp.bfloat16)
        stats = (key_coding.center, key_coding.sink, key_coding.scale)
        cos, sin = rope_cos_sin(positions.reshape(-1), key_coding.inv_freq.astype(jnp.float32))
        inputs += [s.astype(jnp.float32) for s in stats] + [jnp.concatenate([cos, sin], axis=1), half]
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731 - programs index rows themselves
    kernel = functools.partial(
        _write_kernel,
        layout=layout,
        coded=key_coding is not None,
        tokens=tokens,
        head_dim=head_dim,
        group=group,
        num_leaves=len(k_leaves),
    )
    stored = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(tokens, ROWS), kvh),
        in_specs=[whole(x) for x in inputs + pools],
        out_specs=[whole(x) for x in pools],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools],
        input_output_aliases={len(inputs) + i: i for i in range(len(pools))},
        # 4 warps: on an H200, 8 lost for plain and coded writes (5.9 vs 3.7 µs, 15.1 vs 12.0 at decode).
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="zgen_write_kv",
    )(*inputs, *pools)
    unflat = [leaf.reshape(orig.shape) for leaf, orig in zip(stored, k_leaves + v_leaves)]
    n = len(k_leaves)
    return _rebuild(k_pool, unflat[:n]), _rebuild(v_pool, unflat[n:])

