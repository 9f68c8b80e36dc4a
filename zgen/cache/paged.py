"""Paged KV cache: fixed-size blocks from a shared pool, addressed through per-sequence block tables.

Two levels, as every zgen cache kind (see ``zgen/cache/base.py``):

* :class:`PagedKVState` — the device pytree used inside compiled plans. Per layer it holds the whole
  pool of K and V pages ``[kv_heads, num_pages, page_size, ...]`` in the storage format ``kv_dtype``,
  plus ``block_tables [batch, pages_per_seq]`` (page id of each sequence's i-th block, ``-1`` where
  none is allocated). Token at position ``p`` of row ``b`` lives in page ``block_tables[b, p //
  page_size]`` at offset ``p % page_size``; the visibility rule is the dense one (key at ``j`` visible
  to a query at ``p`` iff ``j <= p`` and ``j > p - window``).
* Host handles — :class:`PagedKVCache` (the ``CacheProvider``: append, read back, truncate, fork with
  copy-on-write pages) and :class:`PagedBackend` (the generator's ``CacheBackend``: whole-capacity
  allocation, prefix reuse through a :class:`~zgen.cache.radix.RadixCache`). Both keep their pages in
  a :class:`PageStore` with a :class:`~zgen.cache.block_pool.BlockPool` doing the bookkeeping.

Storage formats (``kv_dtype``): ``fp32``, ``bf16``, ``fp16`` are plain arrays; ``fp8`` (E4M3 + f32
scale per token), ``q4`` (asymmetric 4-bit groups of 32) and ``q3`` (8 non-uniform levels times a
scale per group of 16) are the page layouts of :mod:`zgen.pallas.paged_attention.layouts`. Writes
quantize each token as it is stored; attention -- decode, verification and prefill chunks alike --
hands the stored pages to :func:`zgen.pallas.paged_attention`, which reads only the pages each query
can see and dequantizes them inside the kernel, so no full-precision copy of the cache exists.

The integer formats (``CODED_KV_DTYPES``: q4, q3) code what they store, KVQuant-style:

* keys are centred on per-channel calibration means of keys *before* RoPE, rotated to the key's
  position (``k - rope(mean, pos) = rope(k_pre - mean, pos)``: pre-RoPE, a key's large channels sit
  in the same place token after token, so fixed per-channel statistics fit them; the key at
  position 0, the attention sink, has its own mean: past the first layers it is nearly the same
  vector in every sequence), scaled per RoPE pair by a Fisher-information proxy and rotated by an
  orthonormal Hadamard matrix (:class:`~zgen.pallas.paged_attention.layouts.KeyCalibration`, fitted
  by :func:`calibrate_keys` and passed in through ``PagedConfig.key_calibration``). The attention
  kernels never decode them: the coding folds into the query (``key_calibration``);
* values are Hadamard-rotated; attention runs in the rotated basis and the output is rotated back.

The other formats store keys as the dense cache does (f32 greedy decoding must
equal HF transformers). Measured on SmolLM2-135M (``benchmarks/kv_quality.py``, f32, perplexity of a
2,373-token English text in 512-token windows read through the cache in chunks of 64; bytes per token
per layer, K + V over 3 kv heads x 64 dims): fp32 1536 B, PPL 32.584; fp16/bf16 768 B, +0.00 %; fp8
408 B, +0.31 %; q4 240 B, +1.31 %; q3 192 B, +4.80 %. Without a calibration (rotation only): q4
+3.64 %, q3 +17.4 %. Decode speeds and the method are in ``docs/kv_quantization.md``.

For the dense ("tensor") layout with a quantized storage dtype, use :meth:`PagedKVState.contiguous`:
a paged state whose block table is the identity (row ``b`` owns pages ``[b * pps, (b + 1) * pps)``),
which makes the storage dtype independent of the layout.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Self, TypeAlias, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from zgen.cache.base import LayerKV, replace_layer
from zgen.cache.block_pool import BlockPool, blocks_for
from zgen.cache.radix import RadixCache
from zgen.cache.tensor import causal_attention
from zgen.errors import CacheError, ConfigError, PoolExhaustedError
from zgen.graph.core import ForwardContext
from zgen.graph.decoder import LOGIT_ROWS, POSITIONS, TOKENS
from zgen.graph.nodes import rotary
from zgen.pallas import paged_attention
from zgen.pallas.paged_attention.layouts import (
    Fp8Pages,
    KeyCalibration,
    KVPages,
    Q3Pages,
    Q4Pages,
    dequantize,
    hadamard,
    head_dim_of,
    quantize_fp8,
    quantize_q3,
    quantize_q4,
    take_pages,
)

if TYPE_CHECKING:
    from zgen.model import Model

KVDtype: TypeAlias = Literal["fp32", "bf16", "fp16", "fp8", "q4", "q3"]
KV_DTYPES: tuple[str, ...] = get_args(KVDtype)
_PLAIN = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
Q4_GROUP = 32
Q3_GROUP = 16
# The integer formats code what they store (see the module docstring): keys before RoPE, centred,
# scaled and Hadamard-rotated with a KeyCalibration; values Hadamard-rotated.
CODED_KV_DTYPES = frozenset({"q4", "q3"})


# -- storage formats ---------------------------------------------------------------------------------


def check_kv_dtype(kv_dtype: str, head_dim: int) -> None:
    """Raise ConfigError unless ``kv_dtype`` is known and can store heads of ``head_dim``."""
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"unknown kv_dtype {kv_dtype!r}; choose one of {KV_DTYPES}")
    if kv_dtype == "q4" and head_dim % 2:
        raise ConfigError(f"kv_dtype 'q4' packs two dims per byte and needs an even head_dim, got {head_dim}")
    if kv_dtype == "q3" and head_dim % 8:
        raise ConfigError(f"kv_dtype 'q3' stores 3 bit-planes of head_dim/8 bytes and needs head_dim % 8 == 0, got {head_dim}")


def q4_group_size(head_dim: int) -> int:
    """Dims per Q4 (scale, min) group: 32, or the largest divisor of head_dim/2 below it."""
    return math.gcd(Q4_GROUP, head_dim // 2)


def q3_group_size(head_dim: int) -> int:
    """Dims per Q3 scale: 16, or the least multiple of head_dim/8 (a bit-plane block) that divides head_dim."""
    group = math.lcm(Q3_GROUP, head_dim // 8)
    return group if head_dim % group == 0 else head_dim


def empty_pages(kv_dtype: str, kv_heads: int, num_pages: int, page_size: int, head_dim: int) -> KVPages:
    """Zeroed pages ``[kv_heads, num_pages, page_size, ...]`` in the storage format ``kv_dtype``."""
    check_kv_dtype(kv_dtype, head_dim)
    lead = (kv_heads, num_pages, page_size)
    if kv_dtype in _PLAIN:
        return jnp.zeros((*lead, head_dim), _PLAIN[kv_dtype])
    if kv_dtype == "fp8":
        return Fp8Pages(values=jnp.zeros((*lead, head_dim), jnp.float8_e4m3fn), scale=jnp.ones(lead, jnp.float32))
    if kv_dtype == "q4":
        groups = head_dim // q4_group_size(head_dim)
        return Q4Pages(
            packed=jnp.zeros((*lead, head_dim // 2), jnp.uint8),
            scale=jnp.zeros((*lead, groups), jnp.bfloat16),
            zero=jnp.zeros((*lead, groups), jnp.bfloat16),
        )
    groups = head_dim // q3_group_size(head_dim)
    return Q3Pages(planes=jnp.zeros((*lead, 3, head_dim // 8), jnp.uint8), scale=jnp.zeros((*lead, groups), jnp.bfloat16))


def quantize_tokens(x: Float[Array, "*lead D"], kv_dtype: str) -> KVPages:
    """Quantize token head vectors ``[..., D]`` into ``kv_dtype`` (each token on its own)."""
    if kv_dtype in _PLAIN:
        return x.astype(_PLAIN[kv_dtype])
    if kv_dtype == "fp8":
        return quantize_fp8(x)
    if kv_dtype == "q4":
        return quantize_q4(x, group_size=q4_group_size(x.shape[-1]))
    if kv_dtype == "q3":
        return quantize_q3(x, group_size=q3_group_size(x.shape[-1]))
    raise ConfigError(f"unknown kv_dtype {kv_dtype!r}; choose one of {KV_DTYPES}")


def bytes_per_token_per_layer(kv_dtype: str, kv_heads: int, head_dim: int, page_size: int = 16) -> int:
    """Bytes one token takes in one layer, K and V over all kv heads, measured on the real page arrays.

    Computed from the shapes and dtypes of :func:`empty_pages` (scales included), so it is
    what the pool really spends: e.g. at 3 kv heads x 64 dims, fp32 1536, bf16 768, fp8 408, q4 240,
    q3 192 (0.25x of bf16 at head_dim 64 and 128).
    """
    shapes = jax.eval_shape(lambda: empty_pages(kv_dtype, kv_heads, 1, page_size, head_dim))
    total = sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(shapes))
    return 2 * total // page_size


def _num_pages(pages: KVPages) -> int:
    return jax.tree_util.tree_leaves(pages)[0].shape[1]


def _page_size(pages: KVPages) -> int:
    return jax.tree_util.tree_leaves(pages)[0].shape[2]


def _scatter_tokens(pages: KVPages, new: KVPages, page: Array, offset: Array) -> KVPages:
    """Store token leaves ``[B, T, KVH, ...]`` at ``(page, offset)`` ``[B, T]``; out-of-range pages drop.

    FP8 leaves are scattered as uint8: XLA on CPU widens an fp8 scatter to f32 and back, copying the
    whole pool on every write, which made fp8 decode ~60x slower than fp16 there (0.58 against 34 tok/s
    on SmolLM2); as uint8 it runs at ~5 tok/s. (The same bitcast slows fp16 and bf16 down, so only fp8
    takes it.)
    """

    def scatter(leaf: Array, val: Array) -> Array:
        val = jnp.moveaxis(val, 2, 0).astype(leaf.dtype)
        if not (jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype.itemsize == 1):
            return leaf.at[:, page, offset].set(val, mode="drop")
        as_bytes = jax.lax.bitcast_convert_type(leaf, jnp.uint8)
        stored = as_bytes.at[:, page, offset].set(jax.lax.bitcast_convert_type(val, jnp.uint8), mode="drop")
        return jax.lax.bitcast_convert_type(stored, leaf.dtype)

    return jax.tree_util.tree_map(scatter, pages, new)


def _gather_dense(pages: KVPages, block_tables: Array, dtype: Any | None) -> Array:
    """``[B, pages_per_seq * page_size, KVH, D]``: each row's pages in order (``-1`` entries read page 0).

    ``dtype=None`` keeps a plain array's stored dtype; quantized pages are dequantized to ``dtype``
    (float32 if None).
    """
    num_pages = _num_pages(pages)
    gathered = take_pages(pages, jnp.clip(block_tables, 0, num_pages - 1))  # [KVH, B, pps, ps, ...]
    if isinstance(gathered, jax.Array):
        dense = gathered if dtype is None else gathered.astype(dtype)
    else:
        dense = dequantize(gathered, jnp.float32 if dtype is None else dtype)
    kvh, b, pps, ps, d = dense.shape
    return dense.reshape(kvh, b, pps * ps, d).transpose(1, 2, 0, 3)


# -- device state ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedKVState:
    """Per-layer K/V page pools plus the block tables of the batch (a pytree; ``kv_dtype`` and the
    view ``dtype`` are static).

    ``capacity`` is ``pages_per_seq * page_size``. Writes to positions outside ``[0, capacity)`` or to
    blocks the table does not name (``-1``) are dropped, like the dense state's out-of-range writes.
    ``key_calibration`` (one :class:`KeyCalibration` per layer, see :func:`calibrate_keys`) is what
    the coded formats (q4, q3) code keys with; ``None`` codes them with the Hadamard rotation alone.
    """

    k: tuple[KVPages, ...]
    v: tuple[KVPages, ...]
    block_tables: Int[Array, "B P"]
    kv_dtype: str = "fp32"
    dtype: str = "float32"  # dtype of layer_view (and of dequantized prefill keys if the query's is wider)
    key_calibration: tuple[KeyCalibration, ...] | None = None

    @classmethod
    def contiguous(
        cls,
        num_layers: int,
        batch: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        *,
        kv_dtype: str = "fp32",
        page_size: int = 16,
        dtype: str = "float32",
        key_calibration: Sequence[KeyCalibration] | None = None,
    ) -> PagedKVState:
        """A dense-equivalent state: row ``b`` owns pages ``[b * pps, (b + 1) * pps)`` (identity table).

        This is how the dense "tensor" layout gets a quantized storage dtype (fp8/q4/q3): the same
        pages and kernels, no pool and no sharing.
        """
        if capacity <= 0 or batch <= 0:
            raise ConfigError(f"batch ({batch}) and capacity ({capacity}) must be positive")
        pps = blocks_for(capacity, page_size)
        pages = [empty_pages(kv_dtype, kv_heads, batch * pps, page_size, head_dim) for _ in range(2 * num_layers)]
        table = jnp.arange(batch * pps, dtype=jnp.int32).reshape(batch, pps)
        calibration = _device_calibration(key_calibration, num_layers, kv_heads, head_dim)
        return cls(tuple(pages[:num_layers]), tuple(pages[num_layers:]), table, kv_dtype, dtype, calibration)

    @property
    def page_size(self) -> int:
        return _page_size(self.k[0])

    @property
    def num_pages(self) -> int:
        return _num_pages(self.k[0])

    @property
    def pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def capacity(self) -> int:
        return self.pages_per_seq * self.page_size

    @property
    def quantized(self) -> bool:
        return self.kv_dtype not in _PLAIN

    def _key_coding(self, layer: int) -> KeyCalibration | None:
        """The layer's key calibration in a coded format (the identity one if none was given), else None."""
        if self.kv_dtype not in CODED_KV_DTYPES:
            return None
        if self.key_calibration is not None:
            return self.key_calibration[layer]
        kv_heads, head_dim = _heads_and_dim(self.k[layer])
        return KeyCalibration.identity(kv_heads, head_dim)

    def write(
        self,
        layer: int,
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
    ) -> Self:
        """Code (coded formats), quantize (if the format asks) and scatter each token into its (page, offset)."""
        ps, pps = self.page_size, self.pages_per_seq
        positions = positions.astype(jnp.int32)
        coding = self._key_coding(layer)
        if coding is not None:
            k = coding.encode(k, positions[:, :, None], head_axis=-2)
            v = hadamard(v)
        index = jnp.clip(positions // ps, 0, pps - 1)
        page = jnp.take_along_axis(self.block_tables, index, axis=1)
        ok = (positions >= 0) & (positions < pps * ps) & (page >= 0)
        page = jnp.where(ok, page, self.num_pages)  # out of bounds: the scatter drops it
        offset = positions % ps
        new_k = _scatter_tokens(self.k[layer], quantize_tokens(k, self.kv_dtype), page, offset)
        new_v = _scatter_tokens(self.v[layer], quantize_tokens(v, self.kv_dtype), page, offset)
        return replace(
            self,
            k=replace_layer(self.k, layer, new_k),
            v=replace_layer(self.v, layer, new_v),
        )

    def attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        positions: Int[Array, "B T"],
        *,
        sliding_window: int | None,
        page_mask: Bool[Array, "B P"] | None = None,
    ) -> Float[Array, "B T H D"]:
        """:func:`~zgen.pallas.paged_attention` of the queries over the stored pages.

        Positions need not start at 0 (a cached prefix may precede them): visibility only depends on
        each query's position. Coded values are attended to in the rotated basis; the output is rotated back. ``page_mask``
        (``False``: dropped or wholly masked pages) keeps pages out of attention.
        """
        coding = self._key_coding(layer)
        out = paged_attention(
            q,
            self.k[layer],
            self.v[layer],
            self.block_tables,
            positions.astype(jnp.int32),
            page_mask=page_mask,
            sliding_window=sliding_window,
            key_calibration=coding,
        )
        return out if coding is None else hadamard(out).astype(q.dtype)

    def layer_view(self, layer: int) -> LayerKV:
        """All ``capacity`` slots of every row, dequantized (and decoded) to ``dtype`` (tests and
        inspection only): keys as they were written (after RoPE)."""
        dtype = jnp.dtype(self.dtype)
        k = _gather_dense(self.k[layer], self.block_tables, dtype)
        v = _gather_dense(self.v[layer], self.block_tables, dtype)
        coding = self._key_coding(layer)
        if coding is not None:
            k = coding.decode(k, jnp.arange(k.shape[1])[None, :, None], head_axis=-2).astype(dtype)
            v = hadamard(v).astype(dtype)
        return LayerKV(k, v)


jax.tree_util.register_dataclass(
    PagedKVState, data_fields=["k", "v", "block_tables", "key_calibration"], meta_fields=["kv_dtype", "dtype"]
)


def _heads_and_dim(pages: KVPages) -> tuple[int, int]:
    return jax.tree_util.tree_leaves(pages)[0].shape[0], head_dim_of(pages)


def _device_calibration(
    calibration: Sequence[KeyCalibration] | None, num_layers: int, kv_heads: int, head_dim: int
) -> tuple[KeyCalibration, ...] | None:
    """Fresh float32 device copies (a compiled plan donates its state's arrays), checked against the cache shape."""
    if calibration is None:
        return None
    if len(calibration) != num_layers:
        raise ConfigError(f"key_calibration has {len(calibration)} layers, the cache {num_layers}")
    for layer in calibration:
        if any(tuple(np.shape(stat)) != (kv_heads, head_dim) for stat in (layer.center, layer.sink, layer.scale)):
            raise ConfigError(f"key_calibration statistics must be [kv_heads={kv_heads}, head_dim={head_dim}]")
        if tuple(np.shape(layer.inv_freq)) != (head_dim // 2,):
            raise ConfigError(f"key_calibration inv_freq must be [head_dim / 2 = {head_dim // 2}]")
    return tuple(jax.tree_util.tree_map(lambda stat: jnp.array(stat, jnp.float32), layer) for layer in calibration)


# -- key calibration ---------------------------------------------------------------------------------


class _KeyStatistics(ForwardContext):
    """Causal attention of each calibration window over itself (no cache), summing per layer the
    pre-RoPE keys (and their squares) of positions > 0, the keys at position 0, and the energy of the
    queries in each RoPE pair, per kv head."""

    def __init__(self, sliding_window: int | None) -> None:
        self.sliding_window = sliding_window
        self.sums: list[dict[str, Array]] = []
        self.inv_freq: list[Array] = []

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        inv_freq: Float[Array, " half"],
    ) -> Float[Array, "B T H D"]:
        b, t, heads, d = q.shape
        kv_heads = k.shape[2]
        first = (positions == 0)[:, :, None, None]
        k32 = k.astype(jnp.float32)
        q_energy = jnp.sum(jnp.square(q.astype(jnp.float32)).reshape(b, t, kv_heads, heads // kv_heads, d), axis=(0, 1, 3))
        self.sums.append(
            {
                "key": jnp.sum(jnp.where(first, 0.0, k32), axis=(0, 1)),
                "key_sq": jnp.sum(jnp.where(first, 0.0, k32 * k32), axis=(0, 1)),
                "count": jnp.sum(~first),
                "sink": jnp.sum(jnp.where(first, k32, 0.0), axis=(0, 1)),
                "sinks": jnp.sum(first),
                "q_pair_energy": q_energy[:, : d // 2] + q_energy[:, d // 2 :],
            }
        )
        self.inv_freq.append(inv_freq.astype(jnp.float32))
        return causal_attention(q, rotary(k, positions, inv_freq), v, positions, sliding_window=self.sliding_window)


def calibrate_keys(
    model: Model, token_ids: Sequence[int] | None = None, *, windows: int = 8, window: int = 512, seed: int = 0
) -> tuple[KeyCalibration, ...]:
    """Per-layer key statistics for the coded formats, from one forward pass over calibration tokens.

    ``token_ids`` default to ``windows x window`` uniformly random token ids (seeded): data-free, so no
    evaluation text can leak into the calibration; on SmolLM2 they give the same key means, sinks and
    query energies to within what matters (PPL within 0.3 % of a calibration on real English text).
    Each window is one sequence starting at position 0. Per kv head and channel ``c``:

    * ``center``: mean pre-RoPE key over positions > 0; ``sink``: mean key at position 0;
    * ``scale``: a Fisher-information proxy, one per RoPE pair (so it commutes with RoPE). KVQuant
      weights its k-means by the Fisher information of each key element, i.e. E[(dL/dk_c)^2]; the
      gradient of a logit with respect to a key is the query, so without calibration gradients we
      take the query energy of channel ``c``'s RoPE pair ``w_c`` (RoPE rotates within a pair, so the
      pair's energy does not depend on the distance).
      Minimising the ``w``-weighted squared error of keys quantized with one step per group, after
      scaling channel ``c`` by ``a_c``, gives ``a_c ~ w_c^(1/4) / sigma_c^(1/2)`` (``sigma_c``: the
      pair's RMS standard deviation; Lagrange on ``sum_c w_c / a_c^2`` at fixed ``sum_c a_c^2 sigma_c^2``).
      Normalised to a geometric mean of 1 per head.
    """
    config = model.config
    if token_ids is None:
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, config.vocab_size, (windows, window), dtype=np.int32)
    else:
        usable = max(1, min(windows, len(token_ids) // window)) * window
        ids = np.asarray(token_ids[:usable], np.int32)
        tokens = ids.reshape(-1, min(window, len(ids)))
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    rows = np.zeros((tokens.shape[0], 1), np.int32)

    @jax.jit
    def statistics(
        params: dict[str, Array], tokens: Array, positions: Array, rows: Array
    ) -> tuple[list[dict[str, Array]], list[Array]]:
        context = _KeyStatistics(model.plan.sliding_window)
        model.graph.run(params, {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: rows}, context)
        return context.sums, context.inv_freq

    layers = []
    all_sums, inv_freqs = statistics(model.params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(rows))
    for sums, inv_freq in zip(all_sums, inv_freqs, strict=True):
        stats = {name: np.asarray(value, np.float64) for name, value in sums.items()}
        center = stats["key"] / stats["count"]
        variance = np.maximum(stats["key_sq"] / stats["count"] - center**2, 0.0)
        half = variance.shape[-1] // 2
        # One spread per RoPE pair, so that the scale commutes with RoPE (see KeyCalibration).
        sigma = np.sqrt(np.concatenate([(variance[..., :half] + variance[..., half:]) / 2] * 2, axis=-1))
        sigma = np.maximum(sigma, 1e-3 * sigma.max(axis=-1, keepdims=True) + 1e-12)
        energy = np.concatenate([stats["q_pair_energy"]] * 2, axis=-1)
        energy = np.maximum(energy, 1e-6 * energy.max(axis=-1, keepdims=True) + 1e-12)
        scale = energy**0.25 / np.sqrt(sigma)
        scale /= np.exp(np.mean(np.log(scale), axis=-1, keepdims=True))
        sink = stats["sink"] / max(float(stats["sinks"]), 1.0)
        layers.append(KeyCalibration(*(jnp.asarray(x, jnp.float32) for x in (center, sink, scale)), inv_freq=inv_freq))
    return tuple(layers)


# -- jitted host helpers -------------------------------------------------------------------------------


def _one_layer(calibration: KeyCalibration | None) -> tuple[KeyCalibration] | None:
    return None if calibration is None else (calibration,)


@partial(jax.jit, static_argnames=("kv_dtype",), donate_argnums=(0, 1))
def _write_layer(
    k_pages: KVPages,
    v_pages: KVPages,
    k: Array,
    v: Array,
    tables: Array,
    positions: Array,
    calibration: KeyCalibration | None,
    kv_dtype: str,
) -> tuple[KVPages, KVPages]:
    state = PagedKVState((k_pages,), (v_pages,), tables, kv_dtype, key_calibration=_one_layer(calibration))
    state = state.write(0, k, v, positions)
    return state.k[0], state.v[0]


@partial(jax.jit, donate_argnums=(0, 1))
def _copy_pages(
    k: tuple[KVPages, ...], v: tuple[KVPages, ...], src: Array, dst: Array
) -> tuple[tuple[KVPages, ...], tuple[KVPages, ...]]:
    """Copy page ``src[i]`` to ``dst[i]`` in every layer (out-of-range ``dst`` entries are skipped)."""

    def copy(leaf: Array) -> Array:
        return leaf.at[:, dst].set(jnp.take(leaf, src, axis=1, mode="clip"), mode="drop")

    return jax.tree_util.tree_map(copy, k), jax.tree_util.tree_map(copy, v)


@partial(jax.jit, static_argnames=("kv_dtype", "dtype"))
def _view(
    k_pages: KVPages, v_pages: KVPages, tables: Array, calibration: KeyCalibration | None, kv_dtype: str, dtype: str
) -> tuple[Array, Array]:
    view = PagedKVState((k_pages,), (v_pages,), tables, kv_dtype, dtype, _one_layer(calibration)).layer_view(0)
    return view.k, view.v


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# -- host side -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedConfig:
    """Shape and storage format of a paged cache."""

    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    kv_dtype: str = "bf16"
    dtype: str = "float32"  # dtype of read-back views (``get``, ``layer_view``)
    # Per-layer key statistics the coded formats (q4, q3) code keys with (see calibrate_keys).
    key_calibration: tuple[KeyCalibration, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"PagedConfig.{name} must be positive, got {getattr(self, name)}")
        check_kv_dtype(self.kv_dtype, self.head_dim)
        _device_calibration(self.key_calibration, self.num_layers, self.kv_heads, self.head_dim)  # checks shapes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers (K and V)."""
        return self.num_layers * bytes_per_token_per_layer(self.kv_dtype, self.kv_heads, self.head_dim, self.page_size)


class PageStore:
    """The device pages of every layer, shared by all caches and states drawn from one pool.

    A compiled plan donates the state it is given, which invalidates these arrays: while a
    :class:`PagedBackend` state is out, the store is *checked out* and host-side caches on it refuse
    to touch the pages until the state comes back through ``PagedBackend.release``.
    """

    def __init__(self, config: PagedConfig, pool: BlockPool) -> None:
        if pool.page_size != config.page_size:
            raise ConfigError(f"pool page_size {pool.page_size} differs from the config's {config.page_size}")
        self.config = config
        self.pool = pool
        self.k: tuple[KVPages, ...] = ()
        self.v: tuple[KVPages, ...] = ()
        self.reset_pages()
        self.checked_out = False

    def reset_pages(self) -> None:
        """Fresh zeroed pages for every layer (the pool's bookkeeping is untouched)."""
        c = self.config
        n = self.pool.num_blocks
        self.k = tuple(empty_pages(c.kv_dtype, c.kv_heads, n, c.page_size, c.head_dim) for _ in range(c.num_layers))
        self.v = tuple(empty_pages(c.kv_dtype, c.kv_heads, n, c.page_size, c.head_dim) for _ in range(c.num_layers))

    @property
    def nbytes(self) -> int:
        """Device bytes of all pages (K and V, every layer)."""
        leaves = jax.tree_util.tree_leaves((self.k, self.v))
        return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)

    def ensure_available(self) -> None:
        if self.checked_out:
            raise CacheError(
                "the page store is checked out to a PagedBackend state (a compiled plan owns its pages); "
                "release that state with PagedBackend.release before using host caches on this pool"
            )

    def state(self, block_tables: np.ndarray) -> PagedKVState:
        c = self.config
        calibration = _device_calibration(c.key_calibration, c.num_layers, c.kv_heads, c.head_dim)
        return PagedKVState(self.k, self.v, jnp.asarray(block_tables, jnp.int32), c.kv_dtype, c.dtype, calibration)

    def _layer_calibration(self, layer: int) -> KeyCalibration | None:
        calibration = self.config.key_calibration
        return None if calibration is None else calibration[layer]

    def write(self, layer: int, k: Array, v: Array, tables: np.ndarray, positions: np.ndarray) -> None:
        """Write ``k, v [B, n, KVH, D]`` at ``positions [B, n]`` (``-1`` = skip); pads n to a power of two."""
        self.ensure_available()
        n = k.shape[1]
        t = _bucket(n)
        pos = np.full((k.shape[0], t), -1, np.int32)
        pos[:, :n] = positions
        pad = ((0, 0), (0, t - n), (0, 0), (0, 0))
        new_k, new_v = _write_layer(
            self.k[layer], self.v[layer], jnp.pad(k, pad), jnp.pad(v, pad), jnp.asarray(tables), jnp.asarray(pos),
            self._layer_calibration(layer), kv_dtype=self.config.kv_dtype,
        )
        self.k = replace_layer(self.k, layer, new_k)
        self.v = replace_layer(self.v, layer, new_v)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int], width: int) -> None:
        """Copy pages ``src[i] -> dst[i]`` in every layer (padded to ``width`` entries to bound compiles)."""
        self.ensure_available()
        if not src:
            return
        s = np.zeros(max(width, len(src)), np.int32)
        d = np.full(max(width, len(src)), self.pool.num_blocks, np.int32)
        s[: len(src)], d[: len(dst)] = src, dst
        self.k, self.v = _copy_pages(self.k, self.v, jnp.asarray(s), jnp.asarray(d))

    def view(self, layer: int, tables: np.ndarray) -> tuple[Array, Array]:
        self.ensure_available()
        c = self.config
        return _view(
            self.k[layer], self.v[layer], jnp.asarray(tables, jnp.int32), self._layer_calibration(layer),
            kv_dtype=c.kv_dtype, dtype=c.dtype,
        )


class PagedKVCache:
    """Host handle (``CacheProvider``) of a paged cache: one shared length for the batch, blocks on demand.

    Blocks are taken from the store's pool as the sequences grow (all rows at once, all-or-nothing),
    shared by :meth:`fork` (O(pages) of metadata: reference counts and a table copy) and copied on
    write: a write into a block with other owners first moves this cache to a private copy (only the
    block holding the current end can be partly filled, so at most one copy per row). :meth:`truncate`
    keeps the first ``n`` tokens bit-exactly and frees the blocks past them.
    """

    def __init__(self, store: PageStore, batch: int, max_seq_len: int) -> None:
        if batch <= 0 or max_seq_len <= 0:
            raise ConfigError(f"batch ({batch}) and max_seq_len ({max_seq_len}) must be positive")
        self._store = store
        self._batch = batch
        self._table = np.full((batch, blocks_for(max_seq_len, store.config.page_size)), -1, np.int32)
        self._seq_len = 0
        self._released = False

    @classmethod
    def create(
        cls,
        num_layers: int,
        batch: int,
        max_seq_len: int,
        kv_heads: int,
        head_dim: int,
        *,
        page_size: int = 16,
        kv_dtype: str = "fp32",
        num_blocks: int | None = None,
        max_memory_mb: float | None = None,
        dtype: str = "float32",
    ) -> PagedKVCache:
        """A cache on a fresh pool of ``num_blocks`` blocks, or as many as ``max_memory_mb`` holds
        (default: exactly enough for ``batch`` sequences of ``max_seq_len``)."""
        config = PagedConfig(num_layers, kv_heads, head_dim, page_size, kv_dtype, dtype)
        if max_memory_mb is not None:
            pool = BlockPool.from_memory_budget(
                max_memory_mb, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                page_size=page_size, kv_dtype=kv_dtype,
            )
        else:
            pool = BlockPool(num_blocks or batch * blocks_for(max_seq_len, page_size), page_size)
        return cls(PageStore(config, pool), batch, max_seq_len)

    # -- CacheProvider surface ------------------------------------------------------------------

    @property
    def state(self) -> PagedKVState:
        """The device state over this cache's block table (the store's current pages)."""
        self._store.ensure_available()
        return self._store.state(self._table)

    @property
    def num_layers(self) -> int:
        return self._store.config.num_layers

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def capacity(self) -> int:
        return self._table.shape[1] * self._store.config.page_size

    @property
    def store(self) -> PageStore:
        return self._store

    @property
    def pool(self) -> BlockPool:
        return self._store.pool

    @property
    def block_table(self) -> np.ndarray:
        """A copy of the ``[batch, pages_per_seq]`` table (``-1`` = no block)."""
        return self._table.copy()

    def owned_blocks(self) -> list[int]:
        """Every block this cache holds a reference on (one per table entry)."""
        return [int(b) for b in self._table[self._table >= 0]]

    def update(self, layer: int, k: Float[Array, "B T KVH D"], v: Float[Array, "B T KVH D"]) -> None:
        """Append K/V for ``layer`` at the current end; the length advances after the last layer."""
        self._check_live()
        c = self._store.config
        if not 0 <= layer < c.num_layers:
            raise CacheError(f"layer {layer} outside [0, {c.num_layers})")
        expected = (self._batch, k.shape[1], c.kv_heads, c.head_dim)
        if k.ndim != 4 or tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise CacheError(
                f"update takes k and v shaped [batch={self._batch}, new, kv_heads={c.kv_heads}, head_dim={c.head_dim}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        n = k.shape[1]
        start, end = self._seq_len, self._seq_len + n
        if end > self.capacity:
            raise CacheError(
                f"cannot append {n} tokens to a cache holding {start} of {self.capacity}; "
                "create the cache with a larger max_seq_len"
            )
        if n == 0:
            return
        self._make_writable(start, end)
        positions = np.broadcast_to(np.arange(start, end, dtype=np.int32), (self._batch, n))
        self._store.write(layer, k, v, self._table, positions)
        if layer == c.num_layers - 1:
            self._seq_len = end

    def get(self, layer: int) -> LayerKV:
        """K/V of ``layer`` for positions ``[0, seq_len)``, dequantized to the config's view dtype."""
        self._check_live()
        if not 0 <= layer < self.num_layers:
            raise CacheError(f"layer {layer} outside [0, {self.num_layers})")
        k, v = self._store.view(layer, self._table)
        return LayerKV(k[:, : self._seq_len], v[:, : self._seq_len])

    def reset(self) -> None:
        """Forget every token and give all blocks back (to the pool, or to their other owners)."""
        owned = self.owned_blocks()
        self._table[:] = -1
        self._seq_len = 0
        self._store.pool.free(owned)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens exactly; blocks wholly past them are freed."""
        self._check_live()
        if not 0 <= n <= self._seq_len:
            raise CacheError(f"cannot truncate a cache of {self._seq_len} tokens to {n}; n must be in [0, seq_len]")
        keep = blocks_for(n, self._store.config.page_size)
        dropped = self._table[:, keep:]
        freed = [int(b) for b in dropped[dropped >= 0]]
        self._table[:, keep:] = -1
        self._seq_len = n
        self._store.pool.free(freed)
        self._mark_filled()

    def fork(self) -> PagedKVCache:
        """A second cache over the same tokens: shares every block (reference counts), copies nothing."""
        self._check_live()
        twin = PagedKVCache.__new__(PagedKVCache)
        twin._store, twin._batch, twin._seq_len, twin._released = self._store, self._batch, self._seq_len, False
        twin._table = self._table.copy()
        self._store.pool.share(self.owned_blocks())
        return twin

    def release(self) -> None:
        """Give every block back and make this handle unusable (``reset`` keeps it usable)."""
        if not self._released:
            self.reset()
            self._released = True

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more tokens in every row and count them as stored.

        For writers that fill the pages themselves (an engine's compiled step writes through
        :attr:`state`): blocks are allocated all-or-nothing and shared blocks copied on write, exactly
        as :meth:`update` does; follow with :meth:`truncate` if fewer tokens were written.
        """
        self._check_live()
        start, end = self._seq_len, self._seq_len + n
        if n < 0 or end > self.capacity:
            raise CacheError(f"cannot reserve {n} tokens after {start} in a cache of capacity {self.capacity}")
        self._make_writable(start, end)
        self._seq_len = end

    def drop_blocks(self, indices: Sequence[int]) -> int:
        """Give back the blocks at table positions ``indices`` (in every row); their entries become -1.

        The tokens they held are gone: the caller must keep them out of attention (a page mask).
        Returns how many table entries were dropped.
        """
        self._check_live()
        if any(not 0 <= i < self._table.shape[1] for i in indices):
            raise CacheError(f"block indices {list(indices)} outside [0, {self._table.shape[1]})")
        entries = self._table[:, list(indices)]
        held = [int(b) for b in entries[entries >= 0]]
        self._table[:, list(indices)] = -1
        self._store.pool.free(held)
        return len(held)

    def inject_blocks(self, blocks: Sequence[Sequence[int]], n_tokens: int) -> None:
        """Start from cached blocks: row ``r`` reads ``blocks[r]`` (shared, not copied) for ``n_tokens`` tokens.

        The cache must be empty. Every row needs ``ceil(n_tokens / page_size)`` blocks (the length is
        shared by the batch); a partly used last block is copied on the first write into it. A ``-1``
        entry stands for a dropped block (see :meth:`drop_blocks`).
        """
        self._check_live()
        ps = self._store.config.page_size
        if self._seq_len or (self._table >= 0).any():
            raise CacheError("inject_blocks needs an empty cache; call reset() first")
        need = blocks_for(n_tokens, ps)
        if len(blocks) != self._batch or any(len(row) != need for row in blocks):
            raise CacheError(
                f"inject_blocks needs {self._batch} rows of ceil({n_tokens}/{ps}) = {need} blocks, "
                f"got rows of {[len(r) for r in blocks]}"
            )
        if n_tokens > self.capacity:
            raise CacheError(f"{n_tokens} tokens do not fit this cache's capacity {self.capacity}")
        flat = [int(b) for row in blocks for b in row if b >= 0]  # -1: a dropped (masked) block
        self._store.pool.share(flat)  # raises (and changes nothing) on a free or foreign block
        for r, row in enumerate(blocks):
            self._table[r, :need] = row
        self._seq_len = n_tokens

    # -- internals ----------------------------------------------------------------------------------

    def _check_live(self) -> None:
        if self._released:
            raise CacheError("this PagedKVCache was released; create or fork a new one")

    def _make_writable(self, start: int, end: int) -> None:
        """Give this cache private blocks for positions ``[start, end)`` in every row, all-or-nothing."""
        pool, ps = self._store.pool, self._store.config.page_size
        first, last = start // ps, blocks_for(end, ps)
        need: list[tuple[int, int, int]] = []  # (row, index, old block or -1)
        for r in range(self._batch):
            for i in range(first, last):
                b = int(self._table[r, i])
                if b < 0 or pool.refcount(b) > 1:
                    need.append((r, i, b))
        if not need:
            return
        fresh = pool.allocate(len(need))  # PoolExhaustedError here leaves everything as it was
        src, dst, old = [], [], []
        for (r, i, b), f in zip(need, fresh, strict=True):
            if b >= 0:
                old.append(b)
                if i * ps < start:  # the block holds kept tokens: copy them over
                    src.append(b)
                    dst.append(f)
                    pool.mark_filled(f, start - i * ps)
            self._table[r, i] = f
        self._store.copy_pages(src, dst, width=self._batch)
        pool.free(old)
        for i in range(first, last):
            for r in range(self._batch):
                pool.mark_filled(int(self._table[r, i]), min(ps, end - i * ps))

    def _mark_filled(self) -> None:
        pool, ps = self._store.pool, self._store.config.page_size
        last = blocks_for(self._seq_len, ps) - 1
        if last >= 0:
            for b in self._table[:, last]:
                if b >= 0 and pool.refcount(int(b)) == 1:
                    pool.mark_filled(int(b), self._seq_len - last * ps)


class PagedBackend:
    """The generator's ``CacheBackend`` over a block pool, with optional prefix reuse.

    ``allocate`` takes ``ceil(capacity / page_size)`` blocks per row (all-or-nothing; when the pool is
    short it first evicts unused prefix-cache entries, and only if that is enough) and returns a
    :class:`PagedKVState` holding the store's pages. One state is out at a time: the compiled plan
    donates it, so the store's own arrays are dead until ``release`` hands the plan's final state back
    (pass the state the plan *returned*, not the one given to it).

    The prefix cache has one level here, the device pool; :class:`~zgen.cache.tiered.TieredPagedBackend`
    adds host RAM and disk below it through :meth:`_restore_prefix` and the tree's ``on_evict``.
    """

    def __init__(self, config: PagedConfig, pool: BlockPool, *, prefix_cache: bool = True, max_prefix_blocks: int | None = None) -> None:
        self.config = config
        self.store = PageStore(config, pool)
        self.pool = pool
        self.radix: RadixCache | None = RadixCache(pool, max_blocks=max_prefix_blocks) if prefix_cache else None
        self._lease: np.ndarray | None = None

    @classmethod
    def from_memory_budget(
        cls,
        max_memory_mb: float,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        page_size: int = 16,
        kv_dtype: str = "bf16",
        dtype: str = "float32",
        prefix_cache: bool = True,
    ) -> PagedBackend:
        config = PagedConfig(num_layers, kv_heads, head_dim, page_size, kv_dtype, dtype)
        pool = BlockPool.from_memory_budget(
            max_memory_mb, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, kv_dtype=kv_dtype
        )
        return cls(config, pool, prefix_cache=prefix_cache)

    def allocate(self, batch: int, capacity: int) -> PagedKVState:
        """A state with room for positions ``[0, capacity)`` in each of ``batch`` rows."""
        state, _ = self._allocate([[] for _ in range(batch)], capacity, use_prefix=False)
        return state

    def allocate_with_prefix(self, prompts: Sequence[Sequence[int]], capacity: int) -> tuple[PagedKVState, list[int]]:
        """Like ``allocate``, reusing cached full blocks of each prompt (shared, not copied).

        Returns the state and, per row, how many leading prompt tokens are already in it: a multiple of
        ``page_size`` and at most ``len(prompt) - 1`` (the last prompt token must be fed to get logits).
        Prefill each row from that offset.
        """
        if any(len(p) == 0 for p in prompts):
            raise CacheError("allocate_with_prefix needs non-empty prompts")
        return self._allocate(prompts, capacity, use_prefix=self.radix is not None)

    def commit_prefix(self, state: PagedKVState, row: int, tokens: Sequence[int]) -> int:
        """Insert row ``row``'s full blocks holding ``tokens`` into the prefix cache; returns blocks added.

        Every token in ``tokens`` must have had its K/V written (the prompt, plus generated tokens that
        were fed back). Call before ``release``; the tree then keeps its own reference on the blocks.
        """
        table = self._check_lease(state)
        if self.radix is None:
            return 0
        if not 0 <= row < table.shape[0]:
            raise CacheError(f"row {row} outside [0, {table.shape[0]})")
        ps = self.config.page_size
        n = min(len(tokens) // ps, table.shape[1])
        for b in table[row, :n]:
            self.pool.mark_filled(int(b), ps)
        return self.radix.insert(list(tokens[: n * ps]), [int(b) for b in table[row, :n]])

    def release(self, state: PagedKVState) -> None:
        """Take the pages back from ``state`` and free the blocks ``allocate`` took."""
        table = self._check_lease(state)
        expected = jax.tree_util.tree_structure((self.store.k, self.store.v))
        if jax.tree_util.tree_structure((state.k, state.v)) != expected:
            raise CacheError("release got a state of a different paged layout than this backend's")
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(state)):
            # The pages were donated to a plan that did not hand them back (an error mid-run, or the
            # caller passed the state it gave the plan instead of the one returned). The blocks are
            # still freed and the backend stays usable, but every page's contents are gone: start
            # from zeroed pages and drop the prefix cache, whose blocks pointed into them.
            warnings.warn(
                "PagedBackend.release got a state whose buffers were donated; the KV pages (and the prefix "
                "cache) are lost. Pass the state the compiled plan returned to keep them.",
                RuntimeWarning,
                stacklevel=2,
            )
            self.store.checked_out = False
            self._lease = None
            self.pool.free([int(b) for b in table.reshape(-1)])
            if self.radix is not None:
                self.radix.clear()  # before the pages are replaced: an on_evict handler must not read zeros
            self.store.reset_pages()
            return
        self.store.k, self.store.v = tuple(state.k), tuple(state.v)
        self.store.checked_out = False
        self._lease = None
        self.pool.free([int(b) for b in table.reshape(-1)])

    # -- internals ----------------------------------------------------------------------------------

    def _check_lease(self, state: PagedKVState) -> np.ndarray:
        if self._lease is None:
            raise CacheError("this backend has no state out: it was already released (or came from another backend)")
        if state.block_tables.is_deleted():
            table = self._lease  # a donated state: its table was ours (release recovers, see there)
        else:
            table = np.asarray(state.block_tables)
        if table.shape != self._lease.shape or not np.array_equal(table, self._lease):
            raise CacheError("this state's block table is not the one this backend handed out; pass the state allocate returned (or its successor)")
        return self._lease

    def _allocate(self, prompts: Sequence[Sequence[int]], capacity: int, *, use_prefix: bool) -> tuple[PagedKVState, list[int]]:
        if self._lease is not None:
            raise CacheError(
                "a PagedBackend serves one batch at a time and its previous state is still out; "
                "release it (after commit_prefix, if wanted) before allocating again"
            )
        batch = len(prompts)
        if batch <= 0 or capacity <= 0:
            raise CacheError(f"allocate needs batch > 0 and capacity > 0, got batch={batch}, capacity={capacity}")
        ps = self.config.page_size
        pps = blocks_for(capacity, ps)
        reused: list[list[int]] = []  # per row: the cached prompt blocks it holds a reference on
        try:
            for p in prompts:
                row: list[int] = []
                reused.append(row)
                if use_prefix and self.radix is not None:
                    tokens = list(p[: min(len(p) - 1, pps * ps)])
                    matched, _ = self.radix.match(tokens)
                    self.pool.share(matched)  # now in use: eviction below cannot take them
                    row.extend(matched)
                    row.extend(self._restore_prefix(tokens, matched))
            fresh = self._take(batch * pps - sum(len(row) for row in reused))
        except BaseException:
            self.pool.free([b for row in reused for b in row])
            raise
        table = np.empty((batch, pps), np.int32)
        it = iter(fresh)
        for r, row in enumerate(reused):
            table[r, : len(row)] = row
            for i in range(len(row), pps):
                b = next(it)
                table[r, i] = b
                self.pool.mark_filled(b, min(ps, capacity - i * ps))
        self._lease = table
        state = self.store.state(table)
        self.store.checked_out = True
        return state, [len(row) * ps for row in reused]

    def _restore_prefix(self, tokens: Sequence[int], cached: list[int]) -> list[int]:
        """Blocks continuing ``cached`` (the device prefix-cache hit on ``tokens``) that a lower cache level
        brings back: freshly allocated, owned by the caller, already in the prefix cache. None here: the
        device pool is this backend's only level."""
        del tokens, cached
        return []

    def _take(self, n: int) -> list[int]:
        short = n - self.pool.num_free
        if short > 0 and self.radix is not None and self.radix.evictable_blocks() >= short:
            self.radix.evict(short)
        return self.pool.allocate(n)
