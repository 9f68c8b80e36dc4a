"""Engine batching: N contexts generating concurrently vs the same N contexts one after another.

Each context gets its own prompt (``--prompt-tokens`` random ids) and generates ``--new-tokens``
greedy tokens (no early stop). "sequential" runs the contexts' ``generate`` one by one on the same
engine; "concurrent" runs them together through ``zgen.contexts.gather``, so every engine step serves
all of them. Both are timed after a warm-up run of the same shapes (compilation excluded), in the same
process; the outputs of the two modes are compared token for token.

    python benchmarks/contexts.py                                   # SmolLM2 (real weights), CPU
    python benchmarks/contexts.py --random-weights --dtype bfloat16 --n 1 4 16 64   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import jax
import numpy as np

from zgen import Context, Engine, Model, ModelConfig, Sampler, load_model, stop
from zgen.cache.factory import paged_kv
from zgen.contexts import gather
from zgen.model import random_model

from gpu_decode import SHAPES  # benchmarks/ is on sys.path when this script runs

def contexts(engine: Engine, n: int, prompt_tokens: int, seed: int) -> list[Context]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ctx = Context(engine)
        ctx.fill_tokens(rng.integers(100, 20000, prompt_tokens).tolist())
        out.append(ctx)
    return out


def run(engine: Engine, n: int, prompt_tokens: int, new_tokens: int, concurrent: bool) -> tuple[float, int, list[list[int]]]:
    """Seconds, forward passes and generated tokens of one run (fresh contexts, released after)."""
    batch = contexts(engine, n, prompt_tokens, seed=n)
    sampler, limit = Sampler.greedy(), stop.max_len(new_tokens)
    passes = engine.stats.forward_passes
    start = time.perf_counter()
    if concurrent:
        results = gather(*(c.generate_result_async(sampler, limit) for c in batch))
    else:
        results = [c.generate_result(sampler, limit) for c in batch]
    seconds = time.perf_counter() - start
    for c in batch:
        c.release()
    return seconds, engine.stats.forward_passes - passes, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2's shape with random weights")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-memory-mb", type=float, default=512.0)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "contexts.json"))
    args = parser.parse_args()

    model: Model = (
        random_model(ModelConfig.from_hf({**SHAPES["smollm2"], "model_type": "llama", "rms_norm_eps": 1e-5}), dtype=args.dtype)
        if args.random_weights
        else load_model("smollm2", dtype=args.dtype)
    )
    engine = Engine(model, paged_kv(args.max_memory_mb))
    rows: list[dict[str, Any]] = []
    device = jax.devices()[0].device_kind
    for n in args.n:
        row: dict[str, Any] = {"n": n, "device": device, "dtype": args.dtype}
        outputs = {}
        for mode, concurrent in (("sequential", False), ("concurrent", True)):
            run(engine, n, args.prompt_tokens, args.new_tokens, concurrent)  # warm-up: compiles the shapes
            seconds, passes, outputs[mode] = run(engine, n, args.prompt_tokens, args.new_tokens, concurrent)
            row[f"{mode}_s"] = seconds
            row[f"{mode}_tok_s"] = n * args.new_tokens / seconds
            row[f"{mode}_forward_passes"] = passes
        row["speedup"] = row["sequential_s"] / row["concurrent_s"]
        row["identical"] = outputs["sequential"] == outputs["concurrent"]
        row["identical_rows"] = sum(a == b for a, b in zip(outputs["sequential"], outputs["concurrent"]))
        rows.append(row)
        print(
            f"N={n:3d}  sequential {row['sequential_tok_s']:8.1f} tok/s ({row['sequential_forward_passes']} passes)  "
            f"concurrent {row['concurrent_tok_s']:8.1f} tok/s ({row['concurrent_forward_passes']} passes)  "
            f"x{row['speedup']:.2f}  identical rows {row['identical_rows']}/{n}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump({"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
