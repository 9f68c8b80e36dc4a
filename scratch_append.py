"""Scratch: the paged one-kernel decode step's launch variants against the dense one (not committed)."""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from zgen.pallas.paged_attention import triton as pt
from zgen.pallas.flash_attention import triton as ft

b, h, kvh, d, ps = int(sys.argv[1]), 32, 8, 128, 64
ctxs = [int(x) for x in sys.argv[2:]] or [8000]
inv = 500000.0 ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
key = jax.random.key(0)
for ctx in ctxs:
    cap = -(-(ctx + 64) // 128) * 128
    pps = cap // ps
    q = jax.random.normal(key, (b, 1, h, d), jnp.bfloat16)
    kn = jax.random.normal(key, (b, 1, kvh, d), jnp.bfloat16)
    tables = jnp.asarray(np.random.default_rng(0).permutation(b * pps).reshape(b, pps), jnp.int32)
    pos = jnp.full((b, 1), ctx, jnp.int32)

    def timeit(step, k, v, n=10, inner=64):
        def many(q, k, v):
            def body(i, c):
                q, k, v = c
                out, k, v = step(q, kn, kn, k, v)
                return out.astype(q.dtype), k, v
            return jax.lax.fori_loop(0, inner, body, (q, k, v))
        fn = jax.jit(many, donate_argnums=(1, 2))
        out, k, v = fn(q, k, v); out.block_until_ready()
        best = []
        for _ in range(n):
            t = time.perf_counter()
            out, k, v = fn(q, k, v)
            out.block_until_ready()
            best.append((time.perf_counter() - t) / inner * 1e6)
        return sorted(best)[len(best) // 2]

    for splits in (None, 8, 4, 2):
        for stages, warps in ((3, 4), (2, 4), (3, 8)):
            k = jax.random.normal(key, (kvh, b * pps, ps, d), jnp.bfloat16); v = k + 1
            fn = lambda q, kn, vn, k, v, s=splits, st=stages, w=warps: pt.append_decode_attention(
                q, kn, vn, k, v, tables, pos, inv_freq=inv, sliding_window=None, soft_cap=None, scale=d**-0.5,
                num_splits=s, num_stages=st, num_warps=w)
            print(f"ctx {ctx} paged splits {splits} stages {stages} warps {warps}: {timeit(fn, k, v):.1f} us", flush=True)
            del k, v
    for splits in (None, 16):
        k = jax.random.normal(key, (b, cap, kvh, d), jnp.bfloat16); v = k + 1
        fn = lambda q, kn, vn, k, v, s=splits: ft.append_decode_attention(
            q, kn, vn, k, v, pos, inv_freq=inv, sliding_window=None, soft_cap=None, scale=d**-0.5, num_splits=s)
        print(f"ctx {ctx} dense splits {splits}: {timeit(fn, k, v):.1f} us", flush=True)
        del k, v
