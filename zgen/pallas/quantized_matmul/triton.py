"""``quantized_matmul`` as Pallas kernels on the Triton backend (GPU; interpretable on CPU).

**Decode rows on the CUDA cores** (at most :data:`CORE_MAX_ROWS` rows, groups of at least
:data:`CORE_MIN_PIECE` bytes: zgen's own int8 and int4 layouts). Grid: one program per ``block_n``
output channels (:func:`core_launch`), each holding its rows' whole width of codes and loading all of
it first, in pieces that never straddle a group (the fused norm kernel's loop over chunks waited for
each chunk in turn, see ``zgen.pallas.norm_linear``). Each code becomes f32, takes its group's scale
and offset (int8's wide groups: the scale once per group) and multiplies the rows' inputs into
elementwise accumulators, summed across threads once at the end. No tile is padded to the tensor
cores' 16 rows and nothing goes through shared memory.

**Other steps on the tensor cores.** Grid ``(output blocks, splits)``: a program takes ``block_n`` output channels (rows of the weight)
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

# The CUDA-core form: rows it takes, the code bytes a program holds, the narrowest piece it reads.
CORE_MAX_ROWS = 4
CORE_SLICE_BYTES = 16384
CORE_THREAD_BYTES = 128
CORE_MIN_PIECE = 64
CORE_MAX_PIECE = 1024
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


def _core_kernel(
    x_ref: jax.Ref,
    values_ref: jax.Ref,
    scales_ref: jax.Ref,
    *refs: jax.Ref,
    bits: int,
    piece: int,
    pieces_per_group: int,
    metadata_dtype: jnp.dtype,
    asymmetric: bool,
) -> None:
    offsets_ref = refs[0] if asymmetric else None
    o_ref = refs[-1]
    block_n, columns = values_ref.shape
    column_groups = columns // (piece * pieces_per_group)
    # int8 groups of several pieces take the scale once per group; otherwise each code is dequantized.
    scale_after = bits == 8 and pieces_per_group > 1 and offsets_ref is None
    codes = [values_ref[:, pl.ds(j * piece, piece)] for j in range(columns // piece)]  # every load first
    # Products accumulate elementwise: one cross-thread sum per row at the end, not one per piece.
    acc = [jnp.zeros((block_n, piece), jnp.float32) for _ in range(x_ref.shape[0])]
    part = list(acc)
    for j, byte in enumerate(codes):
        group = j // pieces_per_group
        if bits == 8:
            halves = [(byte.astype(jnp.float32), j * piece, group)]
        else:  # planar nibbles: the high ones are the inputs of the row's second half
            halves = [((byte & 0xF).astype(jnp.float32), j * piece, group),
                      ((byte >> 4).astype(jnp.float32), columns + j * piece, group + column_groups)]
        for code, column, g in halves:
            scale = metadata_column(scales_ref, g, metadata_dtype)[:, None]
            weight = code if scale_after else code * scale
            if offsets_ref is not None:
                weight = weight + metadata_column(offsets_ref, g, metadata_dtype)[:, None]
            for row in range(len(acc)):
                x = x_ref[pl.ds(row, 1), pl.ds(column, piece)].astype(jnp.float32)  # [1, piece]
                if not scale_after:
                    acc[row] = acc[row] + weight * x
                elif (j + 1) % pieces_per_group:
                    part[row] = part[row] + weight * x
                else:  # the group's last piece
                    acc[row] = acc[row] + (part[row] + weight * x) * scale
                    part[row] = jnp.zeros_like(part[row])
    for row, total in enumerate(acc):
        o_ref[pl.ds(row, 1), :] = jnp.sum(total, axis=1)[None, :].astype(o_ref.dtype)


def _kernel_leaves(weight: QuantizedWeight) -> tuple[list[Array], jnp.dtype]:
    """The leaves the kernels read (codes; 2-byte scales and offsets widened to u32 pairs) and the
    metadata's own dtype."""
    metadata = [jnp.asarray(weight.scales)] + ([] if weight.offsets is None else [jnp.asarray(weight.offsets)])
    return [jnp.asarray(weight.values), *map(widen_metadata, metadata)], metadata[0].dtype


def core_launch(rows: int, weight: QuantizedWeight) -> tuple[int, int, int] | None:
    """``(block_n, piece, num_warps)`` of the CUDA-core form for ``rows`` rows, or None where it does
    not take the product (more rows, or groups narrower than :data:`CORE_MIN_PIECE` bytes, e.g. GGUF's 32).

    Timed at Llama-3-8B widths on an H200 (BENCHMARKS.md): int8 is fastest one output row per program,
    4-bit codes (twice the work per byte) with 16 KB per program; each thread holding
    :data:`CORE_THREAD_BYTES` of codes sets the warps."""
    out = weight.shape[0]
    columns = int(weight.values.shape[1])
    piece = min(weight.group_size & -weight.group_size, CORE_MAX_PIECE)
    if rows > CORE_MAX_ROWS or piece < CORE_MIN_PIECE or columns % piece:
        return None
    block_n = 1 if weight.bits == 8 else prev_pow2(max(1, CORE_SLICE_BYTES // columns))
    while out % block_n:
        block_n //= 2
    num_warps = min(8, max(1, prev_pow2(block_n * columns // (32 * CORE_THREAD_BYTES))))
    return block_n, piece, num_warps


def _core_matmul(
    flat: Float[Array, "rows inp"], weight: QuantizedWeight, block_n: int, piece: int, num_warps: int, interpret: bool
) -> Float[Array, "rows out"]:
    out, _ = weight.shape
    leaves, metadata_dtype = _kernel_leaves(weight)
    return pl.pallas_call(
        functools.partial(
            _core_kernel,
            bits=weight.bits,
            piece=piece,
            pieces_per_group=weight.group_size // piece,
            metadata_dtype=metadata_dtype,
            asymmetric=weight.offsets is not None,
        ),
        grid=(out // block_n,),
        in_specs=[
            pl.BlockSpec(flat.shape, lambda i: (0, 0)),
            *(pl.BlockSpec((block_n, leaf.shape[1]), lambda i: (i, 0)) for leaf in leaves),
        ],
        out_specs=pl.BlockSpec((flat.shape[0], block_n), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((flat.shape[0], out), flat.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="zgen_quantized_matmul_rows",
    )(flat, *leaves)


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
    core = core_launch(flat.shape[0], weight)
    if core is not None:
        return _core_matmul(flat, weight, *core, interpret).reshape(*x.shape[:-1], out)
    # One row (batch-1 decode) is read as it is and padded in registers; more are padded to 16 here.
    read = flat if flat.shape[0] == 1 else jnp.pad(flat, ((0, MIN_DOT - flat.shape[0]), (0, 0)))
    block_n, piece, per_step, steps, splits = _launch(out, int(weight.values.shape[1]), weight.group_size)
    steps_per_split = cdiv(steps, splits)
    splits = cdiv(steps, steps_per_split)
    leaves, metadata_dtype = _kernel_leaves(weight)
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
            metadata_dtype=metadata_dtype,
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
