"""GGUF's quantized blocks repacked into zgen's quantized-weight layout without passing through float.

Q8_0 (a float16 scale per 32 int8 codes), Q4_0 (a scale per 32 4-bit codes, ``w = d * (q - 8)``) and
Q4_1 (a scale and a minimum per 32 codes, ``w = d * q + m``) keep their codes and their float16
scales: ``Q4_0`` becomes ``offset = -8 * d``, exact in float16. Dequantized inside the matmul in
float32 they give bit for bit the weights `gguf`'s own dequantization gives. Q4_K (super-blocks of
256 with 6-bit scales and minimums per 32 values under a float16 ``d`` and ``dmin``) becomes groups
of 32 with float32 scales ``d * sc`` and offsets ``-dmin * m``: the same products `gguf` forms, so
its weights agree to a float32 rounding (XLA may fuse ``scale * q + offset`` into one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import gguf
import numpy as np

from zgen.quantized_weights import QuantizedWeight, pack_nibbles

BLOCK = 32  # values per block in Q8_0, Q4_0 and Q4_1 (and per scale in Q4_K)
# The product's form: on a GPU XLA's multiply-and-sum for decode steps (zgen's kernel does not take
# groups of 32), which reads Llama-3-8B-sized weights 2.5x faster than "dequantize" does and is
# within 3 % of it at SmolLM2's size (BENCHMARKS.md, "Weight-only quantization"); on a CPU
# "dequantize", whose float32 weights are bit for bit gguf's.
MATMUL = "kernel"
DIRECT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
SUPER_BLOCK = 256  # values per Q4_K super-block


@dataclass(frozen=True)
class Codes:
    """One GGUF matrix's codes, unpacked one per byte, with its per-block scales (and offsets)."""

    codes: np.ndarray  # [out, in]: int8 for 8 bits, uint8 0..15 for 4 bits
    scales: np.ndarray  # [out, in / 32] float16 (float32 for Q4_K)
    offsets: np.ndarray | None  # [out, in / 32], as scales
    bits: int

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> Codes:
        """The same matrix with ``fn`` applied to its rows (a row permutation), codes and scales alike."""
        offsets = None if self.offsets is None else fn(self.offsets)
        return replace(self, codes=fn(self.codes), scales=fn(self.scales), offsets=offsets)


def read_codes(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> Codes:
    """The codes of a Q8_0/Q4_0/Q4_1/Q4_K tensor's raw bytes ``data`` ([rows, bytes per row]) of logical ``shape``."""
    out, width = shape
    if type_name == "Q4_K":
        return _read_q4_k(data, out, width)
    blocks = np.ascontiguousarray(data).reshape(out, width // BLOCK, -1)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(out, width)
        return Codes(codes, scales, None, 8)
    packed = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
    # A block's byte j holds value j in its low nibble and value j + 16 in its high nibble.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(out, width)
    if type_name == "Q4_1":
        offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    else:
        offsets = (scales * np.float16(-8)).astype(np.float16)
    return Codes(codes, scales, offsets, 4)


def _read_q4_k(data: np.ndarray, out: int, width: int) -> Codes:
    blocks = np.ascontiguousarray(data).reshape(out * (width // SUPER_BLOCK), -1)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4 : 4 + gguf.quants.Q4_K.K_SCALE_SIZE])
    packed = blocks[:, 4 + gguf.quants.Q4_K.K_SCALE_SIZE :].reshape(-1, 4, 1, 32)
    # Each 32 bytes hold two groups: 32 values in the low nibbles, the next 32 in the high ones.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(out, width)
    scales = (d * sc.astype(np.float32)).reshape(out, width // BLOCK)
    offsets = -(dmin * m.astype(np.float32)).reshape(out, width // BLOCK)
    return Codes(codes, scales, offsets, 4)


def fuse(parts: Sequence[Codes]) -> QuantizedWeight:
    """One quantized matrix of ``parts`` stacked along their rows (q/k/v, gate/up). Parts of mixed
    widths (or a 4-bit matrix too narrow to split in halves of whole blocks) meet in 8 bits: 4-bit
    codes 0..15 are int8 codes with their offsets."""
    scales = np.concatenate([p.scales for p in parts], axis=0)
    # 4-bit packing is planar: each half of a row must hold whole blocks.
    if all(p.bits == 4 for p in parts) and parts[0].codes.shape[1] % (2 * BLOCK) == 0:
        codes = np.concatenate([p.codes for p in parts], axis=0)
        offsets = np.concatenate([p.offsets for p in parts if p.offsets is not None], axis=0)
        return QuantizedWeight(pack_nibbles(codes), scales, offsets, bits=4, group_size=BLOCK, matmul=MATMUL)
    codes = np.concatenate([p.codes.astype(np.int8) for p in parts], axis=0)
    if all(p.offsets is None for p in parts):
        return QuantizedWeight(codes, scales, None, bits=8, group_size=BLOCK, matmul=MATMUL)
    offsets = np.concatenate([np.zeros_like(p.scales) if p.offsets is None else p.offsets for p in parts], axis=0)
    return QuantizedWeight(codes, scales, offsets, bits=8, group_size=BLOCK, matmul=MATMUL)


def is_direct(tensor: gguf.ReaderTensor) -> bool:
    return tensor.tensor_type.name in DIRECT_TYPES
