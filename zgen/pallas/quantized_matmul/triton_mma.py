"""``quantized_matmul`` for 4-bit codes on the tensor cores (Pallas Triton; GPU, interpretable on CPU).

Up to :data:`MAX_ROWS` rows of bf16 or f16 activations (a decode step, a verification pass) against
zgen's planar 4-bit layout. The product is computed transposed, ``y.T = W @ x.T``, so that the codes
are the dot's first operand, which the tensor cores take straight from registers (Hopper's wgmma): a
tile of codes is never staged in shared memory, and the activations, padded to 16 rows, are the small
second operand.

Codes become dot operands by one logic op per two of them: a nibble or'ed under the 16-bit float
exponent whose unit in the last place is 1 (bf16 128, f16 1024) reads ``base + c`` exactly, and two
codes 16 bits apart in a 32-bit word are converted together, which is exactly a pair of the dot
operand's register. So the codes are read as u16 elements (two bytes: inputs ``2j, 2j + 1`` in their
low nibbles, ``half + 2j, half + 2j + 1`` in their high ones) and split into four *planes*, plane ``q =
2h + e`` holding input ``h * half + 2j + e`` at column ``j``; the activations come arranged the same
way (:func:`arranged_inputs`, outside: one small fusion). Each group's plane products are scaled in
float32 on their way into the accumulator, and ``base`` is taken off through the group's input sums:
``y = sum_g scale_g * P_g + (offset_g - base * scale_g) * X_g``.

Against :mod:`zgen.pallas.quantized_matmul.triton` (the CUDA cores: a multiply-add, a logic op and a
subtraction per code) this form spends about 2.6 instructions per code at Llama-3-8B's gate/up
product in SASS compiled for sm_90, against about 4.5 (``benchmarks/kernel_sass.py --warps 4
quantized-matmul --form mma``). Not yet timed or run compiled on a GPU, so it is opt-in
(``implementation="triton-mma"``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from zgen.errors import ConfigError
from zgen.pallas.quantized_matmul.triton import MIN_PROGRAMS, code_words
from zgen.pallas.triton_utils import MIN_DOT, metadata_column, widen_metadata
from zgen.quantized_weights import QuantizedWeight

# Rows a product may have: the tensor cores' narrowest tile, padded with zero rows (never loaded).
MAX_ROWS = 16
# Output channels a program: one warpgroup's wgmma tile.
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
# Code columns (u16) of each plane a loop step covers at most: two groups of 128 inputs.
STEP_COLUMNS = 128
# Each activation dtype's 16-bit pattern whose unit in the last place is 1, and its value.
_BASE = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0), jnp.dtype(jnp.float16): (0x6400, 1024.0)}
# A plane's shift within a 32-bit pair of u16 code elements: lows of the even and odd bytes, then highs.
_PLANE_SHIFTS = (0, 8, 4, 12)


class Launch(NamedTuple):
    groups_per_step: int  # groups of each half a loop step covers
    splits: int = 1  # programs a row's width is split over (partial sums added outside)


def launch(rows: int, weight: QuantizedWeight, dtype: jnp.dtype) -> Launch | None:
    """The kernel's settings, or None where it does not take the product: 8-bit codes, more than
    :data:`MAX_ROWS` rows, float32 activations (their products would round), output channels not a
    multiple of :data:`BLOCK_N`, or groups whose code columns are not a power of two of at least 16
    (a group of ``G`` inputs spans ``G / 2`` u16 columns of a plane)."""
    out = weight.shape[0]
    span = weight.group_size // 2
    if weight.bits != 4 or weight.offsets is None or not 0 < rows <= MAX_ROWS or jnp.dtype(dtype) not in _BASE:
        return None
    if out % BLOCK_N or span < MIN_DOT or span & (span - 1):
        return None
    groups = weight.shape[1] // 2 // weight.group_size
    per_step = max(d for d in range(1, groups + 1) if groups % d == 0 and d * span <= max(STEP_COLUMNS, span))
    steps = groups // per_step
    programs = out // BLOCK_N
    splits = next(d for d in range(1, steps + 1) if steps % d == 0 and (programs * d >= MIN_PROGRAMS or d == steps))
    return Launch(per_step, splits)


def arranged_inputs(x: Float[Array, "rows inp"], dtype: jnp.dtype) -> Float[Array, "planes_rows columns"]:
    """The activations per plane (``[4 * 16, inp / 4]``: plane ``q``'s 16 rows, the first ``rows``
    real), in ``dtype``."""
    rows, width = x.shape
    padded = jnp.zeros((MAX_ROWS, width), dtype).at[:rows].set(x.astype(dtype))
    by_plane = padded.reshape(MAX_ROWS, 2, width // 4, 2)  # [row, h, j, e]
    return jnp.transpose(by_plane, (1, 3, 0, 2)).reshape(4 * MAX_ROWS, width // 4)


def group_sums(x: Float[Array, "rows inp"], dtype: jnp.dtype, group_size: int) -> Float[Array, "groups 16"]:
    """Each group's sum of the activations as the dot reads them (in ``dtype``), in float32."""
    rows, width = x.shape
    sums = x.astype(dtype).astype(jnp.float32).reshape(rows, width // group_size, group_size).sum(axis=-1)
    return jnp.zeros((width // group_size, MAX_ROWS), jnp.float32).at[:, :rows].set(sums.T)


def _planes(codes: Array, dtype: jnp.dtype, interpret: bool) -> list[Array]:
    """The four planes of a tile of u16 code elements as ``base + c`` in ``dtype`` (the activations')."""
    magic = _BASE[dtype][0]
    if interpret:  # the interpreter runs no PTX: the same values, one element at a time
        return [jax.lax.bitcast_convert_type(((codes >> shift) & 0xF) | magic, dtype) for shift in _PLANE_SHIFTS]
    planes = []
    for shift in _PLANE_SHIFTS:
        # Two u16 elements in one register: one logic op masks both nibbles and sets both exponents.
        source, move = ("$1", "") if shift == 0 else ("t", f"shr.b32 t, $1, {shift}; ")
        (plane,) = pltriton.elementwise_inline_asm(
            f"{{ .reg .b32 t; {move}lop3.b32 $0, {source}, 0x000F000F, 0x{magic:04X}{magic:04X}, 0xEA; }}",
            args=[codes], constraints="=r,r", pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, dtype)],
        )
        planes.append(plane)
    return planes


def _kernel(
    x_ref: jax.Ref,
    sums_ref: jax.Ref,
    codes_ref: jax.Ref,
    scales_ref: jax.Ref,
    offsets_ref: jax.Ref,
    o_ref: jax.Ref,
    *,
    rows: int,
    span: int,
    groups: int,
    groups_per_step: int,
    metadata_dtype: jnp.dtype,
    dtype: jnp.dtype,
    interpret: bool,
) -> None:
    block_n, columns = codes_ref.shape  # this program's part of each plane
    first_group = pl.program_id(1) * (columns // span)
    base = _BASE[dtype][1]
    real_rows = jax.lax.broadcasted_iota(jnp.int32, (MAX_ROWS, span), 0) < rows

    def inputs(plane: int, column: Array | int) -> Array:
        """Plane ``plane``'s activations at ``span`` columns from ``column``; padded rows not read."""
        ref = x_ref.at[pl.ds(plane * MAX_ROWS, MAX_ROWS), pl.ds(column, span)]
        return pltriton.load(ref, mask=real_rows, other=0.0)

    def step(i: Array | int, acc: Array) -> Array:
        for sub in range(groups_per_step):
            local = i * groups_per_step + sub
            planes = _planes(codes_ref[:, pl.ds(local * span, span)], dtype, interpret)
            for h in range(2):
                # Plane 2h + e holds half h's inputs of parity e; their group is column g of the metadata.
                products = sum(
                    jnp.dot(planes[2 * h + e], inputs(2 * h + e, local * span).T, preferred_element_type=jnp.float32) for e in range(2)
                )
                g = first_group + local + h * groups
                scale = metadata_column(scales_ref, g, metadata_dtype)[:, None]
                offset = metadata_column(offsets_ref, g, metadata_dtype)[:, None]
                acc = acc + products * scale + (offset - base * scale) * sums_ref[pl.ds(g, 1), :]
        return acc

    acc = jnp.zeros((block_n, MAX_ROWS), jnp.float32)
    steps = columns // span // groups_per_step
    acc = step(0, acc) if steps == 1 else jax.lax.fori_loop(0, steps, step, acc)
    kept = jax.lax.broadcasted_iota(jnp.int32, (MAX_ROWS, block_n), 0) < rows
    pltriton.store(o_ref.at[...], acc.T.astype(o_ref.dtype), mask=kept)


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantized_matmul(x: Float[Array, "*rows inp"], weight: QuantizedWeight, *, interpret: bool = False) -> Float[Array, "*rows out"]:
    """``x @ W.T`` for a product :func:`launch` takes (the caller checks)."""
    out, inp = weight.shape
    flat = x.reshape(-1, inp)
    rows = flat.shape[0]
    setting = launch(rows, weight, flat.dtype)
    if setting is None or weight.offsets is None:
        raise ConfigError(f"quantized_matmul: the tensor-core kernel does not take {rows} rows of this weight (see launch)")
    span, splits = weight.group_size // 2, setting.splits
    columns = inp // 4 // splits  # each program's part of a plane
    scales, offsets = widen_metadata(jnp.asarray(weight.scales)), widen_metadata(jnp.asarray(weight.offsets))
    sums = group_sums(flat, flat.dtype, weight.group_size)
    partial = pl.pallas_call(
        functools.partial(
            _kernel,
            rows=rows,
            span=span,
            groups=inp // 2 // weight.group_size,
            groups_per_step=setting.groups_per_step,
            metadata_dtype=jnp.dtype(weight.scales.dtype),
            dtype=jnp.dtype(flat.dtype),
            interpret=interpret,
        ),
        grid=(out // BLOCK_N, splits),
        in_specs=[
            pl.BlockSpec((4 * MAX_ROWS, columns), lambda i, s: (0, s)),
            pl.BlockSpec(sums.shape, lambda i, s: (0, 0)),
            pl.BlockSpec((BLOCK_N, columns), lambda i, s: (i, s)),
            pl.BlockSpec((BLOCK_N, scales.shape[1]), lambda i, s: (i, 0)),
            pl.BlockSpec((BLOCK_N, offsets.shape[1]), lambda i, s: (i, 0)),
        ],
        out_specs=pl.BlockSpec((None, MAX_ROWS, BLOCK_N), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, MAX_ROWS, out), flat.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="zgen_quantized_matmul_mma",
    )(arranged_inputs(flat, flat.dtype), sums, code_words(weight, jnp.dtype(jnp.uint16)), scales, offsets)
    y = partial[0, :rows] if splits == 1 else jnp.sum(partial[:, :rows], axis=0).astype(flat.dtype)
    return y.reshape(*x.shape[:-1], out)
