"""The appending decode kernels alone: the paged one (plain or fp8 pages) at several split counts
against the dense cache's, µs a call (GPU only).

Each kernel runs ``--calls`` times in one jitted ``fori_loop`` over donated buffers, as a decode
step's layers call it (RoPE, the token's K/V write and attention, the split merge included), and a
call's time is the loop's wall time over its calls, median of ``--repeats``. Llama-3-8B's heads (32
query / 8 KV of 128), every row at ``context`` tokens, pages of ``--page-size`` (64) in a shuffled pool.

    python benchmarks/paged_append.py                          # batch 8 at 8,000 and 1,000 tokens
    python benchmarks/paged_append.py --batch 128 --contexts 700 --splits 0 2 --formats bf16
    python benchmarks/paged_append.py --formats fp8 --splits 0 --warps 2 4 --stages 2 3 4
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
INV_FREQ = 500_000.0 ** (-jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float32) / HEAD_DIM)


def per_call_us(step: Callable[..., Any], q: jax.Array, new: jax.Array, k: Any, v: Any, calls: int, repeats: int) -> float:
    """Median µs of one ``step(q, new, new, k, v)`` inside a loop of ``calls`` over donated ``k``, ``v``."""

    def loop(q: jax.Array, k: Any, v: Any) -> tuple[jax.Array, Any, Any]:
        def body(_: int, carry: tuple[jax.Array, Any, Any]) -> tuple[jax.Array, Any, Any]:
            q, k, v = carry
            out, k, v = step(q, new, new, k, v)
            return out.astype(q.dtype), k, v

        return jax.lax.fori_loop(0, calls, body, (q, k, v))

    run = jax.jit(loop, donate_argnums=(1, 2))
    out, k, v = run(q, k, v)
    out.block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out, k, v = run(q, k, v)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8000, 1000])
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 16, 8, 4, 2], help="split counts (0: the kernel's default)")
    parser.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument("--warps", type=int, nargs="+", default=[0], help="warps per program (0: the kernel's default)")
    parser.add_argument("--stages", type=int, nargs="+", default=[3], help="pipeline stages of the page loop")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    from zgen.pallas.common import platform
    from zgen.pallas.flash_attention import triton as dense_triton
    from zgen.pallas.paged_attention import quantize, triton as paged_triton

    if platform() != "gpu":
        raise SystemExit("the appending kernels are timed on a GPU")
    b, key, page = args.batch, jax.random.key(0), args.page_size
    print(f"device: {jax.devices()[0].device_kind}; batch {b}, heads {HEADS}/{KV_HEADS} of {HEAD_DIM}, pages of {page}")
    for context in args.contexts:
        capacity = -(-(context + args.calls) // 128) * 128
        pages_per_row = capacity // page
        q = jax.random.normal(key, (b, 1, HEADS, HEAD_DIM), jnp.bfloat16)
        new = jax.random.normal(key, (b, 1, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        tables = jnp.asarray(np.random.default_rng(0).permutation(b * pages_per_row).reshape(b, pages_per_row), jnp.int32)
        positions = jnp.full((b, 1), context, jnp.int32)
        for fmt in args.formats:
            for splits, warps, stages in itertools.product(args.splits, args.warps, args.stages):
                def paged(q: jax.Array, kn: jax.Array, vn: jax.Array, k: Any, v: Any, splits: int = splits, warps: int = warps, stages: int = stages) -> Any:
                    return paged_triton.append_decode_attention(
                        q, kn, vn, k, v, tables, positions, inv_freq=INV_FREQ, sliding_window=None, soft_cap=None,
                        scale=HEAD_DIM**-0.5, num_splits=splits or None, num_warps=warps or None, num_stages=stages,
                    )

                pool = jax.random.normal(key, (KV_HEADS, b * pages_per_row, page, HEAD_DIM), jnp.bfloat16)
                k = v = pool if fmt == "bf16" else quantize(pool.astype(jnp.float32), "fp8")
                us = per_call_us(paged, q, new, k, jax.tree_util.tree_map(jnp.copy, v), args.calls, args.repeats)
                print(
                    f"context {context:6d}  paged {fmt:4s}  splits {splits or 'default':>7}  warps {warps or 'default':>7}"
                    f"  stages {stages}  {us:8.1f} us",
                    flush=True,
                )
        cache = jax.random.normal(key, (b, capacity, KV_HEADS, HEAD_DIM), jnp.bfloat16)

        def dense(q: jax.Array, kn: jax.Array, vn: jax.Array, k: jax.Array, v: jax.Array) -> Any:
            return dense_triton.append_decode_attention(
                q, kn, vn, k, v, positions, inv_freq=INV_FREQ, sliding_window=None, soft_cap=None, scale=HEAD_DIM**-0.5
            )

        us = per_call_us(dense, q, new, cache, jnp.copy(cache), args.calls, args.repeats)
        print(f"context {context:6d}  dense bf16  splits default  {us:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
