"""The device state an engine step runs on: the shared paged pool plus per-row visibility masks.

Contexts mask tokens (attention sinks, sliding windows, pruned branches) and drop pages that are wholly
masked. :class:`ContextKVState` wraps a :class:`~zgen.cache.paged.PagedKVState` (every context's pages
in one pool, one block-table row per batch row) with three optional masks, each a static choice of the
compiled step (``None`` = not traced):

* ``page_mask [B, P]`` — pages that may be read (``False`` for dropped pages, whose table entry is
  ``-1``, and for pages whose every token is masked). Attention still runs the paged kernel.
* ``token_mask [B, P * page_size]`` — token slots that may be read (masks that cut through a page).
* ``query_mask [B, T, P * page_size]`` — a per-query override of the causal rule (``ForwardPass``'s
  ``attention_mask``); token and page masks still apply.

With every mask ``None`` the step is exactly the generator's paged attention.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zgen.cache.base import LayerKV
from zgen.cache.paged import PagedKVState
from zgen.pallas.common import masked_softmax_attention, resolve_scale, visible


@dataclass(frozen=True)
class ContextKVState:
    """A paged state plus the masks of the rows' contexts (see the module docstring)."""

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
        return self._masked_attention(layer, q, positions, sliding_window)

    def _masked_attention(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        positions: Int[Array, "B T"],
        sliding_window: int | None,
    ) -> Float[Array, "B T H D"]:
        """Attention over a dense gather of the rows' pages with every mask applied (f32 softmax)."""
        view = self.pages.layer_view(layer)  # [B, S, KVH, D], dequantized and decoded
        b, t, h, d = q.shape
        slots = jnp.arange(view.k.shape[1])
        pos = positions.astype(jnp.int32)[:, :, None]
        if self.query_mask is not None:
            mask = self.query_mask & (slots[None, None, :] < self.capacity)
            if sliding_window is not None:
                mask &= pos - slots[None, None, :] < sliding_window
        else:
            mask = visible(pos, slots[None, None, :], pos + 1, causal=True, window=sliding_window)
        mask &= (pos >= 0)  # padding queries see nothing (their outputs are never used)
        if self.token_mask is not None:
            mask &= self.token_mask[:, None, :]
        if self.page_mask is not None:
            mask &= jnp.repeat(self.page_mask, self.pages.page_size, axis=1)[:, None, :]
        kvh = view.k.shape[2]
        grouped = q.reshape(b, t, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4)  # [B, KVH, G, T, D]
        keys = view.k.transpose(0, 2, 1, 3)[:, :, None]  # [B, KVH, 1, S, D]
        values = view.v.transpose(0, 2, 1, 3)[:, :, None]
        out = masked_softmax_attention(
            grouped, keys, values, mask[:, None, None], scale=resolve_scale(d, None), cap=None
        )  # [B, KVH, G, T, D]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)

    def layer_view(self, layer: int) -> LayerKV:
        return self.pages.layer_view(layer)


jax.tree_util.register_dataclass(
    ContextKVState, data_fields=["pages", "page_mask", "token_mask", "query_mask"], meta_fields=[]
)
