"""The paged KV cache's device state: page pools of every layer plus the block tables of a batch.

Per layer the state holds the whole pool of K and V pages ``[kv_heads, num_pages, page_size, ...]`` in
the storage format ``kv_dtype`` (:mod:`zgen.cache.formats`), plus ``block_tables [batch, pages_per_seq]``
(page id of each sequence's i-th block, ``-1`` where none is allocated). Token at position ``p`` of row
``b`` lives in page ``block_tables[b, p // page_size]`` at offset ``p % page_size``; the visibility rule
is the dense one (key at ``j`` visible to a query at ``p`` iff ``j <= p`` and ``j > p - window``).

Writes quantize each token as it is stored; attention -- decode, verification and prefill chunks
alike -- hands the stored pages to :func:`zgen.pallas.paged_attention`, which reads only the pages each
query can see and dequantizes them inside the kernel; long prefill chunks on the GPU gather their rows'
pages into a transient full-precision copy once per layer instead (see
:mod:`zgen.pallas.paged_attention.gathered`).

Coded formats (q4, q3) code what they store, KVQuant-style:

* keys are centred on per-channel calibration means of keys *before* RoPE, rotated to the key's
  position (``k - rope(mean, pos) = rope(k_pre - mean, pos)``: pre-RoPE, a key's large channels sit
  in the same place token after token, so fixed per-channel statistics fit them; the key at
  position 0, the attention sink, has its own mean), scaled per RoPE pair by a Fisher-information
  proxy and rotated by an orthonormal Hadamard matrix (a
  :class:`~zgen.pallas.paged_attention.layouts.KeyCalibration` per layer, fitted by
  :func:`zgen.runtime.calibration.calibrate_keys`). The attention kernels never decode them: the
  coding folds into the query;
* values are Hadamard-rotated; attention runs in the rotated basis and the output is rotated back.

Measured on SmolLM2-135M (``benchmarks/kv_quality.py``; method and table in ``docs/kv_quantization.md``):
fp16/bf16 +0.00 % perplexity, fp8 +0.31 %, q4 +1.31 %, q3 +4.80 %; without a calibration q4 +3.64 %,
q3 +17.4 %.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from zgen.cache.base import LayerKV, replace_layer
from zgen.cache.formats import empty_pages, kv_format
from zgen.cache.tensor import masked_attention
from zgen.errors import ConfigError
from zgen.pallas import paged_attention
from zgen.pallas.paged_attention import append_and_attend
from zgen.pallas.paged_attention.api import appends_to, default_implementation
from zgen.pallas.page_write import write_kv
from zgen.pallas.paged_attention.layouts import (
    KeyCalibration,
    KVPages,
    gather_sequences,
    hadamard,
    hadamard_dot,
    head_dim_of,
)
from zgen.rope import rotary
from zgen.shapes import cdiv


def _num_pages(pages: KVPages) -> int:
    return jax.tree_util.tree_leaves(pages)[0].shape[1]


def _page_size(pages: KVPages) -> int:
    return jax.tree_util.tree_leaves(pages)[0].shape[2]


@dataclass(frozen=True)
class PagedKVState:
    """Per-layer K/V page pools plus the block tables of the batch (a pytree; ``kv_dtype`` and the
    view ``dtype`` are static).

    ``capacity`` is ``pages_per_seq * page_size``. Writes to positions outside ``[0, capacity)`` or to
    blocks the table does not name (``-1``) are dropped, like the dense state's out-of-range writes.
    ``key_calibration`` (one :class:`KeyCalibration` per layer) is what
    the coded formats (q4, q3) code keys with; ``None`` codes them with the Hadamard rotation alone.
    """

    k: tuple[KVPages, ...]
    v: tuple[KVPages, ...]
    block_tables: Int[Array, "B P"]
    kv_dtype: str = "fp32"
    dtype: str = "float32"  # dtype of layer_view (and of dequantized prefill keys if the query's is wider)
    key_calibration: tuple[KeyCalibration, ...] | None = None
    attention: str | None = None  # the paged_attention implementation; None: the best for the platform

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

        A paged state with no pool and no sharing, for tests and for reading one row's pages as a
        dense cache would hold them.
        """
        if capacity <= 0 or batch <= 0:
            raise ConfigError(f"batch ({batch}) and capacity ({capacity}) must be positive")
        pps = cdiv(capacity, page_size)
        pages = [empty_pages(kv_dtype, kv_heads, batch * pps, page_size, head_dim) for _ in range(2 * num_layers)]
        table = jnp.arange(batch * pps, dtype=jnp.int32).reshape(batch, pps)
        calibration = device_calibration(key_calibration, num_layers, kv_heads, head_dim)
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

    def _key_coding(self, layer: int) -> KeyCalibration | None:
        """The layer's key calibration in a coded format (the identity one if none was given), else None."""
        if not kv_format(self.kv_dtype).coded:
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
        """Code (coded formats), quantize (if the format asks) and store each token into its (page, offset).

        On CPU the pool's bfloat16 and fp8 leaves are integer containers (see
        :func:`~zgen.cache.formats.empty_pages`, written in place); the tokens are bitcast to match.
        """
        ps, pps = self.page_size, self.pages_per_seq
        positions = positions.astype(jnp.int32)
        index = jnp.clip(positions // ps, 0, pps - 1)
        page = jnp.take_along_axis(self.block_tables, index, axis=1)
        ok = (positions >= 0) & (positions < pps * ps) & (page >= 0)
        page = jnp.where(ok, page, self.num_pages)  # out of bounds: the write drops it
        new_k, new_v = write_kv(
            self.k[layer],
            self.v[layer],
            k,
            v,
            page,
            positions % ps,
            positions,
            quantize=kv_format(self.kv_dtype).quantize,
            key_coding=self._key_coding(layer),
        )
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
            implementation=self.attention,
        )
        return out if coding is None else hadamard_dot(out).astype(q.dtype)

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        *,
        inv_freq: Float[Array, " half"],
        sliding_window: int | None,
    ) -> tuple[Float[Array, "B T H D"], PagedKVState]:
        """RoPE on ``q`` and ``k``, :meth:`write`, then :meth:`attend`; a decode step over plain float
        or fp8 pages on the Triton kernels is one kernel that also stores the token in its page
        (:func:`zgen.pallas.paged_attention.append_and_attend`: the rotations, the page write and the
        split merge are launches fewer per layer)."""
        k_pages, v_pages = self.k[layer], self.v[layer]
        implementation = self.attention or default_implementation(k_pages, page_mask_given=False, window=sliding_window)
        one_kernel = q.shape[1] == 1 and implementation == "triton" and appends_to(k_pages)
        if not one_kernel:
            q, k = rotary(q, positions, inv_freq), rotary(k, positions, inv_freq)
            state = self.write(layer, k, v, positions)
            return state.attend(layer, q, positions, sliding_window=sliding_window), state
        out, new_k, new_v = append_and_attend(
            q, k, v, k_pages, v_pages, self.block_tables, positions, inv_freq=inv_freq, sliding_window=sliding_window,
            implementation="triton",
        )
        return out, replace(self, k=replace_layer(self.k, layer, new_k), v=replace_layer(self.v, layer, new_v))

    def select(self, layer: int) -> PagedKVState:
        """A one-layer state holding ``layer`` (no copy: the same arrays)."""
        calibration = None if self.key_calibration is None else (self.key_calibration[layer],)
        return replace(self, k=(self.k[layer],), v=(self.v[layer],), key_calibration=calibration)

    def merge(self, layer: int, one: PagedKVState) -> PagedKVState:
        """This state with ``layer``'s pages taken from the one-layer state ``one`` (see :meth:`select`)."""
        return replace(self, k=replace_layer(self.k, layer, one.k[0]), v=replace_layer(self.v, layer, one.v[0]))

    def head_specs(self, axis: str) -> PagedKVState:
        """This state's pytree with a ``PartitionSpec`` per leaf, splitting KV heads over mesh axis
        ``axis``: page leaves and calibration statistics lead with them; the block tables and the
        RoPE frequencies are shared."""
        heads, shared = PartitionSpec(axis), PartitionSpec()

        def split(tree: Any) -> Any:
            return jax.tree_util.tree_map(lambda _: heads, tree)

        calibration = None if self.key_calibration is None else tuple(replace(split(c), inv_freq=shared) for c in self.key_calibration)
        return replace(self, k=split(self.k), v=split(self.v), block_tables=shared, key_calibration=calibration)

    def layer_view(self, layer: int) -> LayerKV:
        """All ``capacity`` slots of every row, dequantized (and decoded) to ``dtype`` (tests and
        inspection only): keys as they were written (after RoPE)."""
        dtype = jnp.dtype(self.dtype)
        k = gather_sequences(self.k[layer], self.block_tables, dtype)
        v = gather_sequences(self.v[layer], self.block_tables, dtype)
        coding = self._key_coding(layer)
        if coding is not None:
            k = coding.decode(k, jnp.arange(k.shape[1])[None, :, None], head_axis=-2).astype(dtype)
            v = hadamard(v).astype(dtype)
        return LayerKV(k, v)


jax.tree_util.register_dataclass(
    PagedKVState, data_fields=["k", "v", "block_tables", "key_calibration"], meta_fields=["kv_dtype", "dtype", "attention"]
)


def _heads_and_dim(pages: KVPages) -> tuple[int, int]:
    return jax.tree_util.tree_leaves(pages)[0].shape[0], head_dim_of(pages)


def device_calibration(
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


@dataclass(frozen=True)
class MaskedPagedState:
    """A paged state plus the visibility masks of its rows (contexts that mask tokens or override the
    causal rule). Each mask is optional, and ``None`` is not traced:

    * ``page_mask [B, P]`` — pages that may be read (``False`` for dropped pages, whose table entry is
      ``-1``, and for pages whose every token is masked). Attention still runs the paged kernel.
    * ``token_mask [B, P * page_size]`` — token slots that may be read (masks that cut through a page).
    * ``query_mask [B, T, P * page_size]`` — a per-query override of the causal rule; token and page
      masks still apply.

    With only a page mask, attention is the paged kernel's; token and query masks attend over a
    dequantized gather of the rows' pages (:func:`~zgen.cache.tensor.masked_attention`).
    """

    pages: PagedKVState
    page_mask: Bool[Array, "B P"] | None = None
    token_mask: Bool[Array, "B S"] | None = None
    query_mask: Bool[Array, "B T S"] | None = None

    @property
    def capacity(self) -> int:
        return self.pages.capacity

    def write(
        self,
        layer: int,
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
    ) -> Self:
        return replace(self, pages=self.pages.write(layer, k, v, positions))

    def attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        positions: Int[Array, "B T"],
        *,
        sliding_window: int | None,
    ) -> Float[Array, "B T H D"]:
        if self.token_mask is None and self.query_mask is None:
            return self.pages.attend(layer, q, positions, sliding_window=sliding_window, page_mask=self.page_mask)
        view = self.pages.layer_view(layer)  # [B, S, KVH, D], dequantized and decoded
        slots = jnp.arange(view.k.shape[1])[None, None, :]
        pos = positions.astype(jnp.int32)[:, :, None]
        mask = slots <= pos if self.query_mask is None else self.query_mask & (slots < self.capacity)
        if sliding_window is not None:
            mask &= pos - slots < sliding_window
        mask &= pos >= 0  # padding queries see nothing (their outputs are never used)
        if self.token_mask is not None:
            mask &= self.token_mask[:, None, :]
        if self.page_mask is not None:
            mask &= jnp.repeat(self.page_mask, self.pages.page_size, axis=1)[:, None, :]
        return masked_attention(q, view.k.astype(q.dtype), view.v.astype(q.dtype), mask)

    def select(self, layer: int) -> MaskedPagedState:
        """A one-layer state holding ``layer`` (the masks are every layer's)."""
        return replace(self, pages=self.pages.select(layer))

    def merge(self, layer: int, one: MaskedPagedState) -> MaskedPagedState:
        return replace(self, pages=self.pages.merge(layer, one.pages))

    def head_specs(self, axis: str) -> MaskedPagedState:
        """As :meth:`PagedKVState.head_specs`; the masks are shared."""
        masks = {name: None if getattr(self, name) is None else PartitionSpec() for name in ("page_mask", "token_mask", "query_mask")}
        return replace(self, pages=self.pages.head_specs(axis), **masks)

    def layer_view(self, layer: int) -> LayerKV:
        return self.pages.layer_view(layer)


jax.tree_util.register_dataclass(
    MaskedPagedState, data_fields=["pages", "page_mask", "token_mask", "query_mask"], meta_fields=[]
)
