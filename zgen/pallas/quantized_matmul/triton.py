"""``quantized_matmul`` as a Pallas kernel on the Triton backend (GPU; interpretable on CPU).

A decode step's few rows (at most :data:`MAX_ROWS`) on the CUDA cores, for groups of at least
:data:`MIN_PIECE` bytes (zgen's own int8 and int4 layouts; GGUF's groups of 32 stay with XLA). Grid:
one program per ``block_n`` output channels (:func:`launch`), each holding its rows' whole width of
codes and loading all of it first, in pieces that never straddle a group (the fused norm kernel's
loop over chunks waited for each chunk in turn, see ``zgen.pallas.norm_linear``). Each code becomes
f32, takes its group's scale and offset (int8's wide groups: the scale once per group) and
multiplies the rows' inputs into elementwise accumulators, summed across threads once at the end.
No tile is padded to the tensor cores' 16 rows and nothing goes through shared memory.

4-bit codes are planar: byte ``j`` of a row holds input ``j`` in its low nibble and input
``j + in / 2`` in its high one, so a byte's two codes multiply the two halves of the rows' inputs.
(A form that fed the codes to the tensor cores as dot operands, in 16-row tiles, was slower than
XLA's forms at every shape timed: BENCHMARKS.md, "Weight-only quantization".)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from zgen.errors import ConfigError
from zgen.pallas.triton_utils import metadata_column, prev_pow2, widen_metadata
from zgen.quantized_weights import QuantizedWeight

# Rows the kernel takes, the code bytes a 4-bit program holds, the narrowest and widest piece it
# reads, and the code bytes each thread holds (which sets the warps).
MAX_ROWS = 4
SLICE_BYTES_4BIT = 16384
MIN_PIECE = 64
MAX_PIECE = 1024
THREAD_BYTES = 128
# Programs a 4-bit product keeps at least, where it has the outputs: two per SM of an H100/H200.
MIN_PROGRAMS = 264


def _kernel(
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
    """The leaves the kernel reads (codes; 2-byte scales and offsets widened to u32 pairs) and the
    metadata's own dtype."""
    metadata = [jnp.asarray(weight.scales)] + ([] if weight.offsets is None else [jnp.asarray(weight.offsets)])
    return [jnp.asarray(weight.values), *map(widen_metadata, metadata)], metadata[0].dtype


def launch(rows: int, weight: QuantizedWeight) -> tuple[int, int, int] | None:
    """``(block_n, piece, num_warps)`` of the kernel for ``rows`` rows, or None where it does not take
    the product (more rows, or groups narrower than :data:`MIN_PIECE` bytes, e.g. GGUF's 32: XLA's
    forms take those).

    Timed at Llama-3-8B widths on an H200 (BENCHMARKS.md): int8 is fastest one output row per program,
    4-bit codes (twice the work per byte) with 16 KB per program, fewer where that would leave fewer
    than :data:`MIN_PROGRAMS` programs (SmolLM2's 576 outputs); each thread holding
    :data:`THREAD_BYTES` of codes sets the warps."""
    out = weight.shape[0]
    columns = int(weight.values.shape[1])
    piece = min(weight.group_size & -weight.group_size, MAX_PIECE)
    if rows > MAX_ROWS or piece < MIN_PIECE or columns % piece:
        return None
    block_n = 1 if weight.bits == 8 else prev_pow2(max(1, min(SLICE_BYTES_4BIT // columns, out // MIN_PROGRAMS)))
    while out % block_n:
        block_n //= 2
    num_warps = min(8, max(1, prev_pow2(block_n * columns // (32 * THREAD_BYTES))))
    return block_n, piece, num_warps


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantized_matmul(x: Float[Array, "*rows inp"], weight: QuantizedWeight, *, interpret: bool = False) -> Float[Array, "*rows out"]:
    """``x @ W.T`` for a product :func:`launch` takes (the caller checks)."""
    out, inp = weight.shape
    flat = x.reshape(-1, inp)
    setting = launch(flat.shape[0], weight)
    if setting is None:
        raise ConfigError(f"quantized_matmul: the kernel does not take {flat.shape[0]} rows of this weight (see launch)")
    block_n, piece, num_warps = setting
    leaves, metadata_dtype = _kernel_leaves(weight)
    y = pl.pallas_call(
        functools.partial(
            _kernel,
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
        name="zgen_quantized_matmul",
    )(flat, *leaves)
    return y.reshape(*x.shape[:-1], out)
