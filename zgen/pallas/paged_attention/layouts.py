"""Quantized KV page layouts, their quantizers and (reference) dequantizers.

Every layout keeps the page-table shape of the full-precision cache, ``[kv_heads, num_pages, page_size,
...]``, so the same ``block_tables`` index every leaf and a gather of pages is a ``tree_map``. All
quantization groups live inside one token's head vector: a token is quantized when it is written, on
its own, so a cache can append one token at a time without re-quantizing its page.

==========  =====================================================  ==================  ==============
layout      leaves (per kv head, page, token)                      bits per value      vs bf16 bytes
==========  =====================================================  ==================  ==============
bf16        ``[D]`` bfloat16                                       16                  1x
``Fp8``     ``values [D]`` float8_e4m3fn, ``scale []`` f32         8 + 32/D            ~0.52x
``Q4``      ``packed [D/2]`` u8, ``scale, zero [D/G]`` bf16        4 + 32/G            0.28x (G=32)
``Q3``      ``planes [3, D/8]`` u8, ``codebook [8]`` bf16          3 + 128/D           0.25x (D=128)
==========  =====================================================  ==================  ==============

Why these granularities:

* FP8: one scale per token — E4M3's exponent already covers the spread inside a head vector; the
  scale only maps the token's absolute maximum onto 448, and it folds into the logits (K) and the
  probabilities (V) instead of touching every element.
* Q4: asymmetric (scale and min) groups of ``G`` consecutive dims (default 32, like GGUF Q4_1): keys
  have outlier channels, and a group per head vector would spend most codes on them. Nibbles are
  packed *split-half*: byte ``j`` holds dim ``j`` (low nibble) and dim ``j + D/2`` (high nibble), so a
  kernel unpacks two contiguous half-tiles with a shift and a mask and never interleaves lanes.
* Q3: an 8-entry codebook per token (Lloyd-fitted, non-uniform), stored as 3 bit-planes. Plane ``b``
  byte ``j`` bit ``i`` is bit ``b`` of the code of dim ``i * D/8 + j``: unpacking bit ``i`` of every
  byte yields the contiguous dim block ``[i*D/8, (i+1)*D/8)``, again without lane shuffles. A codebook
  shared by a whole page would cost ~0 bits but needs the whole page at write time; per token it costs
  ``128/D`` bits per value (1 bit at D=128), still below Q4.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped, UInt8

Q3_LEVELS = 8
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Pages:
    """E4M3 values with one f32 scale per (kv head, page, token): ``x ~= values * scale``."""

    values: Shaped[Array, "kvh pages page d"]
    scale: Float[Array, "kvh pages page"]

    @property
    def head_dim(self) -> int:
        return self.values.shape[-1]

    def dequantize(self, dtype: jnp.dtype) -> Float[Array, "*lead d"]:
        return (self.values.astype(jnp.float32) * self.scale[..., None].astype(jnp.float32)).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q4Pages:
    """4-bit codes, split-half packed, with a (scale, min) pair per group of ``G`` dims.

    ``x[d] ~= code[d] * scale[d // G] + zero[d // G]``; byte ``j`` of ``packed`` holds ``code[j]`` in its
    low nibble and ``code[j + D/2]`` in its high nibble. ``G`` divides ``D/2`` so a group never straddles
    the halves.
    """

    packed: UInt8[Array, "kvh pages page half_d"]
    scale: Float[Array, "kvh pages page groups"]
    zero: Float[Array, "kvh pages page groups"]

    @property
    def head_dim(self) -> int:
        return 2 * self.packed.shape[-1]

    @property
    def group_size(self) -> int:
        return self.head_dim // self.scale.shape[-1]

    def dequantize(self, dtype: jnp.dtype) -> Float[Array, "*lead d"]:
        codes = jnp.concatenate([self.packed & 0xF, self.packed >> 4], axis=-1).astype(jnp.float32)
        grouped = codes.reshape(*codes.shape[:-1], -1, self.group_size)
        x = grouped * self.scale[..., None].astype(jnp.float32) + self.zero[..., None].astype(jnp.float32)
        return x.reshape(codes.shape).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q3Pages:
    """3-bit codes into an 8-entry codebook per (kv head, page, token), stored as 3 bit-planes.

    ``x[i * D/8 + j] ~= codebook[code]`` with ``code = sum_b ((planes[b, j] >> i) & 1) << b``.
    """

    planes: UInt8[Array, "kvh pages page 3 eighth_d"]
    codebook: Float[Array, "kvh pages page 8"]

    @property
    def head_dim(self) -> int:
        return 8 * self.planes.shape[-1]

    def codes(self) -> UInt8[Array, "*lead d"]:
        shifts = jnp.arange(8, dtype=jnp.uint8)[:, None]
        planes = self.planes[..., None, :]  # [..., 3, 1, w] against bit index i on axis -2
        bits = (planes >> shifts) & 1  # [..., 3, 8, w]
        code = bits[..., 0, :, :] | (bits[..., 1, :, :] << 1) | (bits[..., 2, :, :] << 2)
        return code.reshape(*code.shape[:-2], -1)

    def dequantize(self, dtype: jnp.dtype) -> Float[Array, "*lead d"]:
        return jnp.take_along_axis(self.codebook, self.codes().astype(jnp.int32), axis=-1).astype(dtype)


QuantizedPages: TypeAlias = Fp8Pages | Q4Pages | Q3Pages
KVPages: TypeAlias = Array | QuantizedPages
QuantFormat = Literal["bf16", "fp8", "q4", "q3"]


def quantize_fp8(x: Float[Array, "*lead d"]) -> Fp8Pages:
    """Per-token scaled E4M3 (reference quantizer, plain jnp)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return Fp8Pages(values=(x / scale[..., None]).astype(jnp.float8_e4m3fn), scale=scale)


def quantize_q4(x: Float[Array, "*lead d"], group_size: int = 32, scale_dtype: jnp.dtype = jnp.bfloat16) -> Q4Pages:
    """Asymmetric 4-bit groups of ``group_size`` dims; codes are fitted to the *stored* (rounded) scales."""
    d = x.shape[-1]
    if d % 2 or (d // 2) % group_size:
        raise ValueError(f"Q4 needs group_size ({group_size}) to divide head_dim/2 ({d}/2)")
    g = x.astype(jnp.float32).reshape(*x.shape[:-1], d // group_size, group_size)
    lo, hi = jnp.min(g, axis=-1), jnp.max(g, axis=-1)
    scale = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(scale_dtype)
    zero = lo.astype(scale_dtype)
    codes = jnp.round((g - zero[..., None].astype(jnp.float32)) / scale[..., None].astype(jnp.float32))
    codes = jnp.clip(codes, 0, 15).astype(jnp.uint8).reshape(x.shape)
    packed = codes[..., : d // 2] | (codes[..., d // 2 :] << 4)
    return Q4Pages(packed=packed, scale=scale, zero=zero)


def quantize_q3(x: Float[Array, "*lead d"], iterations: int = 8, codebook_dtype: jnp.dtype = jnp.bfloat16) -> Q3Pages:
    """Per-token 8-level codebook fitted by a few Lloyd (1-D k-means) steps from a uniform start."""
    d = x.shape[-1]
    if d % 8:
        raise ValueError(f"Q3 needs head_dim divisible by 8, got {d}")
    x = x.astype(jnp.float32)
    lo, hi = jnp.min(x, axis=-1, keepdims=True), jnp.max(x, axis=-1, keepdims=True)
    codebook = lo + (hi - lo) * (jnp.arange(Q3_LEVELS, dtype=jnp.float32) + 0.5) / Q3_LEVELS

    def assign(cb: Array) -> Array:
        return jnp.argmin(jnp.abs(x[..., :, None] - cb[..., None, :]), axis=-1)

    def lloyd(cb: Array, _: None) -> tuple[Array, None]:
        onehot = jax.nn.one_hot(assign(cb), Q3_LEVELS, dtype=jnp.float32)
        count = jnp.sum(onehot, axis=-2)
        mean = jnp.einsum("...dk,...d->...k", onehot, x) / jnp.maximum(count, 1.0)
        return jnp.where(count > 0, mean, cb), None

    codebook, _ = jax.lax.scan(lloyd, codebook, None, length=iterations)
    codebook = codebook.astype(codebook_dtype)
    codes = assign(codebook.astype(jnp.float32)).astype(jnp.uint8)
    blocks = codes.reshape(*codes.shape[:-1], 8, d // 8)  # block i = dims [i*d/8, (i+1)*d/8)
    weights = (jnp.uint8(1) << jnp.arange(8, dtype=jnp.uint8))[:, None]
    planes = jnp.stack(
        [jnp.sum(((blocks >> b) & 1) * weights, axis=-2, dtype=jnp.uint8) for b in range(3)], axis=-2
    )
    return Q3Pages(planes=planes, codebook=codebook)


def quantize(x: Float[Array, "*lead d"], fmt: QuantFormat) -> KVPages:
    """Quantize full-precision pages (or single tokens) into ``fmt``; "bf16" just casts."""
    if fmt == "bf16":
        return x.astype(jnp.bfloat16)
    if fmt == "fp8":
        return quantize_fp8(x)
    if fmt == "q4":
        return quantize_q4(x)
    return quantize_q3(x)


def dequantize(pages: KVPages, dtype: jnp.dtype) -> Float[Array, "*lead d"]:
    return pages.astype(dtype) if isinstance(pages, jax.Array) else pages.dequantize(dtype)


def head_dim_of(pages: KVPages) -> int:
    return pages.shape[-1] if isinstance(pages, jax.Array) else pages.head_dim


def leading_shape(pages: KVPages) -> tuple[int, int, int]:
    """``(kv_heads, num_pages, page_size)`` of any layout."""
    leaf = jax.tree_util.tree_leaves(pages)[0]
    return leaf.shape[0], leaf.shape[1], leaf.shape[2]


def take_pages(pages: KVPages, index: Array) -> KVPages:
    """Gather pages (axis 1) of every leaf: the result has ``index``'s shape in place of ``num_pages``."""
    return jax.tree_util.tree_map(lambda leaf: jnp.take(leaf, index, axis=1), pages)


def bytes_per_token(pages: KVPages) -> int:
    """Bytes one token of one kv head occupies in this layout (what decode must read per key)."""
    kvh, num_pages, page_size = leading_shape(pages)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(pages))
    return total // (kvh * num_pages * page_size)
