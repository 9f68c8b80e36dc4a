"""End to end, every KV format side by side: ms per decode step and time to first token.

The table of the KV-format performance goals: ``Generator.batch_generate`` on random bfloat16 weights
(Llama-3-8B shape by default), ``--batch`` rows of a ``--prompt-tokens`` prompt, ``--new-tokens`` new
tokens, for the dense bf16 cache and paged pools in bf16, fp8, q4 and q3, one process, one after the
other. Per format: ms per decode step (wall time of N new tokens minus 1, over N - 1 steps, median of
``--runs`` after a warm-up that compiles), time to first token (the 1-token generation: the prefill of
every row), both as ratios to the dense bf16 cache, and the KV bytes the format holds for the batch.
Each paged pool gets the pages the batch needs (with 10 % to spare), nothing more.

``--capacity-gb X`` is the capacity run instead: every paged format gets a pool of X GB and runs at the
largest batch that pool admits for the prompt and new tokens (the pool's own block count over each
row's blocks), so a smaller format runs more rows; the table gives each format's batch and its decode
tokens/s (rows over ms per step), both against the first format's. A capacity run's prefill is every
row of a long context (30 rows of 32,000 tokens: 960,000 tokens), so each format runs *one*
generation: its decode loops hand back to the host every 8 tokens, and ms per step is the wall time
of those loops with every row in them over their steps, the first loop (which compiles) left out;
its first-token time includes compiling the prefill.

    python benchmarks/kv_formats.py                                   # Llama-3-8B, batch 8, 8,000-token prompt
    python benchmarks/kv_formats.py --prompt-tokens 512               # where KV bytes are negligible
    python benchmarks/kv_formats.py --shape smollm2 --formats dense-bf16 paged-q4
    python benchmarks/kv_formats.py --capacity-gb 40 --prompt-tokens 32000 --formats paged-bf16 paged-q4

``--trace-kernels N`` also prints, per format, the N kernels that take the most time in a decode step
(``kernel_trace.py``: launches and µs per step, from a profile of the same generations).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import SHAPES, prompt_ids, random_shape_model, time_generations  # noqa: E402
from kernel_trace import decode_step_kernels  # noqa: E402

FORMATS = ("dense-bf16", "paged-bf16", "paged-fp8", "paged-q4", "paged-q3")


def admitted_rows(model: Any, name: str, pool_gb: float, tokens_per_row: int, page_size: int) -> int:
    """Rows of ``tokens_per_row`` a pool of ``pool_gb`` GB in this paged format holds (its own block count)."""
    from zgen.cache.block_pool import BlockPool, blocks_for
    from zgen.cache.page_store import PagedConfig

    c = model.config
    config = PagedConfig(c.num_layers, c.num_kv_heads, c.head_dim, page_size, name.split("-")[1])
    blocks = BlockPool.blocks_in_budget(pool_gb * 1e9 / 2**20, config.bytes_per_token * page_size, page_size)
    return blocks // blocks_for(tokens_per_row, page_size)


@contextlib.contextmanager
def decode_loops(record: list[tuple[int, int, float]]) -> Iterator[None]:
    """Record each engine decode loop run inside: (rows in it, steps it ran, wall seconds)."""
    from zgen.runtime.engine import Engine

    run = Engine._run_decode  # pyright: ignore[reportPrivateUsage]

    def timed(self: Engine, rows: list[Any], steps: int, **options: Any) -> None:
        passes, start = self.stats.forward_passes, time.perf_counter()
        run(self, rows, steps, **options)
        record.append((len(rows), self.stats.forward_passes - passes, time.perf_counter() - start))

    Engine._run_decode = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        Engine._run_decode = run  # type: ignore[method-assign]


def full_batch_step_s(loops: list[tuple[int, int, float]], batch: int) -> float:
    """Seconds per decode step over the loops that ran every row, the first (compiling) one left out."""
    full = [(steps, seconds) for rows, steps, seconds in loops if rows == batch and steps > 0][1:]
    if not full:
        raise SystemExit(f"fewer than two decode loops ran all {batch} rows: raise --new-tokens (loops take 8 tokens)")
    return sum(seconds for _, seconds in full) / sum(steps for steps, _ in full)


def run_format(
    model: Any,
    name: str,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    runs: int,
    page_size: int,
    pool_gb: float | None = None,
    trace_kernels: int = 0,
) -> dict[str, Any]:
    """One format's decode step and first-token time; a paged pool of ``pool_gb`` GB, or (None) of what
    the batch needs with 10 % to spare; with ``trace_kernels``, that many of the decode step's costliest kernels."""
    from zgen import Generator, Request, SamplingConfig
    from zgen.cache.factory import cache_kind, kv_dtype, paged_kv
    from zgen.cache.formats import bytes_per_token_per_layer

    kind, storage = name.split("-")
    c = model.config
    tokens = batch * (prompt_tokens + new_tokens + page_size)
    kv_bytes = tokens * c.num_layers * bytes_per_token_per_layer(storage, c.num_kv_heads, c.head_dim, page_size)
    pool_mb = 1.1 * kv_bytes / 2**20 if pool_gb is None else pool_gb * 1e9 / 2**20
    options = (cache_kind("tensor"),) if kind == "dense" else (paged_kv(pool_mb, page_size), kv_dtype(storage))
    gen = Generator(model, *options, max_batch_size=batch)
    prompt = prompt_ids(prompt_tokens)

    def generate(n: int, stop: tuple[str, ...] = ()) -> Any:
        config = SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True, stop=stop)
        return gen.batch_generate([Request(prompt, config)] * batch)

    if pool_gb is None:
        timing = time_generations(generate, new_tokens, runs)
        step_s = timing.per_token_s
        first_s = statistics.median(min(r.timings.prefill_s for r in results) for results in timing.one)
        tokens_out = timing.full[-1][0].token_ids
    else:  # one generation (see the module docstring); a stop string that never matches syncs every 8 tokens
        loops: list[tuple[int, int, float]] = []
        with decode_loops(loops):
            results = generate(new_tokens, stop=("<never matched>",))
        step_s = full_batch_step_s(loops, batch)
        first_s = min(r.timings.prefill_s for r in results)
        tokens_out = results[0].token_ids
    kernels = decode_step_kernels(generate, new_tokens, trace_kernels) if trace_kernels else []
    gen.close()
    return {
        "format": name, "batch": batch, "ms_per_step": step_s * 1e3, "tok_s": batch / step_s, "ttft_s": first_s,
        "kv_gb": kv_bytes / 1e9, "token_ids": tokens_out[:16], "kernels": kernels,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--page-size", type=int, help="tokens per page (default: the platform's, 64 on GPUs)")
    parser.add_argument("--capacity-gb", type=float, help="the capacity run: paged pools of this many GB, each at the batch it admits")
    parser.add_argument("--trace-kernels", type=int, default=0, metavar="N", help="also list each format's N costliest kernels per decode step")
    args = parser.parse_args()

    import jax

    from zgen.cache.factory import default_page_size

    from zgen.pallas.common import platform

    if args.trace_kernels and platform() != "gpu":
        parser.error("--trace-kernels reads a GPU's kernels; run it on a GPU")
    args.page_size = args.page_size or default_page_size()
    model = random_shape_model(args.shape, args.prompt_tokens + args.new_tokens)
    if args.capacity_gb is not None:
        capacity(model, args)
        return
    rows = []
    for name in args.formats:
        rows.append(
            run_format(
                model, name, args.batch, args.prompt_tokens, args.new_tokens, args.runs, args.page_size, trace_kernels=args.trace_kernels
            )
        )
        gc.collect()
        print(json.dumps({key: value for key, value in rows[-1].items() if key != "kernels"}), flush=True)
        print_kernels(rows[-1])
    base = next((r for r in rows if r["format"] == "dense-bf16"), rows[0])
    print(f"\n{jax.devices()[0].device_kind}, {args.shape}, batch {args.batch}, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, pages of {args.page_size}")
    print(f"| cache | ms/step | vs {base['format']} | time to first token (s) | vs {base['format']} | KV GB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['format']} | {r['ms_per_step']:.2f} | {r['ms_per_step'] / base['ms_per_step']:.2f} | "
              f"{r['ttft_s']:.2f} | {r['ttft_s'] / base['ttft_s']:.2f} | {r['kv_gb']:.2f} |")


def print_kernels(row: dict[str, Any]) -> None:
    if row["kernels"]:
        print(f"{row['format']}: the decode step's costliest kernels (launches and µs per step)")
        for k in row["kernels"]:
            print(f"  {k['per_step']:6.1f} x {k['us_per_step']:9.1f} us  {k['kernel'][:100]}")


def capacity(model: Any, args: argparse.Namespace) -> None:
    import jax

    names = [name for name in args.formats if name.startswith("paged-")]
    rows = []
    for name in names:
        batch = admitted_rows(model, name, args.capacity_gb, args.prompt_tokens + args.new_tokens, args.page_size)
        rows.append(
            run_format(
                model, name, batch, args.prompt_tokens, args.new_tokens, args.runs, args.page_size,
                pool_gb=args.capacity_gb, trace_kernels=args.trace_kernels,
            )
        )
        gc.collect()
        print(json.dumps({key: value for key, value in rows[-1].items() if key != "kernels"}), flush=True)
        print_kernels(rows[-1])
    base = rows[0]
    print(f"\n{jax.devices()[0].device_kind}, {args.shape}, pools of {args.capacity_gb:g} GB, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens")
    print(f"| cache | rows admitted | vs {base['format']} | ms/step | decode tok/s | vs {base['format']} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['format']} | {r['batch']} | {r['batch'] / base['batch']:.2f} | {r['ms_per_step']:.2f} | {r['tok_s']:.0f} | {r['tok_s'] / base['tok_s']:.2f} |")


if __name__ == "__main__":
    main()
