"""Quantized KV page layouts, their quantizers and (reference) dequantizers, and the key coding.

Every layout keeps the page-table shape of the full-precision cache, ``[kv_heads, num_pages, page_size,
...]``, so the same ``block_tables`` index every leaf and a gather of pages is a ``tree_map``. All
quantization groups live inside one token's head vector: a token is quantized when it is written, on
its own, so a cache can append one token at a time without re-quantizing its page.

==========  =====================================================  ==================  ==============
layout      leaves (per kv head, page, token)                      bits per value      vs bf16 bytes
==========  =====================================================  ==================  ==============
bf16        ``[D]`` bfloat16                                       16                  1x
``Fp8``     ``values [D]`` float8_e4m3fn, ``scale []`` f32         8 + 32/D            ~0.52x
``Q4``      ``packed [D/2]`` u8, ``scale, zero [D/G]`` bf16        4 + 32/G            0.28x (G=64)
``Q3``      ``planes [3, D/8]`` u8, ``scale [D/G]`` bf16           3 + 16/G            0.25x (G=16)
==========  =====================================================  ==================  ==============

Why these granularities:

* FP8: one scale per token — E4M3's exponent already covers the spread inside a head vector; the
  scale only maps the token's absolute maximum onto 448, and it folds into the logits (K) and the
  probabilities (V) instead of touching every element.
* Q4: asymmetric (scale and min) groups of ``G`` consecutive dims (:func:`q4_group_size`: 64, or
  ``D/2`` for heads narrower than 128 -- 32 at SmolLM2's D = 64, like GGUF Q4_1). After the coding
  below each group is nearly Gaussian, and 64 rather than 32 dims raise a unit Gaussian's squared
  error from 0.0061 to 0.0080 while cutting the bytes of a D = 128 token from 80 to 72 (0.31x → 0.28x
  of bf16: 11 % more tokens in a pool). Nibbles are packed *split-half*: byte ``j`` holds dim ``j``
  (low nibble) and dim ``j + D/2`` (high nibble), so a kernel unpacks two contiguous half-tiles with a
  shift and a mask and never interleaves lanes.
* Q3: 8 non-uniform levels :data:`Q3_LEVELS`, scaled per group of ``G`` dims (the group's codebook is
  ``Q3_LEVELS * scale``, the scale fitted by least squares to the group's values), stored as 3
  bit-planes: plane ``b`` byte ``j`` bit ``i`` is bit ``b`` of the code of dim ``i * D/8 + j``, so
  unpacking bit ``i`` of every byte yields the contiguous dim block ``[i*D/8, (i+1)*D/8)`` without lane
  shuffles. The levels are the Lloyd–Max quantizer of a unit Gaussian: after the coding below (a
  Hadamard rotation) each group is nearly Gaussian, and a sensitivity-weighted k-means fit over coded
  SmolLM2 keys and values (``benchmarks/kv_quality.py --fit-levels``) lands within 0.05 of these levels
  pooled over layers (within 0.09 per layer for keys, 0.23 for values), so one shared set serves every
  group and costs nothing per token. A free per-token codebook (8 bf16 entries) measured somewhat
  better (KL to fp32 0.057 against 0.068 on coded SmolLM2 keys) but costs 2 bits per value at D=64,
  as much as Q4's metadata.

The integer formats are meant to be written through a coding (see :class:`KeyCalibration` and
:func:`hadamard`, applied by :class:`zgen.cache.paged.PagedKVState`): values are rotated by an
orthonormal Hadamard matrix (it spreads outlier channels over the whole group); keys are centred on
their calibration means taken *before* RoPE and rotated to the key's position (the first position,
the attention sink, on its own mean), scaled per RoPE pair by a sensitivity proxy and rotated. The
kernels never decode a key: they fold the coding into the query and add the centre's share of each
logit (``key_calibration`` of :func:`~zgen.pallas.paged_attention.paged_attention`); the value
rotation is undone on the attention output, outside the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, Protocol, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Shaped, UInt8

from zgen.rope import apply_rope

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Normalized Q3 levels: the Lloyd–Max levels of a unit Gaussian (see the module docstring).
Q3_LEVELS = (-2.152, -1.344, -0.756, -0.245, 0.245, 0.756, 1.344, 2.152)
# Least-squares refits of each Q3 group's scale after assigning its values to the nearest levels.
Q3_SCALE_REFITS = 3


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

    def halves(self, dtype: jnp.dtype) -> tuple[Float[Array, "*lead half_d"], Float[Array, "*lead half_d"]]:
        """Dims ``[0, D/2)`` and ``[D/2, D)`` dequantized, each from its own nibbles (what
        :func:`dequantize_pieces` gives: a reader that takes the halves apart never joins them)."""
        groups = self.scale.shape[-1] // 2

        def half(codes: Array, part: slice) -> Array:
            grouped = codes.astype(jnp.float32).reshape(*codes.shape[:-1], -1, self.group_size)
            x = grouped * self.scale[..., part, None].astype(jnp.float32) + self.zero[..., part, None].astype(jnp.float32)
            return x.reshape(codes.shape).astype(dtype)

        return half(self.packed & 0xF, slice(None, groups)), half(self.packed >> 4, slice(groups, None))

    def dequantize(self, dtype: jnp.dtype) -> Float[Array, "*lead d"]:
        return jnp.concatenate(self.halves(dtype), axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q3Pages:
    """3-bit codes into :data:`Q3_LEVELS`, scaled per group of ``G`` dims, stored as 3 bit-planes.

    ``x[d] ~= Q3_LEVELS[code[d]] * scale[d // G]`` with, for ``d = i * D/8 + j``,
    ``code[d] = sum_b ((planes[b, j] >> i) & 1) << b``. ``G`` is a multiple of ``D/8`` so a bit-plane
    block never straddles two groups.
    """

    planes: UInt8[Array, "kvh pages page 3 eighth_d"]
    scale: Float[Array, "kvh pages page groups"]

    @property
    def head_dim(self) -> int:
        return 8 * self.planes.shape[-1]

    @property
    def group_size(self) -> int:
        return self.head_dim // self.scale.shape[-1]

    def _bits(self) -> tuple[Array, Array, Array]:
        """Bits 0, 1 and 2 of every code, ``[..., 8, w]`` each (bit index ``i`` on axis -2)."""
        shifts = jnp.arange(8, dtype=jnp.uint8)[:, None]
        planes = self.planes[..., None, :]  # [..., 3, 1, w] against bit index i on axis -2
        bits = (planes >> shifts) & 1  # [..., 3, 8, w]
        return bits[..., 0, :, :], bits[..., 1, :, :], bits[..., 2, :, :]

    def codes(self) -> UInt8[Array, "*lead d"]:
        low, mid, high = self._bits()
        code = low | (mid << 1) | (high << 2)
        return code.reshape(*code.shape[:-2], -1)

    def dequantize(self, dtype: jnp.dtype) -> Float[Array, "*lead d"]:
        # The level of each code picked by its bits (a select tree, not a table lookup: a gather is
        # slow on CPU); the same f32 values as Q3_LEVELS[code].
        low, mid, high = (bit.astype(bool) for bit in self._bits())
        level = [jnp.float32(x) for x in Q3_LEVELS]

        def pick(base: int) -> Array:  # levels base..base+3 by the low two bits
            return jnp.where(
                mid, jnp.where(low, level[base + 3], level[base + 2]), jnp.where(low, level[base + 1], level[base])
            )

        levels = jnp.where(high, pick(4), pick(0))
        levels = levels.reshape(*levels.shape[:-2], -1)
        scale = jnp.repeat(self.scale.astype(jnp.float32), self.group_size, axis=-1)
        return (levels * scale).astype(dtype)


# XLA:CPU computes on bfloat16 and fp8 arrays in float32: updating one token of a pool of them converts
# the whole pool to f32 and back (a copy per write: ~2 ms for a bf16 pool of 2048 pages, 12 ms for fp8),
# and a bitcast of the donated pool is a copy too. Unsigned integers of the same width are updated in place.
BIT_CONTAINERS: dict[jnp.dtype, jnp.dtype] = {
    jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
    jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8),
}


@dataclasses.dataclass(frozen=True)
class BitPages:
    """A page layout whose bfloat16 and fp8 leaves are kept as unsigned integers of their width
    (:data:`BIT_CONTAINERS`), so a page pool on CPU is written in place.

    ``pages`` is the layout with those leaves bitcast; ``dtypes`` names each leaf's float dtype (in
    ``tree_leaves`` order). Gathers and writes act on the integers; :meth:`floats` bitcasts back, which
    readers do on what they gathered (a chunk of pages), never on the pool. Made by :func:`as_bits`.
    """

    pages: KVPages
    dtypes: tuple[str, ...]

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.pages)  # a container has its float's width: the shapes are the same

    def floats(self) -> KVPages:
        """The layout with its float leaves back (bit for bit)."""
        leaves, treedef = jax.tree_util.tree_flatten(self.pages)
        restored = [
            leaf if leaf.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(leaf, jnp.dtype(dtype))
            for leaf, dtype in zip(leaves, self.dtypes, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, restored)

    def dequantize(self, dtype: jnp.dtype) -> Float[Array, "*lead d"]:
        return dequantize(self.floats(), dtype)


jax.tree_util.register_dataclass(BitPages, data_fields=["pages"], meta_fields=["dtypes"])


def as_bits(pages: KVPages) -> KVPages:
    """``pages`` with their bfloat16 and fp8 leaves as :class:`BitPages`; unchanged if they have none."""
    leaves, treedef = jax.tree_util.tree_flatten(pages)
    if not any(leaf.dtype in BIT_CONTAINERS for leaf in leaves):
        return pages
    stored = [
        jax.lax.bitcast_convert_type(leaf, BIT_CONTAINERS[leaf.dtype]) if leaf.dtype in BIT_CONTAINERS else leaf
        for leaf in leaves
    ]
    return BitPages(jax.tree_util.tree_unflatten(treedef, stored), tuple(str(leaf.dtype) for leaf in leaves))


def float_pages(pages: KVPages) -> KVPages:
    """The float layout of ``pages`` (what :func:`as_bits` took apart; other pages as they are)."""
    return pages.floats() if isinstance(pages, BitPages) else pages


def stored_like(pool: KVPages, pages: KVPages) -> KVPages:
    """``pages`` (a float layout, e.g. freshly quantized tokens) in the storage form of ``pool``."""
    return as_bits(pages) if isinstance(pool, BitPages) else pages


QuantizedPages: TypeAlias = Fp8Pages | Q4Pages | Q3Pages


class PageLayout(Protocol):
    """What any page layout offers, a format registered outside zgen's included
    (:func:`zgen.cache.formats.register_format`): a registered pytree whose leaves all lead with
    ``[kv_heads, pages, page_size]``."""

    @property
    def head_dim(self) -> int: ...

    def dequantize(self, dtype: jnp.dtype) -> Float[Array, "*lead d"]: ...


KVPages: TypeAlias = Array | QuantizedPages | BitPages | PageLayout
QuantFormat = Literal["bf16", "fp8", "q4", "q3"]


def quantize_fp8(x: Float[Array, "*lead d"]) -> Fp8Pages:
    """Per-token scaled E4M3 (reference quantizer, plain jnp)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return Fp8Pages(values=(x / scale[..., None]).astype(jnp.float8_e4m3fn), scale=scale)


Q4_GROUP = 64


def q4_group_size(head_dim: int) -> int:
    """Dims per Q4 (scale, min) group: :data:`Q4_GROUP`, or the largest divisor of head_dim/2 below it."""
    return math.gcd(Q4_GROUP, head_dim // 2)


def quantize_q4(x: Float[Array, "*lead d"], group_size: int | None = None, scale_dtype: jnp.dtype = jnp.bfloat16) -> Q4Pages:
    """Asymmetric 4-bit groups of ``group_size`` dims (default :func:`q4_group_size`); codes are fitted to
    the *stored* (rounded) scales."""
    d = x.shape[-1]
    group_size = q4_group_size(d) if group_size is None else group_size
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


def quantize_q3(x: Float[Array, "*lead d"], group_size: int = 16, scale_dtype: jnp.dtype = jnp.bfloat16) -> Q3Pages:
    """Nearest of :data:`Q3_LEVELS` times a per-group scale, the scale refitted by least squares.

    The scale starts at the group's RMS (the levels are those of a unit-variance Gaussian) and is
    refitted ``Q3_SCALE_REFITS`` times to the levels the values fall on; codes are then chosen against
    the *stored* (rounded) scale.
    """
    d = x.shape[-1]
    if d % 8 or group_size % (d // 8) or d % group_size:
        raise ValueError(f"Q3 needs head_dim % 8 == 0 and group_size ({group_size}) a multiple of head_dim/8 dividing head_dim ({d})")
    levels = jnp.asarray(Q3_LEVELS, jnp.float32)
    g = x.astype(jnp.float32).reshape(*x.shape[:-1], d // group_size, group_size)

    def nearest(scale: Array) -> Array:
        safe = jnp.where(scale > 0, scale, 1.0)[..., None]
        return jnp.argmin(jnp.abs(g[..., None] / safe[..., None] - levels), axis=-1)

    scale = jnp.sqrt(jnp.mean(g * g, axis=-1))
    for _ in range(Q3_SCALE_REFITS):
        assigned = levels[nearest(scale)]
        scale = jnp.sum(g * assigned, axis=-1) / jnp.sum(assigned * assigned, axis=-1)
    scale = scale.astype(scale_dtype)
    codes = nearest(scale.astype(jnp.float32)).astype(jnp.uint8).reshape(x.shape)
    blocks = codes.reshape(*codes.shape[:-1], 8, d // 8)  # block i = dims [i*d/8, (i+1)*d/8)
    weights = (jnp.uint8(1) << jnp.arange(8, dtype=jnp.uint8))[:, None]
    planes = jnp.stack(
        [jnp.sum(((blocks >> b) & 1) * weights, axis=-2, dtype=jnp.uint8) for b in range(3)], axis=-2
    )
    return Q3Pages(planes=planes, scale=scale)


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


def dequantize_pieces(pages: KVPages, dtype: jnp.dtype) -> list[Float[Array, "*lead piece"]]:
    """The pages dequantized in consecutive pieces of the head dim (Q4's two halves, one piece
    otherwise). A reader that dots each piece with its slice of the query and joins only its small
    outputs spares XLA:CPU a byte-by-byte join of every page it reads (the XLA backend's chunks)."""
    pages = float_pages(pages)
    if isinstance(pages, Q4Pages):
        return list(pages.halves(dtype))
    return [dequantize(pages, dtype)]


def head_dim_of(pages: KVPages) -> int:
    return pages.shape[-1] if isinstance(pages, jax.Array) else pages.head_dim


def leading_shape(pages: KVPages) -> tuple[int, int, int]:
    """``(kv_heads, num_pages, page_size)`` of any layout."""
    leaf = jax.tree_util.tree_leaves(pages)[0]
    return leaf.shape[0], leaf.shape[1], leaf.shape[2]


def take_pages(pages: KVPages, index: Array) -> KVPages:
    """Gather pages (axis 1) of every leaf: the result has ``index``'s shape in place of ``num_pages``.

    Out-of-range entries (a masked page's table slot) are clamped, not filled: a reader masks those
    pages anyway, and the fill mode had XLA:CPU guard every gathered element with a select (q3 and q4
    decode attention 1.5x and 1.3x slower for it at 576 tokens)."""
    return jax.tree_util.tree_map(lambda leaf: jnp.take(leaf, index, axis=1, mode="clip"), pages)


def gather_sequences(pages: KVPages, block_tables: Int[Array, "b pages_per_seq"], dtype: jnp.dtype | None) -> Array:
    """``[B, pages_per_seq * page_size, KVH, D]``: each row's pages in table order, so slot ``j`` holds
    position ``j`` (``-1`` entries read page 0). ``dtype=None`` keeps a plain array's stored dtype;
    quantized pages are dequantized to ``dtype`` (float32 if None)."""
    num_pages = leading_shape(pages)[1]
    gathered = float_pages(take_pages(pages, jnp.clip(block_tables, 0, num_pages - 1)))  # [KVH, B, pps, ps, ...]
    if isinstance(gathered, jax.Array):
        dense = gathered if dtype is None else gathered.astype(dtype)
    else:
        dense = dequantize(gathered, jnp.float32 if dtype is None else dtype)
    kvh, b, pps, ps, d = dense.shape
    return dense.reshape(kvh, b, pps * ps, d).transpose(1, 2, 0, 3)


def bytes_per_token(pages: KVPages) -> int:
    """Bytes one token of one kv head occupies in this layout (what decode must read per key)."""
    kvh, num_pages, page_size = leading_shape(pages)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(pages))
    return total // (kvh * num_pages * page_size)


def hadamard(x: Float[Array, "*lead d"]) -> Float[Array, "*lead d"]:
    """Orthonormal Walsh–Hadamard transform of the last axis, in f32 (its own inverse).

    Blocks of the largest power of two dividing ``D`` (all of it for D = 64 or 128), as a fast
    transform: log2(block) butterfly stages of adds and subtracts, so each row's result is the same
    however many rows are transformed together -- what coding a stored token needs (a token is
    quantized the same written alone or in a chunk, so a cache does not depend on its history).
    Reads use :func:`hadamard_dot`.
    """
    d = x.shape[-1]
    block = d & -d
    y = x.astype(jnp.float32).reshape(*x.shape[:-1], d // block, block)
    half = 1
    while half < block:
        pairs = y.reshape(*y.shape[:-1], block // (2 * half), 2, half)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        y = jnp.stack([low + high, low - high], axis=-2).reshape(y.shape)
        half *= 2
    return y.reshape(x.shape) * (block**-0.5)


def hadamard_dot(x: Float[Array, "*lead d"], dot_dtype: jnp.dtype = jnp.float32) -> Float[Array, "*lead d"]:
    """:func:`hadamard` as one dot with Sylvester's ``±1`` matrix accumulated in f32, for what is read
    back (attention outputs, folded queries, decoded keys): on a GPU each butterfly stage of the fast
    transform is an XLA kernel of its own (7 at D = 128), the dot one. A dot's summation order may
    depend on how many rows it takes, so stored tokens are coded with :func:`hadamard` (or, on GPUs,
    by the write kernel's dots over fixed tiles, :func:`zgen.pallas.page_write.write_kv`). ``dot_dtype``
    bfloat16 runs it on the tensor cores for inputs already in bf16 (the products stay exact)."""
    d = x.shape[-1]
    block = d & -d
    y = x.astype(dot_dtype).reshape(*x.shape[:-1], d // block, block)
    matrix = jnp.asarray(sylvester(block), dot_dtype)
    exact = jax.lax.Precision.HIGHEST if jnp.dtype(dot_dtype) == jnp.float32 else jax.lax.Precision.DEFAULT
    y = jnp.einsum("...i,ij->...j", y, matrix, precision=exact, preferred_element_type=jnp.float32)
    return y.reshape(x.shape) * (block**-0.5)


@functools.cache
def sylvester(n: int) -> np.ndarray:
    """Sylvester's ``n x n`` Hadamard matrix of ``±1`` (``n`` a power of two), symmetric."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyCalibration:
    """Per-kv-head statistics an integer format codes one layer's keys with.

    Keys arrive after RoPE. ``stored = hadamard((k - rope(shift, pos)) * scale)`` with ``shift =
    sink`` for the key at position 0 and ``center`` elsewhere -- the statistics of keys *before* RoPE,
    rotated to the key's position, so ``k - rope(shift, pos) = rope(k_pre - shift, pos)``: centring
    removes the large per-channel offsets keys carry before RoPE (a few channels sit at 5x the
    vector's RMS), which would otherwise set every group's range; the attention sink (position 0)
    has a key of its own, nearly the same in every sequence, so it gets its own centre. ``scale``
    weights channels by sensitivity (see :func:`zgen.cache.paged.calibrate_keys`) and is equal on
    the two dims of a RoPE pair, so it commutes with RoPE; the rotation then spreads what is left
    evenly over the quantization groups. ``inv_freq`` are the model's RoPE inverse frequencies.

    Because the scale and the rotation act on channels alone, ``q . k = hadamard(q / scale) . stored
    + q . rope(shift, pos)``: kernels dot the transformed query with the stored codes as with any
    page, and add the mean term (:meth:`mean_products`), never decoding a key. ``identity`` codes keys
    with the rotation alone.
    """

    center: Float[Array, "kvh d"]
    sink: Float[Array, "kvh d"]
    scale: Float[Array, "kvh d"]
    inv_freq: Float[Array, " half"]

    @classmethod
    def identity(cls, kv_heads: int, head_dim: int) -> KeyCalibration:
        zeros = jnp.zeros((kv_heads, head_dim), jnp.float32)
        ones = jnp.ones((kv_heads, head_dim), jnp.float32)
        return cls(center=zeros, sink=zeros, scale=ones, inv_freq=jnp.zeros((head_dim // 2,), jnp.float32))

    def _per_head(self, stat: Array, ndim: int, head_axis: int) -> Array:
        """``stat [KVH, D]`` shaped to broadcast against an array of ``ndim`` dims (head axis ``head_axis``)."""
        shape = [1] * ndim
        shape[head_axis], shape[-1] = stat.shape
        return stat.astype(jnp.float32).reshape(shape)

    def _shift(self, positions: Int[Array, "..."], ndim: int, head_axis: int) -> Array:
        """The centre of each key (its position's, rotated to it); ``positions`` broadcast against
        the keys' leading dims."""
        sink, center = self._per_head(self.sink, ndim, head_axis), self._per_head(self.center, ndim, head_axis)
        return apply_rope(jnp.where((positions == 0)[..., None], sink, center), positions, self.inv_freq)

    def encode(self, k: Float[Array, "*lead d"], positions: Int[Array, "..."], head_axis: int) -> Float[Array, "*lead d"]:
        """Code keys ``k`` (after RoPE; kv heads on ``head_axis``) at ``positions`` (broadcast
        against ``k``'s leading dims)."""
        centred = k.astype(jnp.float32) - self._shift(positions, k.ndim, head_axis)
        return hadamard(centred * self._per_head(self.scale, k.ndim, head_axis))

    def decode(
        self, coded: Float[Array, "*lead d"], positions: Int[Array, "..."], head_axis: int, dot_dtype: jnp.dtype | None = None
    ) -> Float[Array, "*lead d"]:
        """Invert :meth:`encode` (on dequantized values; f32 out); the rotation exact per key
        (:func:`hadamard`), or one dot in ``dot_dtype`` (:func:`hadamard_dot`)."""
        rotated = hadamard(coded) if dot_dtype is None else hadamard_dot(coded, dot_dtype)
        unscaled = rotated / self._per_head(self.scale, coded.ndim, head_axis)
        return unscaled + self._shift(positions, coded.ndim, head_axis)

    def fold_into_queries(self, q: Float[Array, "*lead d"], head_axis: int) -> Float[Array, "*lead d"]:
        """``hadamard(q / scale)`` in f32: its dot with a stored code is ``q``'s dot with the key's
        uncentred part."""
        return hadamard_dot(q.astype(jnp.float32) / self._per_head(self.scale, q.ndim, head_axis))

    def mean_products(
        self, q: Float[Array, "*lead d"], head_axis: int
    ) -> tuple[Float[Array, "*lead half"], Float[Array, "*lead half"], Float[Array, " *lead"]]:
        """What the mean term needs of each query: ``q . rope(center, p) = sum(a * cos(p * f) + b * sin(p * f))``
        with ``a = q1 c1 + q2 c2`` and ``b = q2 c1 - q1 c2`` (halves of ``q`` and ``center``), and the
        sink's extra ``q . (sink - center)`` at position 0 (where RoPE is the identity)."""
        q32 = q.astype(jnp.float32)
        center = self._per_head(self.center, q.ndim, head_axis)
        q1, q2 = jnp.split(q32, 2, axis=-1)
        c1, c2 = jnp.split(jnp.broadcast_to(center, q32.shape), 2, axis=-1)
        sink_gap = self._per_head(self.sink, q.ndim, head_axis) - center
        return q1 * c1 + q2 * c2, q2 * c1 - q1 * c2, jnp.sum(q32 * sink_gap, axis=-1)
