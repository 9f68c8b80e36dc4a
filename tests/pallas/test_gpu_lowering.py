"""The GPU kernels lower for CUDA on this CPU-only machine (jax.export cross-lowering).

This catches Pallas-to-Triton lowering errors (unsupported ops, block shapes) without a GPU; the
Triton-to-PTX compile and the numbers are checked on the GPU by ``benchmarks/attention_kernels.py --check-only``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import pytest
from jax import export

from zgen.cache.formats import kv_format
from zgen.pallas.flash_attention import mosaic_gpu as flash_mosaic_gpu
from zgen.pallas.flash_attention import triton as flash_triton
from zgen.pallas.page_write import triton as page_write_triton
from zgen.pallas.paged_attention import mosaic_gpu as paged_mosaic_gpu
from zgen.pallas.paged_attention import quantize
from zgen.pallas.paged_attention.layouts import KeyCalibration
from zgen.pallas.paged_attention import triton as paged_triton
from zgen.pallas.quantized_matmul import triton as quantized_matmul_triton, triton_mma as quantized_matmul_mma
from zgen.pallas.norm_linear import triton as norm_linear_triton
from zgen.pallas.rms_norm import triton as rms_norm_triton
from zgen.quantized_weights import WeightQuantization, quantize as quantize_weight

TRITON_CALL = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def lower_for_cuda(fn: Callable[..., Any], *args: Any) -> str:
    """StableHLO for CUDA; Pallas kernels are lowered (Triton IR / Mosaic GPU MLIR) on the way."""
    exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[TRITON_CALL])(*args)
    return exported.mlir_module()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "q4", "q3"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_queries", "coded"), [(1, False), (24, True)])
def test_paged_attention_lowers(fmt: str, head_dim: int, num_queries: int, coded: bool) -> None:
    b, kvh, pages, page_size, pps = 2, 2, 8, 64, 4
    q = jnp.zeros((b, num_queries, 8, head_dim), jnp.bfloat16)
    kv = quantize(jnp.zeros((kvh, pages, page_size, head_dim), jnp.float32), fmt)  # type: ignore[arg-type]
    tables = jnp.zeros((b, pps), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(num_queries, dtype=jnp.int32) + 100, (b, num_queries))
    mask = jnp.ones((b, pps), bool)
    coding: dict[str, Any] = {}
    if coded:
        ones = jnp.ones((kvh, head_dim), jnp.float32)
        coding = dict(key_calibration=KeyCalibration(ones, ones, ones, jnp.ones((head_dim // 2,), jnp.float32)))

    def fn(q: jax.Array, k: Any, v: Any, t: jax.Array, p: jax.Array, m: jax.Array) -> jax.Array:
        return paged_triton.paged_attention(
            q, k, v, t, p, m, scale=0.1, soft_cap=30.0, sliding_window=90, **coding
        )

    assert "xla.gpu.triton" in lower_for_cuda(fn, q, kv, kv, tables, positions, mask)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (90, 30.0)])
def test_mosaic_gpu_paged_decode_lowers(head_dim: int, window: int | None, cap: float | None) -> None:
    b, kvh, pages, page_size, pps = 2, 2, 8, 64, 4
    q = jnp.zeros((b, 8, head_dim), jnp.bfloat16)
    kv = jnp.zeros((kvh, pages, page_size, head_dim), jnp.bfloat16)
    tables = jnp.zeros((b, pps), jnp.int32)
    lengths = jnp.full((b,), 100, jnp.int32)
    mask = jnp.ones((b, pps), bool)

    def fn(q: jax.Array, k: jax.Array, v: jax.Array, t: jax.Array, n: jax.Array, m: jax.Array) -> jax.Array:
        return paged_mosaic_gpu.paged_decode_attention(q, k, v, t, n, m, scale=0.1, soft_cap=cap, sliding_window=window)

    assert "mosaic_gpu" in lower_for_cuda(fn, q, kv, kv, tables, lengths, mask)


@pytest.mark.parametrize(("causal", "window", "cap", "dtype"), [
    (True, None, None, jnp.bfloat16), (False, 100, 30.0, jnp.bfloat16), (True, None, None, jnp.float32),
])
def test_flash_lowers(causal: bool, window: int | None, cap: float | None, dtype: Any) -> None:
    """bf16, and float32 (its own, smaller blocks)."""
    q = jnp.zeros((1, 256, 8, 128), dtype)
    k = jnp.zeros((1, 256, 2, 128), dtype)
    lengths = jnp.full((1,), 200, jnp.int32)

    def fn(q: jax.Array, k: jax.Array, v: jax.Array, n: jax.Array) -> jax.Array:
        return flash_triton.flash_attention(q, k, v, n, causal=causal, sliding_window=window, soft_cap=cap, scale=0.1)

    assert "xla.gpu.triton" in lower_for_cuda(fn, q, k, k, lengths)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (100, 30.0)])
def test_flash_lowers_with_query_positions(head_dim: int, window: int | None, cap: float | None) -> None:
    """A prefill chunk after a cached prefix: queries at per-row positions in a 640-slot buffer (caches
    are multiples of 128 slots, not always powers of two)."""
    q = jnp.zeros((2, 128, 8, head_dim), jnp.bfloat16)
    k = jnp.zeros((2, 640, 2, head_dim), jnp.bfloat16)
    lengths = jnp.full((2,), 640, jnp.int32)
    positions = jnp.zeros((2, 128), jnp.int32)

    def fn(q: jax.Array, k: jax.Array, v: jax.Array, n: jax.Array, p: jax.Array) -> jax.Array:
        return flash_triton.prefill_attention(q, k, v, n, p, causal=True, sliding_window=window, soft_cap=cap, scale=0.1)

    assert "xla.gpu.triton" in lower_for_cuda(fn, q, k, k, lengths, positions)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("queries", "heads", "kv_heads"), [(1, 32, 8), (1, 9, 3), (4, 16, 2)])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (100, 30.0)])
def test_flash_decode_lowers(
    head_dim: int, queries: int, heads: int, kv_heads: int, window: int | None, cap: float | None
) -> None:
    """The split-K decode kernel the dense cache runs for one token per row (and a few-token chunk)."""
    q = jnp.zeros((4, queries, heads, head_dim), jnp.bfloat16)
    k = jnp.zeros((4, 1152, kv_heads, head_dim), jnp.bfloat16)
    lengths = jnp.full((4,), 1152, jnp.int32)
    positions = jnp.zeros((4, queries), jnp.int32)

    def fn(q: jax.Array, k: jax.Array, v: jax.Array, n: jax.Array, p: jax.Array) -> jax.Array:
        return flash_triton.decode_attention(q, k, v, n, p, causal=True, sliding_window=window, soft_cap=cap, scale=0.1)

    assert "xla.gpu.triton" in lower_for_cuda(fn, q, k, k, lengths, positions)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mosaic_gpu_flash_lowers(dtype: jnp.dtype, head_dim: int) -> None:
    q = jnp.zeros((2, 300, 8, head_dim), dtype)
    k = jnp.zeros((2, 300, 2, head_dim), dtype)
    lengths = jnp.array([300, 200], jnp.int32)

    def fn(q: jax.Array, k: jax.Array, v: jax.Array, n: jax.Array) -> jax.Array:
        return flash_mosaic_gpu.flash_attention(q, k, v, n, causal=True, sliding_window=None, soft_cap=None, scale=0.1)

    assert "mosaic_gpu" in lower_for_cuda(fn, q, k, k, lengths)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (9, 3)])
@pytest.mark.parametrize(("slots", "window", "cap"), [(1024, None, None), (4096, 100, 30.0)])
def test_append_decode_lowers(head_dim: int, heads: int, kv_heads: int, slots: int, window: int | None, cap: float | None) -> None:
    """The dense cache's one-kernel decode step: finished in the kernel (1024 slots) or split (4096)."""
    q = jnp.zeros((2, 1, heads, head_dim), jnp.bfloat16)
    new = jnp.zeros((2, 1, kv_heads, head_dim), jnp.bfloat16)
    cache = jnp.zeros((2, slots, kv_heads, head_dim), jnp.bfloat16)
    positions = jnp.zeros((2, 1), jnp.int32)

    def fn(q: jax.Array, kn: jax.Array, vn: jax.Array, k: jax.Array, v: jax.Array, p: jax.Array) -> Any:
        return flash_triton.append_decode_attention(q, kn, vn, k, v, p, sliding_window=window, soft_cap=cap, scale=0.1)

    assert "xla.gpu.triton" in lower_for_cuda(fn, q, new, new, cache, cache, positions)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (9, 3)])
@pytest.mark.parametrize(("num_splits", "window", "cap"), [(1, None, None), (None, 100, 30.0)])
def test_paged_append_decode_lowers(
    fmt: str, head_dim: int, heads: int, kv_heads: int, num_splits: int | None, window: int | None, cap: float | None
) -> None:
    """The paged cache's one-kernel decode step over bf16 or fp8 pages: finished in the kernel or split."""
    q = jnp.zeros((2, 1, heads, head_dim), jnp.bfloat16)
    new = jnp.zeros((2, 1, kv_heads, head_dim), jnp.bfloat16)
    pool = quantize(jnp.zeros((kv_heads, 16, 64, head_dim), jnp.float32), fmt)  # type: ignore[arg-type]
    tables, positions = jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 1), jnp.int32)
    inv_freq = jnp.ones((head_dim // 2,), jnp.float32)

    def fn(q: jax.Array, kn: jax.Array, vn: jax.Array, k: Any, v: Any, t: jax.Array, p: jax.Array) -> Any:
        return paged_triton.append_decode_attention(
            q, kn, vn, k, v, t, p, inv_freq=inv_freq, sliding_window=window, soft_cap=cap, scale=0.1, num_splits=num_splits
        )

    assert "xla.gpu.triton" in lower_for_cuda(fn, q, new, new, pool, pool, tables, positions)


@pytest.mark.parametrize("size", [576, 4096])
def test_add_rms_norm_lowers(size: int) -> None:
    """The fused residual add + norm: SmolLM2's width (padded lanes) and Llama-3-8B's."""
    x = jnp.zeros((3, 1, size), jnp.bfloat16)

    def fn(x: jax.Array, d: jax.Array, w: jax.Array) -> Any:
        return rms_norm_triton.add_rms_norm(x, d, w, 1e-5)

    assert "xla.gpu.triton" in lower_for_cuda(fn, x, x, jnp.ones((size,), jnp.bfloat16))


@pytest.mark.parametrize(("rows", "size", "out", "residual"), [(1, 576, 960, True), (4, 576, 3072, False), (3, 1024, 2048, True)])
def test_norm_linear_lowers(rows: int, size: int, out: int, residual: bool) -> None:
    """A decode step's fused norm + projection: SmolLM2's width (not a power of two), a model's first
    layer (no residual add), the widest rows the kernel takes."""
    x = jnp.zeros((rows, size), jnp.bfloat16)

    def fn(x: jax.Array, n: jax.Array, w: jax.Array) -> Any:
        return norm_linear_triton.add_rms_norm_linear(x, x if residual else None, n, 1e-5, w, block_n=16)

    assert "xla.gpu.triton" in lower_for_cuda(fn, x, jnp.ones((size,), jnp.bfloat16), jnp.zeros((out, size), jnp.bfloat16))


@pytest.mark.parametrize(("bits", "group", "out", "inp"), [(8, None, 1024, 4096), (8, None, 4096, 14336), (4, 128, 14336, 4096), (4, 64, 576, 1536)])
def test_quantized_matmul_lowers(bits: int, group: int | None, out: int, inp: int) -> None:
    """Decode-shaped products: int8 one group per row (several pieces a group, one or two warps),
    int4 groups of 128 and 64 (a piece a group, several output channels a program)."""
    weight = quantize_weight(jnp.zeros((out, inp), jnp.float32), WeightQuantization(bits, group), jnp.dtype(jnp.float16))
    x = jnp.zeros((1, inp), jnp.bfloat16)
    assert "xla.gpu.triton" in lower_for_cuda(lambda x, w: quantized_matmul_triton.quantized_matmul(x, w), x, weight)


@pytest.mark.parametrize(("group", "out", "inp", "rows", "dtype"), [(128, 28672, 4096, 1, jnp.bfloat16), (128, 4096, 14336, 16, jnp.bfloat16), (32, 576, 576, 5, jnp.float16)])
def test_quantized_matmul_on_the_tensor_cores_lowers(group: int, out: int, inp: int, rows: int, dtype: Any) -> None:
    """4-bit codes as the dot's register operand (the PTX of their conversion included): one step of
    two groups at Llama-3-8B's gate/up, a row split over programs (its down projection), SmolLM2's
    groups of 32 in f16."""
    weight = quantize_weight(jnp.zeros((out, inp), jnp.float32), WeightQuantization(4, group), jnp.dtype(jnp.bfloat16))
    x = jnp.zeros((rows, inp), dtype)
    assert "xla.gpu.triton" in lower_for_cuda(lambda x, w: quantized_matmul_mma.quantized_matmul(x, w), x, weight)


@pytest.mark.parametrize(("dtype", "rest"), [(jnp.bfloat16, (128,)), (jnp.float8_e4m3fn, (64,)), (jnp.uint8, (2, 32)), (jnp.bfloat16, (4,))])
def test_store_tokens_lowers(dtype: Any, rest: tuple[int, ...]) -> None:
    pool = jnp.zeros((3, 40, 16, *rest), dtype)
    tokens = jnp.zeros((2, 5, 3, *rest), dtype)
    slots = jnp.zeros((2, 5), jnp.int32)
    assert "xla.gpu.triton" in lower_for_cuda(lambda *a: page_write_triton.store_tokens(*a), pool, tokens, slots, slots)


@pytest.mark.parametrize(("fmt", "head_dim", "coded"), [("bf16", 128, False), ("fp32", 64, False), ("fp8", 128, False), ("q4", 128, True), ("q4", 64, True)])
def test_write_kv_lowers(fmt: str, head_dim: int, coded: bool) -> None:
    fmt_ = kv_format(fmt)
    pool = fmt_.empty((2, 40, 16), head_dim)
    k = jnp.zeros((3, 7, 2, head_dim), jnp.bfloat16)
    slots = jnp.zeros((3, 7), jnp.int32)
    coding = KeyCalibration.identity(2, head_dim) if coded else None
    lowered = lower_for_cuda(lambda *a: page_write_triton.write_kv(*a, coding), pool, pool, k, k, slots, slots)
    assert "xla.gpu.triton" in lowered
