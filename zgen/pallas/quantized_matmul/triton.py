"""``quantized_matmul`` as a Pallas kernel on the Triton backend (GPU; interpretable on CPU).

A decode step's few rows (at most :data:`MAX_ROWS`) on the CUDA cores, for groups of at least
:data:`MIN_PIECE` bytes (zgen's own int8 and int4 layouts; GGUF's groups of 32 stay with XLA). Grid:
one program per ``block_n`` output channels and part of the width (:func:`launch`; a long row is
split, the parts' float32 sums added outside), each looping over its part in steps of a few pieces (a
piece never straddles a group; a step issues its pieces' loads before their products) and
accumulating products elementwise, summed across threads once at the end.

Codes are read as 32-bit words and become floats by bit operations, not int-to-float conversions (16
a clock per SM on Hopper against 128 multiply-adds): a code masked in place in the low 16 bits
of a word and or'ed under float32's exponent of 2^23 reads ``2^23 + c * 2^shift``, exact, so one
logic op and one subtraction give it. The inputs come arranged per code position and scaled by
``2^-shift`` (:func:`arranged_inputs`, outside the kernel: one small fusion), so each product is one
fused multiply-add; a word's upper half is shifted down once for its upper codes. int8's signed byte
flips its sign bit in the same logic op (``(w & mask) ^ (magic | 0x80 << shift)`` reads ``2^23 +
(b + 128) * 2^shift``). Group scales multiply per-group partial sums; offsets multiply the sums of
each word's inputs.

4-bit codes are planar: byte ``j`` of a row holds input ``j`` in its low nibble and input
``j + in / 2`` in its high one, so nibble ``p`` of word ``m`` holds input ``(p % 2) * in / 2 + 4 m +
p // 2``. (A form that fed the codes to the tensor cores as dot operands, in 16-row tiles, was
slower than XLA's forms at every shape timed: BENCHMARKS.md, "Weight-only quantization".)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, UInt, UInt32

from zgen.errors import ConfigError
from zgen.pallas.triton_utils import metadata_column, prev_pow2, widen_metadata
from zgen.quantized_weights import QuantizedWeight

# Rows the kernel takes; the narrowest and widest piece it reads (code bytes).
MAX_ROWS = 4
MIN_PIECE = 64
MAX_PIECE = 1024
# Launch settings timed at Llama-3-8B widths on an H200 (BENCHMARKS.md), per code width: output
# channels a program, pieces a loop step (int4's pieces are one group of 128: 128 bytes a channel),
# and the code bytes one program reads at most -- a longer row is split over programs whose partial
# sums are added outside (the down projection's 14,336 inputs: int4 54 -> 19 us, int8 27 -> 20 us).
BLOCK_N = {8: 4, 4: 16}
PIECES_PER_STEP = {8: 1, 4: 4}
BYTES_PER_PROGRAM = {8: 32768, 4: 8192}
NUM_WARPS = 2
NUM_STAGES = 3
# Programs a product keeps at least, where it has the outputs: two per SM of an H100/H200.
MIN_PROGRAMS = 264
# float32 2^23: a code in the low mantissa bits under this exponent reads 2^23 + code.
_MAGIC = 0x4B000000
_MAGIC_VALUE = 8388608.0


class Launch(NamedTuple):
    block_n: int  # output channels a program
    piece: int  # code bytes a piece (within one group)
    pieces_per_step: int  # pieces a loop step loads before its products
    splits: int = 1  # programs a row's width is split over (partial sums added outside)


def _code_shifts(bits: int) -> list[int]:
    """Where each code of a word sits once its half is in the low 16 bits (``word >> 16`` for the
    upper half): masked in place, code ``p`` reads ``c * 2^shift``."""
    return [bits * p % 16 for p in range(32 // bits)]


def _per_word(x: Float[Array, "rows inp"], bits: int) -> Float[Array, "rows halves words per_half"]:
    """``x`` as the inputs of each word: int8's word ``m`` holds inputs ``4m .. 4m + 3`` (byte ``p`` =
    input ``4m + p``); int4's nibble ``p = 2i + h`` holds input ``h * inp / 2 + 4m + i``."""
    rows, width = x.shape
    halves = 2 if bits == 4 else 1
    return x.astype(jnp.float32).reshape(rows, halves, width // (4 * halves), 4)


def arranged_inputs(x: Float[Array, "rows inp"], bits: int) -> Float[Array, "rows_codes words"]:
    """The inputs the kernel multiplies, per row and code position ``p`` of a word (row-major
    ``[rows * codes_per_word, words]``), each scaled by ``2^-shift`` of its code's position."""
    per_word = _per_word(x, bits)
    rows, _, words, _ = per_word.shape
    by_position = jnp.transpose(per_word, (0, 3, 1, 2)).reshape(rows, 32 // bits, words)  # p = halves * i + h
    factors = jnp.asarray([2.0**-shift for shift in _code_shifts(bits)], jnp.float32)
    return (by_position * factors[None, :, None]).reshape(rows * (32 // bits), words)


def word_sums(x: Float[Array, "rows inp"], bits: int) -> Float[Array, "rows_halves words"]:
    """Per row and half (int4's planar halves) the sum of each word's inputs (``[rows * halves,
    words]``): what a group's offset multiplies."""
    per_word = _per_word(x, bits)
    return per_word.sum(axis=-1).reshape(-1, per_word.shape[2])


def code_masks(bits: int) -> UInt32[Array, "1 codes_per_half"]:
    """The mask of each code position in a word's low half."""
    return jnp.asarray([[((1 << bits) - 1) << shift for shift in range(0, 16, bits)]], jnp.uint32)


def code_words(weight: QuantizedWeight, dtype: jnp.dtype = jnp.dtype(jnp.uint32)) -> UInt[Array, "out words"]:
    """The codes as little-endian unsigned words of ``dtype`` (a bitcast, free in XLA)."""
    values = jnp.asarray(weight.values)
    out, stored = values.shape
    width = jnp.dtype(dtype).itemsize
    return jax.lax.bitcast_convert_type(values.reshape(out, stored // width, width), dtype)


def _kernel(
    masks_ref: jax.Ref,
    xw_ref: jax.Ref,
    words_ref: jax.Ref,
    scales_ref: jax.Ref,
    *refs: jax.Ref,
    bits: int,
    rows: int,
    piece: int,
    pieces_per_group: int,
    metadata_dtype: jnp.dtype,
    asymmetric: bool,
    pieces_per_step: int,
    splits: int,
) -> None:
    offsets_ref, sums_ref = refs[:2] if asymmetric else (None, None)
    o_ref = refs[-1]
    block_n, words = words_ref.shape  # this program's split of the row
    first_piece = pl.program_id(1) * (words // piece) if splits > 1 else 0
    shifts = _code_shifts(bits)
    # 4-bit words hold two groups (the row's two planar halves): nibble p belongs to half p % 2.
    halves = 2 if bits == 4 else 1
    groups_per_half = words * splits // (piece * pieces_per_group)
    scale_after = bits == 8 and pieces_per_group > 1 and offsets_ref is None
    # The code masks arrive as data so that they stay in registers: as constants, each logic op (one
    # immediate operand, the magic) had its mask rematerialized by a MOV -- a fifth of the loop's
    # instructions in the compiled SASS.
    masks = [masks_ref[0, k] for k in range(16 // bits)]

    def products(j: Array | int, word: Array, acc: list[Array]) -> list[Array]:
        """The rows' elementwise products with piece ``j``'s codes ``word`` added to ``acc``."""
        columns = pl.ds(j * piece, piece)
        row_piece = first_piece + j
        group = row_piece // pieces_per_group if isinstance(row_piece, int) else jax.lax.div(row_piece, pieces_per_group)
        upper = word >> 16
        values = []
        for p, shift in enumerate(shifts):
            src = word if p < len(shifts) // 2 else upper
            if bits == 8:  # the sign bit flipped in the same logic op: reads 2^23 + (b + 128) * 2^shift
                raw = (src & masks[shift // bits]) ^ (_MAGIC | (0x80 << shift))
                values.append(jax.lax.bitcast_convert_type(raw, jnp.float32) - (_MAGIC_VALUE + 128.0 * 2.0**shift))
            else:
                raw = (src & masks[shift // bits]) | _MAGIC
                values.append(jax.lax.bitcast_convert_type(raw, jnp.float32) - _MAGIC_VALUE)
        acc = list(acc)
        for row in range(rows):
            # int8's single group per row takes its scale at the end: its products go straight into acc.
            parts = [acc[row]] if scale_after else [jnp.zeros((block_n, piece), jnp.float32) for _ in range(halves)]
            for p, value in enumerate(values):
                x = xw_ref[pl.ds(row * len(shifts) + p, 1), columns]  # [1, piece]
                parts[p % halves] = parts[p % halves] + value * x
            if scale_after:
                acc[row] = parts[0]
                continue
            for h, part in enumerate(parts):
                g = group + h * groups_per_half
                scale = metadata_column(scales_ref, g, metadata_dtype)[:, None]
                acc[row] = acc[row] + part * scale
                if offsets_ref is not None and sums_ref is not None:
                    offset = metadata_column(offsets_ref, g, metadata_dtype)[:, None]
                    acc[row] = acc[row] + offset * sums_ref[pl.ds(row * halves + h, 1), columns]
        return acc

    def step(first: Array | int, acc: list[Array]) -> list[Array]:
        """``pieces_per_step`` pieces from piece ``first``: every load first, then the products."""
        codes = [words_ref[:, pl.ds((first + u) * piece, piece)] for u in range(pieces_per_step)]
        for u, word in enumerate(codes):
            acc = products(first + u, word, acc)
        return acc

    acc = [jnp.zeros((block_n, piece), jnp.float32) for _ in range(rows)]
    steps = words // piece // pieces_per_step
    if steps == 1:
        acc = step(0, acc)
    else:
        acc = list(jax.lax.fori_loop(0, steps, lambda i, acc: tuple(step(i * pieces_per_step, list(acc))), tuple(acc)))
    for row, total in enumerate(acc):
        y = jnp.sum(total, axis=1)
        if scale_after:  # int8's single group per row
            y = y * metadata_column(scales_ref, 0, metadata_dtype)
        o_ref[pl.ds(row, 1), :] = y[None, :].astype(o_ref.dtype)


def _metadata_leaves(weight: QuantizedWeight) -> tuple[list[Array], jnp.dtype]:
    """Scales (and offsets), 2-byte ones widened to u32 pairs, and the metadata's own dtype."""
    metadata = [jnp.asarray(weight.scales)] + ([] if weight.offsets is None else [jnp.asarray(weight.offsets)])
    return list(map(widen_metadata, metadata)), metadata[0].dtype


def launch(rows: int, weight: QuantizedWeight) -> Launch | None:
    """The kernel's settings for ``rows`` rows of ``weight``, or None where it does not take the
    product (more rows, or groups narrower than :data:`MIN_PIECE` bytes, e.g. GGUF's 32: XLA's forms
    take those). A row is split over the fewest programs that each read at most
    :data:`BYTES_PER_PROGRAM`; fewer channels a program where :data:`BLOCK_N` would leave fewer than
    :data:`MIN_PROGRAMS` programs (SmolLM2's 576 outputs)."""
    out = weight.shape[0]
    columns = int(weight.values.shape[1])
    piece = min(weight.group_size & -weight.group_size, MAX_PIECE)
    if rows > MAX_ROWS or piece < MIN_PIECE or columns % piece:
        return None
    pieces_per_step = PIECES_PER_STEP[weight.bits]
    while (columns // piece) % pieces_per_step:
        pieces_per_step //= 2
    steps = columns // piece // pieces_per_step
    block_n = BLOCK_N[weight.bits] * 2
    while True:
        block_n //= 2
        if out % block_n:
            continue
        splits = next(d for d in range(1, steps + 1) if steps % d == 0 and (block_n * columns // d <= BYTES_PER_PROGRAM[weight.bits] or d == steps))
        if block_n == 1 or out // block_n * splits >= MIN_PROGRAMS:
            return Launch(block_n, piece, pieces_per_step, splits)


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantized_matmul(x: Float[Array, "*rows inp"], weight: QuantizedWeight, *, interpret: bool = False) -> Float[Array, "*rows out"]:
    """``x @ W.T`` for a product :func:`launch` takes (the caller checks)."""
    out, inp = weight.shape
    flat = x.reshape(-1, inp)
    rows = flat.shape[0]
    setting = launch(rows, weight)
    if setting is None:
        raise ConfigError(f"quantized_matmul: the kernel does not take {rows} rows of this weight (see launch)")
    words = code_words(weight)
    xw = arranged_inputs(flat, weight.bits)
    metadata, metadata_dtype = _metadata_leaves(weight)
    sums = [word_sums(flat, weight.bits)] if weight.offsets is not None else []
    block_n, splits = setting.block_n, setting.splits
    width = words.shape[1] // splits
    partial = pl.pallas_call(
        functools.partial(
            _kernel,
            bits=weight.bits,
            rows=rows,
            piece=setting.piece // 4,
            pieces_per_group=weight.group_size // setting.piece,
            pieces_per_step=setting.pieces_per_step,
            splits=splits,
            metadata_dtype=metadata_dtype,
            asymmetric=weight.offsets is not None,
        ),
        grid=(out // block_n, splits),
        in_specs=[
            pl.BlockSpec((1, 16 // weight.bits), lambda i, s: (0, 0)),
            pl.BlockSpec((xw.shape[0], width), lambda i, s: (0, s)),
            pl.BlockSpec((block_n, width), lambda i, s: (i, s)),
            *(pl.BlockSpec((block_n, leaf.shape[1]), lambda i, s: (i, 0)) for leaf in metadata),
            *(pl.BlockSpec((leaf.shape[0], width), lambda i, s: (0, s)) for leaf in sums),
        ],
        out_specs=pl.BlockSpec((None, rows, block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, out), flat.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="zgen_quantized_matmul",
    )(code_masks(weight.bits), xw, words, *metadata, *sums)
    y = partial[0] if splits == 1 else jnp.sum(partial, axis=0).astype(flat.dtype)
    return y.reshape(*x.shape[:-1], out)
