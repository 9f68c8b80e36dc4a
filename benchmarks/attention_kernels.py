"""GPU benchmark of zgen's attention kernels against jax's bundled kernels and the XLA path, in one run.

    python benchmarks/attention_kernels.py               # correctness checks, then timings; table at the end
    python benchmarks/attention_kernels.py --check-only  # only the correctness checks (small shapes, quick)

Measures the device's copy bandwidth and bf16 matmul rate in the same run, then:
- paged decode (B=8 or --decode-batch, 32 q / 8 kv heads, head_dim 128, bf16 queries, contexts 4k and 32k; bf16, fp8,
  q4, q3 pages, and q4/q3 with coded keys as the paged cache stores them): achieved bandwidth = bytes
  of KV actually read / time, and its fraction of copy bandwidth;
- prefill (causal, 4k and 8k tokens, bf16): TFLOP/s (causal half counted) vs the matmul rate, for
  flash attention over contiguous K/V and paged attention over pages of 64 (bf16 and q4);
- a decode step's residual add + RMS norm + the projection reading it (one row; SmolLM2's and
  Llama-3-8B's qkv and gate/up shapes): the fused kernel at each launch setting against the norm
  kernel followed by XLA's matmul, over distinct weights that overflow the L2 cache, as a model's
  layers do (microseconds per layer), and the weight bytes over that time.
Every kernel is checked against zgen's reference (relative L2 error) before it is timed; a kernel that
fails to lower or to match is reported, not fatal. Results go to ``$OUT/kernels.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zgen.pallas import add_rms_norm, flash_attention, paged_decode_attention
from zgen.pallas.norm_linear import add_rms_norm_linear
from zgen.shapes import next_pow2
from zgen.pallas.flash_attention import mosaic_gpu as flash_mosaic_gpu
from zgen.pallas.flash_attention import triton as flash_triton
from zgen.pallas.paged_attention import triton as paged_triton
from zgen.pallas.paged_attention.common import visible_pages
from zgen.pallas.paged_attention.layouts import (
    KeyCalibration,
    KVPages,
    bytes_per_token,
    dequantize,
    quantize_fp8,
    quantize_q3,
    quantize_q4,
)

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 8, 32, 8, 128
PREFILL_BATCH = 2
MAX_REL_ERR = 2e-2  # against the f32 reference on the same (quantized) pages
QUANTIZERS: dict[str, Callable[[jax.Array], KVPages]] = {
    "fp8": quantize_fp8,
    "q4": quantize_q4,
    "q4g32": functools.partial(quantize_q4, group_size=32),  # the groups before 64 became the default
    "q3": quantize_q3,
}


@dataclasses.dataclass
class Results:
    """Rows so far, rewritten to ``$OUT/kernels.json`` after each one so a run cut short keeps them."""

    meta: dict[str, Any]
    rows: list[Row] = dataclasses.field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(row, flush=True)
        self.save()

    def save(self) -> None:
        if out_dir := os.environ.get("OUT"):
            with open(os.path.join(out_dir, "kernels.json"), "w") as f:
                json.dump({**self.meta, "rows": [dataclasses.asdict(r) for r in self.rows]}, f, indent=1)


@dataclasses.dataclass
class Row:
    op: str
    impl: str
    fmt: str
    size: int
    ms: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    fraction: float | None = None  # of copy bandwidth (decode) or of matmul FLOP/s (prefill)
    rel_err: float | None = None
    error: str | None = None
    batch: int | None = None  # decode rows


def median_seconds(fn: Callable[[], Any], repeats: int, batch_seconds: float = 5e-3) -> float:
    """Median seconds per call over ``repeats`` batches of back-to-back calls, each batch long enough
    (about ``batch_seconds``) that the one host sync at its end does not count: device time, as
    ``triton.testing.do_bench`` measures it with events."""
    for _ in range(3):
        jax.block_until_ready(fn())
    start = time.perf_counter()
    jax.block_until_ready(fn())
    calls = max(1, min(200, int(batch_seconds / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    a, b = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))


def short(exc: BaseException) -> str:
    noise = ("----", "For simplicity")
    text = "".join(traceback.format_exception_only(exc)).strip().splitlines()
    lines = [l for l in text if l.strip() and not l.startswith(noise)]
    return " | ".join(lines[:3])[:400]


def copy_bandwidth(repeats: int) -> float:
    """Bytes read + written per second by an elementwise pass over 2 GiB."""
    x = jax.random.normal(jax.random.key(1), (1024, 1024 * 1024), jnp.bfloat16)
    f = jax.jit(lambda x: x + jnp.asarray(1, x.dtype))
    return 2 * x.nbytes / median_seconds(lambda: f(x), repeats)


def matmul_flops(repeats: int) -> float:
    n = 8192
    a = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * n**3 / median_seconds(lambda: f(a, b), repeats)


def quantize_in_slices(x: jax.Array, fmt: str, pages_per_slice: int = 256) -> KVPages:
    """Quantize page slices one at a time: Q3's codebook fit would not fit in memory all at once."""
    fn = jax.jit(QUANTIZERS[fmt])
    parts = [fn(x[:, i : i + pages_per_slice]) for i in range(0, x.shape[1], pages_per_slice)]
    return jax.tree_util.tree_map(lambda *leaves: jnp.concatenate(leaves, axis=1), *parts)


@dataclasses.dataclass
class DecodeProblem:
    q: jax.Array
    k: jax.Array  # bf16 pages [KVH, P, page, D]
    v: jax.Array
    tables: jax.Array
    lengths: jax.Array
    context: int

    @classmethod
    def make(cls, context: int, page_size: int, seed: int, batch: int) -> DecodeProblem:
        ks = jax.random.split(jax.random.key(seed), 4)
        pages_per_seq = context // page_size
        num_pages = batch * pages_per_seq
        shape = (KV_HEADS, num_pages, page_size, HEAD_DIM)
        tables = jax.random.permutation(ks[3], num_pages).reshape(batch, pages_per_seq).astype(jnp.int32)
        return cls(
            q=jax.random.normal(ks[0], (batch, Q_HEADS, HEAD_DIM), jnp.bfloat16),
            k=jax.random.normal(ks[1], shape, jnp.bfloat16),
            v=jax.random.normal(ks[2], shape, jnp.bfloat16),
            tables=tables,
            lengths=jnp.full((batch,), context, jnp.int32),
            context=context,
        )

    def contiguous(self) -> tuple[jax.Array, jax.Array]:
        """The same cache as [B, S, KVH, D] arrays, for jax's contiguous decode kernel."""
        def dense(p: jax.Array) -> jax.Array:
            g = p[:, self.tables]  # [KVH, B, pps, page, D]
            return g.reshape(KV_HEADS, self.tables.shape[0], self.context, HEAD_DIM).transpose(1, 2, 0, 3)

        return dense(self.k), dense(self.v)


# name -> (num_warps, num_stages, num_splits or None for the default ~1024 programs).
# Default: 4 warps for bf16, 2 for quantized pages, 3 stages, 16 splits at B=8 x 8 kv heads; "x2"/"x4"
# fix the split count (one split is the default at 128 rows).
DECODE_VARIANTS: dict[str, tuple[int, int, int | None]] = {
    "w4s3": (4, 3, None),
    "w2s4": (2, 4, None),
    "w4s3 x2": (4, 3, 2),
    "w4s3 x4": (4, 3, 4),
}


def random_calibration(seed: int) -> KeyCalibration:
    """A random key calibration of the right shapes: the coded keys the paged cache's q4/q3 store."""
    ks = jax.random.split(jax.random.key(seed), 3)
    inv_freq = 10_000.0 ** (-jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float32) / HEAD_DIM)
    stat = lambda k: jax.random.normal(k, (KV_HEADS, HEAD_DIM), jnp.float32)  # noqa: E731
    return KeyCalibration(stat(ks[0]), stat(ks[1]), jnp.exp(0.5 * stat(ks[2])), inv_freq)


def paged_candidates(
    p: DecodeProblem, fmt: str, kq: KVPages, vq: KVPages, coding: dict[str, Any]
) -> dict[str, Callable[[], jax.Array]]:
    cands: dict[str, Callable[[], jax.Array]] = {}
    args = (p.q, kq, vq, p.tables, p.lengths)
    page_size = p.k.shape[2]
    for impl in ("triton", "xla"):
        f = jax.jit(lambda q, k, v, t, n, impl=impl: paged_decode_attention(q, k, v, t, n, implementation=impl, **coding))
        cands[f"zgen {impl}"] = lambda f=f: f(*args)
    # Launch variants of our kernel, called below the api (same preprocessing).
    q_pos = (p.lengths - 1)[:, None]
    pages = visible_pages(p.tables, q_pos, None, page_size, None)
    for name, (warps, stages, splits) in DECODE_VARIANTS.items():
        f = jax.jit(
            lambda q, k, v, t, n, m, w=warps, s=stages, sp=splits: paged_triton.paged_attention(
                q[:, None], k, v, t, (n - 1)[:, None], m, scale=HEAD_DIM**-0.5, soft_cap=None, sliding_window=None,
                num_warps=w, num_stages=s, num_splits=sp, **coding,
            )[:, 0]
        )
        cands[f"zgen triton {name}"] = lambda f=f: f(*args, pages)
    if fmt == "bf16":
        f = jax.jit(lambda q, k, v, t, n: paged_decode_attention(q, k, v, t, n, implementation="mosaic_gpu"))
        cands["zgen mosaic_gpu"] = lambda f=f: f(*args)
        try:
            from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

            f = jax.jit(lambda q, k, v, t, n: jax_paged.paged_attention(
                q * HEAD_DIM**-0.5, k, v, t, n, k_splits=min(16, t.shape[1])
            ))
            cands["jax paged_attention"] = lambda f=f: f(*args)
        except ImportError as e:
            print("jax paged_attention not importable:", e)
        try:
            from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode

            kc, vc = p.contiguous()
            f = jax.jit(lambda q, k, v, n: jax_decode.gqa(q, k, v, kv_seq_len=n))
            cands["jax decode gqa"] = lambda f=f: f(p.q, kc, vc, p.lengths)
        except ImportError as e:
            print("jax decode_attention not importable:", e)
    return cands


# Page formats timed: plain layouts, and q4/q3 with coded keys (centred, scaled, Hadamard-rotated),
# which is what the paged cache stores for kv_dtype q4/q3.
DECODE_FORMATS = ("bf16", *QUANTIZERS, "q4 coded", "q3 coded")


def bench_decode(
    contexts: list[int], formats: list[str], page_size: int, repeats: int, copy_bw: float | None, results: Results, batch: int
) -> None:
    for context in contexts:
        p = DecodeProblem.make(context, page_size, seed=context, batch=batch)
        for fmt in formats:
            base, coded = fmt.split(" ")[0], fmt.endswith("coded")
            kq, vq = (p.k, p.v) if base == "bf16" else (quantize_in_slices(p.k, base), quantize_in_slices(p.v, base))
            coding: dict[str, Any] = {}
            if coded:
                coding["key_calibration"] = random_calibration(context)
            ref = jax.jit(lambda q, k, v, t, n: paged_decode_attention(q, k, v, t, n, implementation="reference", **coding))(
                p.q, kq, vq, p.tables, p.lengths
            )
            read = 2 * batch * KV_HEADS * context * bytes_per_token(kq)
            for name, fn in paged_candidates(p, fmt, kq, vq, coding).items():
                row = Row("paged_decode", name, fmt, context, batch=batch)
                try:
                    row.rel_err = rel_err(fn(), ref)
                    if not row.rel_err <= MAX_REL_ERR:
                        row.error = f"wrong result (rel err {row.rel_err:.3g})"
                    elif copy_bw is not None:
                        t = median_seconds(fn, repeats)
                        row.ms, row.gbps = t * 1e3, read / t / 1e9
                        row.fraction = read / t / copy_bw
                except Exception as e:  # noqa: BLE001 - a kernel that fails to lower is a result
                    row.error = short(e)
                results.add(row)
            del kq, vq, ref


def flash_candidates(q: jax.Array, k: jax.Array, v: jax.Array) -> dict[str, Callable[[], jax.Array]]:
    cands: dict[str, Callable[[], jax.Array]] = {}
    lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
    for impl in ("triton", "xla"):
        f = jax.jit(lambda q, k, v, impl=impl: flash_attention(q, k, v, implementation=impl))
        cands[f"zgen {impl}"] = lambda f=f: f(q, k, v)
    # zgen's Mosaic GPU kernel in bf16 (the GPU default) with other key blocks / ring depths, and on
    # float16 copies of the inputs beside jax's bundled kernel, which runs float16 only (rows fmt=f16).
    f = jax.jit(lambda q, k, v: flash_attention(q, k, v, implementation="mosaic_gpu"))
    cands["zgen mosaic_gpu"] = lambda f=f: f(q, k, v)
    for bkv, stages in ((64, 2), (64, 4)):
        f = jax.jit(lambda q, k, v, n, bkv=bkv, s=stages: flash_mosaic_gpu.flash_attention(
            q, k, v, n, causal=True, sliding_window=None, soft_cap=None, scale=HEAD_DIM**-0.5, block_kv=bkv, stages=s,
        ))
        cands[f"zgen mosaic_gpu k{bkv}s{stages}"] = lambda f=f: f(q, k, v, lengths)
    q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v))
    f = jax.jit(lambda q, k, v: flash_attention(q, k, v, implementation="mosaic_gpu"))
    cands["zgen mosaic_gpu (f16)"] = lambda f=f: f(q16, k16, v16)
    # Default: q128 k64 w8 s3 (the best at 8k in earlier runs); the runner-up.
    for bq, bk, warps, stages in ((128, 128, 8, 2),):
        f = jax.jit(
            lambda q, k, v, n, bq=bq, bk=bk, w=warps, s=stages: flash_triton.flash_attention(
                q, k, v, n, causal=True, sliding_window=None, soft_cap=None, scale=HEAD_DIM**-0.5,
                block_q=bq, block_k=bk, num_warps=w, num_stages=s,
            )
        )
        cands[f"zgen triton q{bq}k{bk}w{warps}s{stages}"] = lambda f=f: f(q, k, v, lengths)
    # The same causal attention read from a paged cache (pages of 64 in order, bf16 and q4): the
    # kernel the paged cache prefills with.
    for fmt in ("bf16", "q4"):
        kp, vp, tables = as_pages(k, fmt), as_pages(v, fmt), page_tables(q.shape[0], q.shape[1])
        positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
        for warps in (4, 8):
            f = jax.jit(lambda q, k, v, t, pos, w=warps: paged_triton.paged_attention(
                q, k, v, t, pos, jnp.ones(t.shape, bool), scale=HEAD_DIM**-0.5, soft_cap=None, sliding_window=None, num_warps=w,
            ))
            cands[f"zgen triton paged {fmt} w{warps}"] = lambda f=f, kp=kp, vp=vp, t=tables, pos=positions: f(q, kp, vp, t, pos)
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        for bq, bkv in ((64, 128), (64, 64)):
            config = attention_mgpu.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=2, causal=True)
            f = jax.jit(lambda q, k, v, c=config: attention_mgpu.attention(q * HEAD_DIM**-0.5, k, v, c))
            cands[f"jax attention_mgpu q{bq}k{bkv} (f16)"] = lambda f=f: f(q16, k16, v16)
    except ImportError as e:
        print("jax attention_mgpu not importable:", e)
    try:
        from jax.experimental.pallas.ops.gpu import attention as jax_attention

        group = q.shape[2] // k.shape[2]
        kr, vr = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # it has no GQA; repeat outside timing
        f = jax.jit(lambda q, k, v: jax_attention.mha(q, k, v, None, sm_scale=HEAD_DIM**-0.5, causal=True))
        cands["jax attention (triton)"] = lambda f=f: f(q, kr, vr)
    except ImportError as e:
        print("jax attention not importable:", e)
    return cands


PREFILL_PAGE = 64


def as_pages(x: jax.Array, fmt: str) -> KVPages:
    """[B, T, KVH, D] as pages [KVH, B * T / 64, 64, D], row b owning pages b * T/64 ... in order."""
    b, t, kvh, d = x.shape
    pages = x.reshape(b, t // PREFILL_PAGE, PREFILL_PAGE, kvh, d).transpose(3, 0, 1, 2, 4).reshape(kvh, -1, PREFILL_PAGE, d)
    return pages if fmt == "bf16" else quantize_in_slices(pages, fmt)


def dequantized_rows(x: jax.Array, fmt: str) -> jax.Array:
    """``x`` [1, T, KVH, D] through ``fmt`` pages and back."""
    pages = dequantize(as_pages(x, fmt), jnp.float32)  # [KVH, T/64, 64, D]
    return pages.reshape(x.shape[2], x.shape[1], x.shape[3]).transpose(1, 0, 2)[None].astype(x.dtype)


def page_tables(batch: int, tokens: int) -> jax.Array:
    return jnp.arange(batch * tokens // PREFILL_PAGE, dtype=jnp.int32).reshape(batch, -1)


def bench_prefill(lengths: list[int], repeats: int, mm_flops: float | None, results: Results) -> None:
    for t in lengths:
        ks = jax.random.split(jax.random.key(t), 3)
        q = jax.random.normal(ks[0], (PREFILL_BATCH, t, Q_HEADS, HEAD_DIM), jnp.bfloat16)
        k = jax.random.normal(ks[1], (PREFILL_BATCH, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        v = jax.random.normal(ks[2], (PREFILL_BATCH, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        # The reference materializes [H, T, T] f32 logits: check the first sequence only (8k: ~9 GB).
        ref = jax.jit(lambda q, k, v: flash_attention(q, k, v, implementation="reference"))(q[:1], k[:1], v[:1])
        q4_ref = jax.jit(lambda q, k, v: flash_attention(q, k, v, implementation="reference"))(
            q[:1], *(dequantized_rows(x[:1], "q4") for x in (k, v))
        )
        flops = 4 * PREFILL_BATCH * Q_HEADS * t * t * HEAD_DIM / 2  # causal: half the score matrix
        for name, fn in flash_candidates(q, k, v).items():
            row = Row("flash_prefill", name, "f16" if "(f16)" in name else "q4" if " q4 " in name else "bf16", t)
            try:
                # q4 pages: against attention over the dequantized pages
                row.rel_err = rel_err(fn()[:1], q4_ref if row.fmt == "q4" else ref)
                if not row.rel_err <= MAX_REL_ERR:
                    row.error = f"wrong result (rel err {row.rel_err:.3g})"
                elif mm_flops is not None:
                    secs = median_seconds(fn, repeats)
                    row.ms, row.tflops = secs * 1e3, flops / secs / 1e12
                    row.fraction = flops / secs / mm_flops
            except Exception as e:  # noqa: BLE001
                row.error = short(e)
            results.add(row)
        del ref


# (hidden, out): SmolLM2-135M qkv, gate/up; SmolLM2-360M gate/up; Llama-3-8B qkv, gate/up (rows wider than the
# runtime gives the kernel: timed to see whether it should)
NORM_LINEAR_SHAPES = ((576, 960), (576, 3072), (960, 2880), (4096, 6144), (4096, 28672))
NORM_LINEAR_TILE = 16384  # the most weight values a program's slice holds in registers
NORM_LINEAR_BYTES = 256 << 20  # weights per timed call: more than the L2 cache holds, so they come from DRAM


def bench_norm_linear(shapes: list[tuple[int, int]], repeats: int, copy_bw: float | None, results: Results) -> None:
    """Microseconds per ``add + norm + x @ W.T`` for one bf16 row, applied in one call to as many
    distinct weights as ``NORM_LINEAR_BYTES`` hold (at least 4), each feeding its residual sum to the
    next (as a model's layers do): every weight read from DRAM, the launches back to back. The fused
    kernel runs at every output block whose slice fits :data:`NORM_LINEAR_TILE` values, and 2, 4 or 8 warps."""
    eps = 1e-5
    for size, out in shapes:
        rng = np.random.default_rng(size + out)
        x, delta = (jnp.asarray(rng.standard_normal((1, 1, size)) * 0.1, jnp.bfloat16) for _ in range(2))
        norm_weight = jnp.asarray(1 + 0.1 * rng.standard_normal(size), jnp.bfloat16)
        layers = max(4, NORM_LINEAR_BYTES // (out * size * 2))
        weights = [jnp.asarray(rng.standard_normal((out, size)) * size**-0.5, jnp.bfloat16) for _ in range(layers)]

        def layered(op: Callable[..., tuple[jax.Array, jax.Array]]) -> Callable[[], jax.Array]:
            def run(weights: list[jax.Array]) -> jax.Array:
                carry, outputs = delta, []
                for weight in weights:
                    total, projected = op(x, carry, norm_weight, eps, weight)
                    carry = (total * 0.5).astype(total.dtype)
                    outputs.append(projected)
                return jnp.stack(outputs)

            compiled = jax.jit(run)
            return lambda: compiled(weights)

        def norm_then_matmul(x: jax.Array, d: jax.Array, n: jax.Array, e: float, w: jax.Array) -> tuple[jax.Array, jax.Array]:
            total, normed = add_rms_norm(x, d, n, e)
            return total, jnp.einsum("...i,oi->...o", normed, w)

        want = add_rms_norm_linear(x, delta, norm_weight, eps, weights[0], implementation="xla")[1]
        candidates: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {"norm kernel + XLA matmul": norm_then_matmul}
        for block_n in (b for b in (1, 2, 4, 8, 16) if b * next_pow2(size) <= NORM_LINEAR_TILE):
            for warps in (2, 4, 8):
                candidates[f"zgen fused bn{block_n} w{warps}"] = functools.partial(_fused_setting, block_n=block_n, num_warps=warps)
        for name, op in candidates.items():
            row = Row("norm_linear", name, "bf16", size * 100_000 + out)
            try:
                row.rel_err = rel_err(op(x, delta, norm_weight, eps, weights[0])[1], want)
                seconds = median_seconds(layered(op), repeats) / layers
                row.ms, row.gbps = seconds * 1e3, out * size * 2 / seconds / 1e9  # the table shows ms: 0.001 = 1 µs
                row.fraction = None if copy_bw is None else row.gbps * 1e9 / (copy_bw / 2)
            except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                row.error = short(exc)
            results.add(row)


def _fused_setting(
    x: jax.Array, delta: jax.Array, norm_weight: jax.Array, eps: float, weight: jax.Array, *, block_n: int, num_warps: int
) -> tuple[jax.Array, jax.Array]:
    from zgen.pallas.norm_linear import triton

    total, projected = triton.add_rms_norm_linear(
        x.reshape(1, -1), delta.reshape(1, -1), norm_weight, eps, weight, block_n=block_n, num_warps=num_warps
    )
    assert total is not None
    return total.reshape(x.shape), projected.reshape(*x.shape[:-1], -1)


def fmt_cell(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row]) -> str:
    head = f"{'op':<14}{'impl':<34}{'fmt':<6}{'size':>7}{'rows':>5}{'ms':>9}{'GB/s':>8}{'TFLOP/s':>9}{'frac':>7}{'rel_err':>10}  error"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.op:<14}{r.impl:<34}{r.fmt:<6}{r.size:>7}{r.batch or '':>5}{fmt_cell(r.ms, '.3f'):>9}{fmt_cell(r.gbps, '.0f'):>8}"
            f"{fmt_cell(r.tflops, '.1f'):>9}{fmt_cell(r.fraction, '.2f'):>7}{fmt_cell(r.rel_err, '.2e'):>10}  {r.error or ''}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-only", action="store_true", help="correctness checks only, small shapes")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--contexts", type=int, nargs="*", help="decode contexts (default 4096 32768; none: skip)")
    parser.add_argument("--prefill-lengths", type=int, nargs="*", help="prefill lengths (default 4096 8192; none: skip)")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[BATCH], help="decode rows (several: timed in turn)")
    parser.add_argument("--formats", nargs="*", default=list(DECODE_FORMATS), help=f"decode page formats {DECODE_FORMATS}")
    parser.add_argument("--no-norm-linear", action="store_true", help="skip the fused norm + projection")
    args = parser.parse_args()

    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    copy_bw = mm = None
    if not args.check_only:
        copy_bw, mm = copy_bandwidth(args.repeats), matmul_flops(args.repeats)
        print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    results = Results(
        meta={
            "device": device.device_kind,
            "jax": jax.__version__,
            "page_size": args.page_size,
            "copy_bandwidth_gbps": None if copy_bw is None else copy_bw / 1e9,
            "matmul_tflops": None if mm is None else mm / 1e12,
        }
    )
    contexts = args.contexts if args.contexts is not None else [2048] if args.check_only else [4096, 32768]
    prefill = args.prefill_lengths if args.prefill_lengths is not None else [1024] if args.check_only else [4096, 8192]
    for batch in args.decode_batch:
        bench_decode(contexts, args.formats, args.page_size, args.repeats, copy_bw, results, batch)
    bench_prefill(prefill, args.repeats, mm, results)
    if not args.no_norm_linear:
        bench_norm_linear(list(NORM_LINEAR_SHAPES[:1] if args.check_only else NORM_LINEAR_SHAPES), args.repeats, copy_bw, results)

    print()
    print(table(results.rows))
    if copy_bw is not None and mm is not None:
        print(f"\ncopy bandwidth {copy_bw / 1e9:.0f} GB/s; bf16 matmul {mm / 1e12:.0f} TFLOP/s; device {device.device_kind}")
    ours = [r for r in results.rows if r.impl.startswith("zgen")]
    failed = [r for r in ours if r.error]
    baselines_failed = sum(1 for r in results.rows if r.error and r not in ours)
    print(f"\nzgen: {len(ours) - len(failed)} ok, {len(failed)} failed; baselines failed: {baselines_failed}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
