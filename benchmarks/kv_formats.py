"""End to end, every KV format side by side: ms per decode step and time to first token.

The table of the KV-format performance goals: ``Generator.batch_generate`` on random bfloat16 weights
(Llama-3-8B shape by default), ``--batch`` rows of a ``--prompt-tokens`` prompt, ``--new-tokens`` new
tokens, for the dense bf16 cache and paged pools in bf16, fp8, q4 and q3, one process, one after the
other. Per format: ms per decode step (wall time of N new tokens minus 1, over N - 1 steps, median of
``--runs`` after a warm-up that compiles), time to first token (the 1-token generation: the prefill of
every row), both as ratios to the dense bf16 cache, and the KV bytes the format holds for the batch.
Each paged pool gets the pages the batch needs (with 10 % to spare), nothing more.

    python benchmarks/kv_formats.py                                   # Llama-3-8B, batch 8, 8,000-token prompt
    python benchmarks/kv_formats.py --prompt-tokens 512               # where KV bytes are negligible
    python benchmarks/kv_formats.py --shape smollm2 --formats dense-bf16 paged-q4
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import SHAPES, per_token_s, prompt_ids, random_bf16_model  # noqa: E402

FORMATS = ("dense-bf16", "paged-bf16", "paged-fp8", "paged-q4", "paged-q3")
PAGE_SIZE = 16


def run_format(model: Any, name: str, batch: int, prompt_tokens: int, new_tokens: int, runs: int) -> dict[str, Any]:
    from zgen import Generator, Request, SamplingConfig
    from zgen.cache.factory import cache_kind, kv_dtype, paged_kv
    from zgen.cache.formats import bytes_per_token_per_layer

    kind, storage = name.split("-")
    c = model.config
    tokens = batch * (prompt_tokens + new_tokens + PAGE_SIZE)
    kv_bytes = tokens * c.num_layers * bytes_per_token_per_layer(storage, c.num_kv_heads, c.head_dim, PAGE_SIZE)
    options = (cache_kind("tensor"),) if kind == "dense" else (paged_kv(1.1 * kv_bytes / 2**20, PAGE_SIZE), kv_dtype(storage))
    gen = Generator(model, *options, max_batch_size=batch)
    prompt = prompt_ids(prompt_tokens)

    def generate(n: int) -> Any:
        return gen.batch_generate([Request(prompt, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True))] * batch)

    step_s = per_token_s(generate, new_tokens, runs)
    first_s = statistics.median(min(r.timings.prefill_s for r in generate(1)) for _ in range(runs))
    tokens_out = generate(new_tokens)[0].token_ids
    gen.close()
    return {"format": name, "ms_per_step": step_s * 1e3, "ttft_s": first_s, "kv_gb": kv_bytes / 1e9, "token_ids": tokens_out[:16]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import jax

    model = random_bf16_model(args.shape)
    rows = []
    for name in args.formats:
        rows.append(run_format(model, name, args.batch, args.prompt_tokens, args.new_tokens, args.runs))
        gc.collect()
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["format"] == "dense-bf16"), rows[0])
    print(f"\n{jax.devices()[0].device_kind}, {args.shape}, batch {args.batch}, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens")
    print(f"| cache | ms/step | vs {base['format']} | time to first token (s) | vs {base['format']} | KV GB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['format']} | {r['ms_per_step']:.2f} | {r['ms_per_step'] / base['ms_per_step']:.2f} | "
              f"{r['ttft_s']:.2f} | {r['ttft_s'] / base['ttft_s']:.2f} | {r['kv_gb']:.2f} |")


if __name__ == "__main__":
    main()
