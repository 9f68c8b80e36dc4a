"""``quantized_matmul`` as a Pallas kernel on the Triton backend (GPU; interpretable on CPU).

Grid ``(output blocks, splits)``: a program takes ``block_n`` output channels (rows of the weight)
through a contiguous share of the weight's byte columns, read in *pieces* of up to 128 columns that
never straddle a quantization group. Per piece it dots the step's rows (padded to 16 for the tensor
cores) with the codes as they come out of registers -- int8 converted, 4-bit nibbles made ``128 + c``
by bit operations (:func:`~zgen.pallas.triton_utils.nibble_tiles`), exact in bf16 -- and applies the
piece's group scale ``s`` and offset ``z`` to the sums:

    x . w = s (x . (128 + c)) + (z - 128 s) sum(x)        (4-bit, planar: both halves per byte)
    x . w = s (x . c) [+ z sum(x)]                         (8-bit)

A group wider than a piece (int8's one group per row) is simply several pieces with the same scale,
so the columns split evenly over programs whatever the group size; the splits' sums are added outside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from zgen.pallas.triton_utils import MIN_DOT, dot_nt, metadata_column, nibble_tiles, prev_pow2, widen_metadata
from zgen.quantized_weights import QuantizedWeight
from zgen.shapes import cdiv

# Byte columns of the weight one loop step reads per output row.
STEP_COLUMNS = 128
# Programs to aim for: about two per SM of an H100/H200 (132 SMs).
TARGET_PROGRAMS = 264


def _kernel(
    x_ref: jax.Ref,
    values_ref: jax.Ref,
    scales_ref: jax.Ref,
    *refs: jax.Ref,
    bits: int,
    piece: int,
    pieces_per_group: int,
    pieces_per_step: int,
    steps: int,
    steps_per_split: int,
    metadata_dtype: jnp.dtype,
    asymmetric: bool,
) -> None:
    offsets_ref = refs[0] if asymmetric else None
    o_ref = refs[-1]
    rows, block_n = o_ref.shape
    dtype = x_ref.dtype
    columns = values_ref.shape[1]
    column_groups = columns // (piece * pieces_per_group)
    base = 128.0 if bits == 4 else 0.0  # nibbles arrive as 128 + c
    need_sums = asymmetric or bits == 4

    def inputs(col: Array) -> Array:
        """The rows' inputs ``[rows, piece]`` from column ``col``; one real row is broadcast in
        registers (row 0 kept, the padding rows zero) instead of read padded from memory."""
        if x_ref.shape[0] == rows:
            return x_ref[:, pl.ds(col, piece)]
        one = jnp.broadcast_to(x_ref[:, pl.ds(col, piece)], (rows, piece))
        return jnp.where(jax.lax.broadcasted_iota(jnp.int32, (rows, piece), 0) == 0, one, jnp.zeros_like(one))

    def tiles(col: Array) -> list[tuple[Array, Array]]:
        """(code tile [block_n, piece], first input it multiplies) per half of a byte."""
        byte = values_ref[:, pl.ds(col, piece)]
        if bits == 8:
            return [(byte.astype(dtype), col)]
        low, high = nibble_tiles(byte, dtype)
        return [(low, col), (high, col + columns)]

    def step(i: Array, acc: Array) -> Array:
        for j in range(pieces_per_step):
            index = i * pieces_per_step + j
            column_group = index // pieces_per_group
            for kind, (tile, x_col) in enumerate(tiles(index * piece)):
                x = inputs(x_col)
                g = column_group + kind * column_groups
                scale = metadata_column(scales_ref, g, metadata_dtype)
                acc = acc + dot_nt(x, tile) * scale[None, :]
                if need_sums:
                    shift = -base * scale
                    if offsets_ref is not None:
                        shift = shift + metadata_column(offsets_ref, g, metadata_dtype)
                    acc = acc + jnp.sum(x.astype(jnp.float32), axis=1)[:, None] * shift[None, :]
        return acc

    start = pl.program_id(1) * steps_per_split
    acc = jax.lax.fori_loop(start, jnp.minimum(start + steps_per_split, steps), step, jnp.zeros((rows, block_n), jnp.float32))
    o_ref[...] = acc


def _launch(out: int, columns: int, group: int) -> tuple[int, int, int, int, int]:
    """``(block_n, piece, pieces_per_step, steps, splits)`` for ``out`` outputs over ``columns`` byte
    columns in groups of ``group``."""
    block_n = next(n for n in (64, 32, MIN_DOT) if out % n == 0)
    piece = min(group & -group, STEP_COLUMNS)  # a power of two that divides the group
    pieces = columns // piece
    per_step = min(STEP_COLUMNS // piece, prev_pow2(pieces & -pieces))
    steps = pieces // per_step
    splits = max(1, min(steps, prev_pow2(TARGET_PROGRAMS // max(out // block_n, 1))))
    return block_n, piece, per_step, steps, splits


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantized_matmul(x: Float[Array, "*rows inp"], weight: QuantizedWeight, *, interpret: bool = False) -> Float[Array, "*rows out"]:
    out, inp = weight.shape
    flat = x.reshape(-1, inp)
    # One row (batch-1 decode) is read as it is and padded in registers; more are padded to 16 here.
    read = flat if flat.shape[0] == 1 else jnp.pad(flat, ((0, MIN_DOT - flat.shape[0]), (0, 0)))
    values = jnp.asarray(weight.values)
    block_n, piece, per_step, steps, splits = _launch(out, values.shape[1], weight.group_size)
    steps_per_split = cdiv(steps, splits)
    splits = cdiv(steps, steps_per_split)
    metadata = [jnp.asarray(weight.scales)] + ([] if weight.offsets is None else [jnp.asarray(weight.offsets)])
    leaves = [values, *map(widen_metadata, metadata)]
    per_block = lambda leaf: pl.BlockSpec((block_n, leaf.shape[1]), lambda i, s: (i, 0))  # noqa: E731
    partial_sums = pl.pallas_call(
        functools.partial(
            _kernel,
            bits=weight.bits,
            piece=piece,
            pieces_per_group=weight.group_size // piece,
            pieces_per_step=per_step,
            steps=steps,
            steps_per_split=steps_per_split,
            metadata_dtype=metadata[0].dtype,
            asymmetric=weight.offsets is not None,
        ),
        grid=(out // block_n, splits),
        in_specs=[pl.BlockSpec(read.shape, lambda i, s: (0, 0)), *map(per_block, leaves)],
        out_specs=pl.BlockSpec((None, MIN_DOT, block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, MIN_DOT, out), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="zgen_quantized_matmul",
    )(read, *leaves)
    y = jnp.sum(partial_sums, axis=0)[: flat.shape[0]]
    return y.astype(x.dtype).reshape(*x.shape[:-1], out)
