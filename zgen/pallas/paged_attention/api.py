"""Attention over a paged (optionally quantized) KV cache: ``paged_attention`` for queries at any
positions (chunked prefill, verification, decode), ``paged_decode_attention`` for one new token per
sequence, ``append_and_attend`` for a decode step that also rotates and stores its token (plain pages)."""

from __future__ import annotations

from typing import Any, Callable, Literal, cast, get_args

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zgen.errors import ConfigError, InputError
from zgen.pallas.common import interpret_pallas, platform, resolve_scale
from zgen.pallas.paged_attention import gathered
from zgen.pallas.paged_attention.common import visible_pages
from zgen.pallas.paged_attention.layouts import (
    Fp8Pages,
    KeyCalibration,
    KVPages,
    float_pages,
    head_dim_of,
    leading_shape,
    quantize_fp8,
)
from zgen.rope import apply_rope


def _layout(pages: KVPages) -> type:
    """The layout class; plain arrays (concrete or traced) are one layout."""
    return jax.Array if isinstance(pages, jax.Array) else type(pages)


def _check(q: Array, k_pages: KVPages, v_pages: KVPages, block_tables: Array, q_positions: Array) -> None:
    b, t, h, d = q.shape
    kvh, _, _ = leading_shape(k_pages)
    if _layout(k_pages) is not _layout(v_pages) or leading_shape(v_pages) != leading_shape(k_pages):
        raise ValueError("k_pages and v_pages must share a layout and [kv_heads, num_pages, page_size]")
    if head_dim_of(k_pages) != d or head_dim_of(v_pages) != d:
        raise ValueError(f"page head_dim must equal the query's ({d})")
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} kv heads")
    if block_tables.shape[0] != b or q_positions.shape != (b, t):
        raise ValueError("block_tables [B, pages_per_seq] and q_positions [B, T] must match the queries [B, T, H, D]")


# "gathered": the rows' pages copied to one full-precision buffer, then flash attention (long chunks).
PagedImplementation = Literal["reference", "xla", "triton", "gathered", "mosaic_gpu", "mosaic_tpu"]
PAGED_IMPLEMENTATIONS: tuple[PagedImplementation, ...] = get_args(PagedImplementation)
# Backends that take any number of queries per sequence; the Mosaic ones are decode kernels.
_MULTI_QUERY = ("reference", "xla", "triton", "gathered")


def _check_implementation(implementation: str) -> PagedImplementation:
    if implementation not in PAGED_IMPLEMENTATIONS:
        raise ConfigError(
            f"unknown paged attention implementation {implementation!r}; choose one of {', '.join(PAGED_IMPLEMENTATIONS)} or None"
        )
    return implementation  # type: ignore[return-value]


def _backend(
    implementation: PagedImplementation, k_pages: KVPages, page_mask_given: bool, window: int | None, coded_keys: bool, num_queries: int
) -> Callable[..., Any]:
    """The backend, called as ``fn(q [B, T, H, D], k, v, tables, q_positions [B, T], pages, **options)``."""
    if implementation == "gathered" and page_mask_given:
        raise ConfigError(
            "implementation='gathered' cannot skip masked pages (a page_mask); "
            "use reference, xla or triton, or pass implementation=None to let zgen choose"
        )
    if coded_keys and implementation in ("mosaic_gpu", "mosaic_tpu"):
        raise ConfigError(
            f"implementation={implementation!r} cannot read coded keys (key_calibration); "
            "use reference, xla or triton, or pass implementation=None to let zgen choose"
        )
    if num_queries != 1 and implementation not in _MULTI_QUERY:
        raise ConfigError(
            f"implementation={implementation!r} is a decode kernel (one query per sequence), got {num_queries}; "
            "use reference, xla or triton, or pass implementation=None to let zgen choose"
        )
    if implementation == "reference":
        from zgen.pallas.paged_attention import reference

        return reference.paged_attention
    if implementation == "xla":
        from zgen.pallas.paged_attention import xla

        return xla.paged_attention
    if implementation == "triton":
        from zgen.pallas.paged_attention import triton

        return lambda *a, **kw: triton.paged_attention(*a, **kw, interpret=interpret_pallas())
    if implementation == "gathered":
        return gathered.paged_attention
    if implementation == "mosaic_gpu":
        from zgen.pallas.paged_attention import mosaic_gpu

        return _as_multi_query(mosaic_gpu.paged_decode_attention)
    if implementation == "mosaic_tpu":
        from zgen.pallas.paged_attention import mosaic_tpu

        if not mosaic_tpu.supports(k_pages, page_mask_given=page_mask_given, sliding_window=window):
            raise ConfigError(
                "implementation='mosaic_tpu' takes unquantized pages without page_mask or sliding_window; "
                "pass implementation=None to let zgen choose"
            )
        return _as_multi_query(lambda *a, **kw: mosaic_tpu.paged_decode_attention(*a, **kw, interpret=platform() != "tpu"))
    raise ConfigError(
        f"unknown paged attention implementation {implementation!r}; choose reference, xla, triton, "
        "mosaic_gpu, mosaic_tpu or None"
    )


def _as_multi_query(decode: Callable[..., Array]) -> Callable[..., Array]:
    """A decode kernel (``q [B, H, D]``, ``lengths``) called with one query per sequence at ``q_positions``."""

    def call(q: Array, k: KVPages, v: KVPages, tables: Array, q_positions: Array, pages: Array, **options: Any) -> Array:
        return decode(q[:, 0], k, v, tables, q_positions[:, 0] + 1, pages, **options)[:, None]

    return call


def default_implementation(
    k_pages: KVPages,
    page_mask_given: bool,
    window: int | None,
    coded_keys: bool = False,
    num_queries: int = 1,
    gathered_row_bytes: int | None = None,
) -> PagedImplementation:
    """Best implementation for the current platform that supports these pages and options
    (``gathered_row_bytes``: the size of one row's copy in the "gathered" backend, None if unknown)."""
    where = platform()
    if where == "gpu":
        if not page_mask_given and gathered_row_bytes is not None and gathered.fits(num_queries, gathered_row_bytes):
            return "gathered"
        # The Mosaic GPU kernel (bf16 pages only) stays opt-in: slower than Triton in the GPU runs.
        from zgen.pallas.paged_attention import triton

        return "triton" if triton.supports(k_pages) else "xla"
    if where == "tpu" and not coded_keys and num_queries == 1:
        from zgen.pallas.paged_attention import mosaic_tpu

        if mosaic_tpu.supports(k_pages, page_mask_given=page_mask_given, sliding_window=window):
            return "mosaic_tpu"
    return "xla"


def paged_attention(
    q: Float[Array, "b t h d"],
    k_pages: KVPages,
    v_pages: KVPages,
    block_tables: Int[Array, "b pages_per_seq"],
    q_positions: Int[Array, "b t"],
    *,
    page_mask: Bool[Array, "b pages_per_seq"] | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    key_calibration: KeyCalibration | None = None,
    implementation: str | None = None,
) -> Float[Array, "b t h d"]:
    """Causal attention of queries at given positions over their sequences' paged KV cache (grouped-query).

    A query at position ``p`` sees the keys at positions ``<= p`` (within ``sliding_window``) of its
    row's pages: the cache must already hold them, the query's own included. Serves chunked prefill
    (a chunk after a cached prefix), speculative verification and decode alike.

    Args:
      q: queries ``[B, T, H, D]``; query head ``h`` reads kv head ``h // (H // KVH)``.
      k_pages, v_pages: ``[KVH, num_pages, page_size, D]`` arrays, or a quantized layout from
        :mod:`zgen.pallas.paged_attention.layouts` (dequantized inside the kernel).
      block_tables: ``[B, pages_per_seq]`` page ids; pages no query can see, or masked, are never read.
      q_positions: ``[B, T]`` position of each query; negative positions are padding and give zeros.
      page_mask: optional ``[B, pages_per_seq]``; ``False`` pages (dropped or masked) are skipped.
      scale: logit scale, default ``D ** -0.5``.
      soft_cap: optional ``cap * tanh(logits / cap)`` after scaling.
      sliding_window: keep only keys within this many positions of the query (its own included).
      key_calibration: the coding the keys were stored with (:class:`KeyCalibration`: ``[KVH, D]``
        statistics and RoPE frequencies); a key's position is page index * page_size + offset.
        None: the stored keys are used as they are.
      implementation: None (best for the platform), "reference", "xla", "triton", "gathered" (the
        rows' pages dequantized into one buffer, then flash attention; no ``page_mask``; the GPU's
        choice for long query chunks, see :mod:`~zgen.pallas.paged_attention.gathered`), or one query per
        sequence only: "mosaic_gpu" (Hopper; bf16/f16 pages, page_size a multiple of 64), "mosaic_tpu".
    """
    _check(q, k_pages, v_pages, block_tables, q_positions)
    kvh, _, page_size = leading_shape(k_pages)
    if key_calibration is not None and (
        any(stat.shape != (kvh, q.shape[-1]) for stat in (key_calibration.center, key_calibration.sink, key_calibration.scale))
        or key_calibration.inv_freq.shape != (q.shape[-1] // 2,)
    ):
        raise InputError(
            f"key_calibration statistics must be [kv_heads, head_dim] = [{kvh}, {q.shape[-1]}] and its "
            f"inv_freq [head_dim / 2] = [{q.shape[-1] // 2}]"
        )
    coded_keys = key_calibration is not None
    num_queries = q.shape[1]
    row_bytes = gathered.gathered_bytes(1, block_tables.shape[1], k_pages, q.dtype)
    impl = (
        default_implementation(k_pages, page_mask is not None, sliding_window, coded_keys, num_queries, row_bytes)
        if implementation is None
        else _check_implementation(implementation)
    )
    q_positions = q_positions.astype(jnp.int32)
    pages = visible_pages(block_tables, q_positions, page_mask, page_size, sliding_window)
    # Invisible table entries may be stale or -1: point them at page 0 so no backend reads out of bounds.
    tables = jnp.where(pages, block_tables, 0).astype(jnp.int32)
    fn = _backend(impl, k_pages, page_mask is not None, sliding_window, coded_keys, num_queries)
    if impl not in ("reference", "xla", "gathered"):
        # The kernels read float leaves; the XLA paths bitcast only the pages they gather.
        k_pages, v_pages = float_pages(k_pages), float_pages(v_pages)
    # Only backends that can read coded keys get the argument, so the others keep their signatures.
    key_coding: dict[str, Any] = {} if key_calibration is None else {"key_calibration": key_calibration}
    return fn(
        q,
        k_pages,
        v_pages,
        tables,
        q_positions,
        pages,
        scale=resolve_scale(q.shape[-1], scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        **key_coding,
    )


def paged_decode_attention(
    q: Float[Array, "b h d"],
    k_pages: KVPages,
    v_pages: KVPages,
    block_tables: Int[Array, "b pages_per_seq"],
    lengths: Int[Array, " b"],
    *,
    page_mask: Bool[Array, "b pages_per_seq"] | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    key_calibration: KeyCalibration | None = None,
    implementation: str | None = None,
) -> Float[Array, "b h d"]:
    """Attention of one new token per sequence over its paged KV cache: :func:`paged_attention` with
    ``q [B, H, D]`` at position ``lengths[b] - 1`` (``lengths``: tokens in each sequence, the new
    one included). Sequences with no visible key (``lengths`` 0) return zeros."""
    if lengths.shape != q.shape[:1]:
        raise ValueError("lengths [B] must match the query batch")
    return paged_attention(
        q[:, None],
        k_pages,
        v_pages,
        block_tables,
        (lengths.astype(jnp.int32) - 1)[:, None],
        page_mask=page_mask,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        key_calibration=key_calibration,
        implementation=implementation,
    )[:, 0]


def appends_to(pages: KVPages) -> bool:
    """Pages :func:`append_and_attend` writes and reads: plain float arrays and fp8."""
    return isinstance(pages, Fp8Pages) or (isinstance(pages, jax.Array) and jnp.issubdtype(pages.dtype, jnp.floating))


def _appendable(pages: KVPages) -> Array | Fp8Pages:
    if not appends_to(pages):
        raise ConfigError(
            "append_and_attend takes plain float or fp8 pages; write other layouts with zgen.pallas.page_write.write_kv "
            "and read them with paged_attention"
        )
    return cast("Array | Fp8Pages", pages)


def append_and_attend(
    q: Float[Array, "b 1 h d"],
    k_new: Float[Array, "b 1 kvh d"],
    v_new: Float[Array, "b 1 kvh d"],
    k_pages: KVPages,
    v_pages: KVPages,
    block_tables: Int[Array, "b pages_per_seq"],
    positions: Int[Array, "b 1"],
    *,
    inv_freq: Float[Array, " half"] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[Float[Array, "b 1 h d"], KVPages, KVPages]:
    """One decode step over plain (float) or fp8 pages: rotate ``q`` and ``k_new`` (rotate-half RoPE with
    ``inv_freq`` at each row's position; none without it), store each row's key/value at its position
    (page ``block_tables[b, pos // page_size]``, offset ``pos % page_size``; a negative position, one
    past the table or an unallocated page (-1) stores nothing) and attend causally over its pages.

    Returns the attention output and the updated pools. On the GPU (``implementation`` None or
    "triton") one Triton kernel does it all, updating the pools in place, where RoPE, the page write,
    :func:`paged_attention` and its split merge are separate launches; "reference" is exactly those
    steps (fp8 tokens quantized as :func:`~zgen.pallas.paged_attention.layouts.quantize_fp8` does).
    Other quantized layouts are written by :func:`zgen.pallas.page_write.write_kv` and read by
    :func:`paged_attention`.
    """
    b, t, _, d = q.shape
    k_pages, v_pages = _appendable(k_pages), _appendable(v_pages)
    kvh, num_pages, page_size = leading_shape(k_pages)
    if t != 1 or k_new.shape != (b, 1, kvh, d) or v_new.shape != k_new.shape:
        raise ValueError(f"append_and_attend takes one token per row: q {q.shape}, k/v {k_new.shape}")
    _check(q, k_pages, v_pages, block_tables, positions)
    if implementation is None:
        from zgen.pallas.paged_attention import triton

        impl = "triton" if platform() == "gpu" and triton.supports(k_pages) else "reference"
    elif implementation in ("reference", "triton"):
        impl = implementation
    else:
        raise ConfigError(f"append_and_attend has implementations reference and triton (or None), not {implementation!r}")
    if impl == "triton":
        from zgen.pallas.paged_attention import triton

        return triton.append_decode_attention(
            q, k_new, v_new, k_pages, v_pages, block_tables, positions, inv_freq=inv_freq, sliding_window=sliding_window,
            soft_cap=soft_cap, scale=resolve_scale(d, scale), interpret=interpret_pallas(),
        )
    if inv_freq is not None:
        q, k_new = (apply_rope(x, positions[:, :, None], inv_freq) for x in (q, k_new))
    pos = positions[:, 0].astype(jnp.int32)
    pps = block_tables.shape[1]
    own = jnp.take_along_axis(block_tables, jnp.clip(pos // page_size, 0, pps - 1)[:, None], axis=1)[:, 0]
    page = jnp.where((pos >= 0) & (pos < pps * page_size) & (own >= 0), own, num_pages)  # out of bounds: dropped
    offset = pos % page_size

    def store(pages: KVPages, tokens: Array) -> KVPages:
        stored = quantize_fp8(tokens[:, 0]) if isinstance(pages, Fp8Pages) else tokens[:, 0]  # [b, kvh, ...] leaves
        def put(pool: Array, x: Array) -> Array:
            return pool.at[:, page, offset].set(jnp.swapaxes(x, 0, 1).astype(pool.dtype), mode="drop")

        return jax.tree_util.tree_map(put, pages, stored)

    k_pages, v_pages = store(k_pages, k_new), store(v_pages, v_new)
    out = paged_attention(
        q, k_pages, v_pages, block_tables, positions, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        implementation="reference",
    )
    return out, k_pages, v_pages
