"""Helpers shared by every attention backend: platform choice, masking, online softmax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zgen.shapes import cdiv

Implementation = Literal["reference", "xla", "triton", "mosaic_gpu", "mosaic_tpu"]
IMPLEMENTATIONS: tuple[Implementation, ...] = get_args(Implementation)

# Running maxima start finite so that a fully masked tile gives exp(-inf - m) = 0, never NaN.
RUNNING_MAX_INIT = -1e30


def platform() -> str:
    """The platform jit places computations on: "cpu", "gpu" or "tpu"."""
    name = jax.default_backend()
    return "gpu" if name in ("cuda", "rocm", "gpu") else name


def hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x): WGMMA and TMA kernels."""
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


Out = TypeVar("Out")


def with_reference_gradient(kernel: Callable[..., Out], reference: Callable[..., Out]) -> Callable[..., Out]:
    """``kernel`` (a Pallas call, which JAX cannot differentiate) with the gradient of ``reference``,
    the same function in XLA ops: what a caller that trains through the graph (an EAGLE head reading
    the target's norms and LM head) differentiates. Both take the same array arguments (pytrees; bind
    the rest first) and return the same structure."""

    @jax.custom_vjp
    def run(*arrays: Any) -> Out:
        return kernel(*arrays)

    def forward(*arrays: Any) -> tuple[Out, tuple[Any, ...]]:
        return kernel(*arrays), arrays

    def backward(arrays: tuple[Any, ...], cotangent: Out) -> tuple[Any, ...]:
        return jax.vjp(reference, *arrays)[1](cotangent)

    run.defvjp(forward, backward)
    return run


def check_implementation(implementation: str) -> Implementation:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
    return implementation  # type: ignore[return-value]


def interpret_pallas() -> bool:
    """Pallas kernels run in interpret mode where there is no accelerator to compile them for."""
    return platform() == "cpu"


def resolve_scale(head_dim: int, scale: float | None) -> float:
    return head_dim**-0.5 if scale is None else float(scale)


def soft_cap(logits: Array, cap: float | None) -> Array:
    """Gemma-2 style logit capping: ``cap * tanh(logits / cap)``, applied after scaling."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


LOG2_E = 1.4426950408889634


def base2_logits(logits: Float[Array, "*rows cols"], scale: float, cap: float | None) -> Float[Array, "*rows cols"]:
    """Scaled (and soft-capped) logits in base-2 units, ``log2(e)`` times the natural ones: what the
    Triton kernels' online softmax takes (``softmax_rescale(..., base2=True)``). There ``exp2`` is one
    hardware instruction and ``exp`` an accurate library routine of about ten: the paged bf16 decode
    kernel's loop went from 409 to 334 instructions a thread a page (sm_90 SASS, ``benchmarks/kernel_sass.py``)."""
    if cap is None:
        return logits * (scale * LOG2_E)
    return soft_cap(logits * scale, cap) * LOG2_E


def softmax_rescale(
    m_prev: Float[Array, "*rows"], l_prev: Float[Array, "*rows"], logits: Float[Array, "*rows cols"], *, base2: bool = False
) -> tuple[Float[Array, "*rows"], Float[Array, "*rows"], Float[Array, "*rows cols"], Float[Array, "*rows"]]:
    """One online-softmax step over a tile of (masked = -inf) logits.

    Returns the new running max and denominator, the tile's unnormalised probabilities and the factor
    ``alpha`` by which the caller must rescale its accumulator before adding ``p @ v``. Plain jnp on
    tiles, so XLA loops and Pallas kernels share it. ``base2``: logits and the running max are in
    base-2 units (:func:`base2_logits`).
    """
    exp = jnp.exp2 if base2 else jnp.exp
    m_new = jnp.maximum(m_prev, jnp.max(logits, axis=-1))
    p = exp(logits - broadcast_rows(m_new, logits.shape))
    alpha = exp(m_prev - m_new)
    return m_new, alpha * l_prev + jnp.sum(p, axis=-1), p, alpha


def broadcast_rows(x: Array, shape: tuple[int, ...]) -> Array:
    """``x[..., None]`` broadcast to ``shape``, spelled as a broadcast_in_dim that Mosaic GPU lowers."""
    return jax.lax.broadcast_in_dim(x, shape, tuple(range(x.ndim)))


def finish_softmax(
    acc: Float[Array, "*rows d"], m: Float[Array, "*rows"], l: Float[Array, "*rows"], *, base2: bool = False
) -> tuple[Float[Array, "*rows d"], Float[Array, "*rows"]]:
    """Normalised output and (natural) log-sum-exp; rows that saw no valid key give 0 and -inf.
    ``base2``: ``m`` is in base-2 units, as :func:`softmax_rescale` kept it."""
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    safe = jnp.where(seen, l, 1.0)
    lse = (m + jnp.log2(safe)) * (1 / LOG2_E) if base2 else m + jnp.log(safe)
    return out, jnp.where(seen, lse, -jnp.inf)


def merge_partials(
    out: Float[Array, "*lead splits rows d"], lse: Float[Array, "*lead splits rows"]
) -> Float[Array, "*lead rows d"]:
    """Log-sum-exp merge of attention computed over disjoint key splits (empty splits have lse=-inf)."""
    m = jnp.max(lse, axis=-2, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)
    den = jnp.sum(w, axis=-2)
    num = jnp.sum(w[..., None] * out.astype(jnp.float32), axis=-3)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def masked_softmax_attention(
    q: Float[Array, "*batch tq d"],
    k: Float[Array, "*batch tk d"],
    v: Float[Array, "*batch tk d"],
    mask: Array,
    *,
    scale: float,
    cap: float | None,
) -> Float[Array, "*batch tq d"]:
    """Fully materialised attention in f32 (references only); rows with no visible key give 0."""
    exact = jax.lax.Precision.HIGHEST  # f32 must not drop to TF32 on GPUs
    logits = jnp.einsum("...qd,...kd->...qk", q.astype(jnp.float32), k.astype(jnp.float32), precision=exact) * scale
    logits = jnp.where(mask, soft_cap(logits, cap), -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("...qk,...kd->...qd", p, v.astype(jnp.float32), precision=exact)
    return out / jnp.where(den > 0, den, 1.0)


def visible(q_pos: Array, k_pos: Array, length: Array, *, causal: bool, window: int | None) -> Array:
    """Which keys a query may attend to (broadcasting positions); decode is ``q_pos = length - 1``.

    A key is visible when it is a valid token (``k_pos < length``), not in the future (causal) and,
    with a sliding window ``w``, among the ``w`` most recent positions including the query's own.
    """
    mask = k_pos < length
    if causal:
        mask &= k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


def query_positions(q_positions: Int[Array, "b t"] | None, batch: int, num_queries: int) -> Int[Array, "b t"]:
    """Where each query sits; by default query ``i`` at position ``i`` (self-attention from slot 0)."""
    if q_positions is None:
        return jnp.broadcast_to(jnp.arange(num_queries, dtype=jnp.int32), (batch, num_queries))
    return q_positions.astype(jnp.int32)


def is_query(q_pos: Array, length: Array) -> Array:
    """Real queries sit in ``[0, length)``; the rest are padding, and their outputs are zero."""
    return (q_pos >= 0) & (q_pos < length)


def query_span(q_pos: Array, length: Array) -> tuple[Array, Array]:
    """The smallest and largest position of the real queries among ``q_pos`` (broadcast against
    ``length``); ``last`` is -1 (and ``first`` -1) when there is none."""
    real = is_query(q_pos, length)
    last = jnp.max(jnp.where(real, q_pos, -1))
    return jnp.min(jnp.where(real, q_pos, last)), last


def key_block_range(
    first: Array, last: Array, length: Array, *, block_k: int, num_k_blocks: int, causal: bool, window: int | None
) -> tuple[Array, Array]:
    """Key blocks ``[lo, hi)`` that hold a key visible to some query at a position in ``[first, last]``
    (see ``query_span``; empty when ``last < 0``): a block loop skips everything outside it."""
    end = jnp.minimum(length, last + 1) if causal else length
    end = jnp.where(last >= 0, end, 0)
    hi = jnp.minimum((end + block_k - 1) // block_k, num_k_blocks)
    if window is None:
        return jnp.zeros_like(hi), hi
    return jnp.minimum(jnp.maximum(first - window + 1, 0) // block_k, hi), hi


def query_blocks(
    q: Float[Array, "b t h d"], q_positions: Int[Array, "b t"], kv_heads: int, block_t: int, rows: int
) -> tuple[Float[Array, "b kvh blocks rows d"], Int[Array, "b blocks rows"]]:
    """Queries as tiles for a matrix unit: ``block_t`` consecutive tokens times the query group of one
    kv head (row ``t * group + g``), zero-padded to ``rows``; padding rows sit at position -1."""
    b, t, h, d = q.shape
    g = h // kv_heads
    blocks = cdiv(t, block_t)
    pad_t = blocks * block_t - t
    grouped = jnp.pad(q.reshape(b, t, kv_heads, g, d), ((0, 0), (0, pad_t), (0, 0), (0, 0), (0, 0)))
    grouped = grouped.reshape(b, blocks, block_t, kv_heads, g, d).transpose(0, 3, 1, 2, 4, 5)
    tiles = grouped.reshape(b, kv_heads, blocks, block_t * g, d)
    tiles = jnp.pad(tiles, ((0, 0), (0, 0), (0, 0), (0, rows - block_t * g), (0, 0)))
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, pad_t)), constant_values=-1)
    pos = jnp.repeat(pos.reshape(b, blocks, block_t), g, axis=2)
    pos = jnp.pad(pos, ((0, 0), (0, 0), (0, rows - block_t * g)), constant_values=-1)
    return tiles, pos


def ungroup_queries(
    out: Float[Array, "b kvh blocks rows d"], num_queries: int, heads: int, block_t: int
) -> Float[Array, "b t h d"]:
    """The inverse of :func:`query_blocks`: ``[B, T, H, D]`` without the padding."""
    b, kvh, blocks, _, d = out.shape
    g = heads // kvh
    rows = out[:, :, :, : block_t * g].reshape(b, kvh, blocks * block_t, g, d)
    return rows[:, :, :num_queries].transpose(0, 2, 1, 3, 4).reshape(b, num_queries, heads, d)
