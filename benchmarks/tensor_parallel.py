"""Decode on N GPUs with tensor parallelism vs one GPU (random weights, same run, same attention kernels).

For each batch size, the same greedy requests on the model as it is (one device) and split over
``--devices`` local devices (``zgen.model.split_model``: heads and MLP columns on a ``"tp"`` mesh
axis; each layer's KV write and attention run per device in ``shard_map``, so both runs use the same
kernels); ms per decode step by the method of ``gpu_decode.py`` (generate(N) − generate(1), median
after warm-up, EOS ignored), and whether the greedy tokens agree (in bfloat16 they may not: the
all-reduce sums in another order). The output names the attention path both runs took and counts
the collectives in the split model's compiled steps (two all-reduces per layer, nothing gathered).

    python benchmarks/tensor_parallel.py --shape llama3-8b --devices 2                          # 2 x H100, dense cache (flash kernels)
    python benchmarks/tensor_parallel.py --shape llama3-8b --devices 2 --kv-cache paged         # the paged kernel (bf16 pages)
    python benchmarks/tensor_parallel.py --shape llama3-8b --devices 2 --attention einsum       # the XLA path, for comparison
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/tensor_parallel.py --shape tiny --devices 2 \\
        --batch 1 4 --new-tokens 4 --runs 1 --dtype float32 --attention triton                  # a CPU smoke run (kernels interpreted)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).parent))
from gpu_decode import SHAPES as GPU_SHAPES, prompt_ids  # noqa: E402  (benchmarks/ is on sys.path when this script runs)

SHAPES: dict[str, dict[str, Any]] = {
    **GPU_SHAPES,
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False),
}
PAGE_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache", choices=["tensor", "paged"], default="tensor")
    parser.add_argument("--kv-dtype", default=None, help="The paged cache's page format (bf16, fp8, q4, q3); default: the model's dtype.")
    parser.add_argument(
        "--attention", default="auto",
        help="tensor: auto, einsum, xla, triton (zgen.cache.tensor.DenseAttention); paged: auto or a paged_attention implementation.",
    )
    args = parser.parse_args()

    import jax

    from zgen import Generator, ModelConfig, Request, SamplingConfig
    from zgen.cache.factory import CacheOption, dense_attention, kv_dtype, paged_kv
    from zgen.cache.formats import bytes_per_token_per_layer, empty_pages, kv_dtype_of, kv_format
    from zgen.cache.tensor import DenseAttention, dense_attention_path
    from zgen.model import random_model, split_model
    from zgen.pallas.paged_attention.api import default_implementation

    config = ModelConfig.from_hf({**SHAPES[args.shape], "model_type": "llama", "rms_norm_eps": 1e-5})
    one = random_model(config, dtype=args.dtype)
    split = split_model(one, args.devices)
    prompt = prompt_ids(args.prompt_tokens)
    if args.kv_cache == "tensor":
        attention = f"flash_attention/{dense_attention_path(cast(DenseAttention, args.attention))} (dense cache)"
    else:
        pages = kv_dtype_of(one.dtype) if args.kv_dtype is None else args.kv_dtype
        sample = empty_pages(pages, 1, 1, PAGE_SIZE, config.head_dim)
        chosen = default_implementation(sample, False, config.sliding_window, kv_format(pages).coded) if args.attention == "auto" else args.attention
        attention = f"paged_attention/{chosen} ({pages} pages)"
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        if args.kv_cache == "tensor":
            options: list[CacheOption] = [dense_attention(cast(DenseAttention, args.attention))]
        else:
            tokens = batch * (args.prompt_tokens + args.new_tokens + PAGE_SIZE)  # every row's pages, one to spare
            per_layer = bytes_per_token_per_layer(pages, config.num_kv_heads, config.head_dim, PAGE_SIZE)
            budget_mb = max(64.0, 1.25 * tokens * config.num_layers * per_layer / 2**20)
            options = [paged_kv(budget_mb, PAGE_SIZE, None if args.attention == "auto" else args.attention), kv_dtype(pages)]
        row: dict[str, Any] = {"batch": batch}
        token_ids = {}
        for name, model in (("1 device", one), (f"{args.devices} devices", split)):
            generator = Generator(model, *options, max_batch_size=batch)

            def generate(n: int, generator: Generator = generator) -> Any:
                request = Request(prompt, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                return generator.batch_generate([request] * batch)[0]

            def timed(n: int) -> float:
                start = time.perf_counter()
                generate(n)
                return time.perf_counter() - start

            for n in (args.new_tokens, 1):
                timed(n)  # compile both lengths
            full = statistics.median(timed(args.new_tokens) for _ in range(args.runs))
            first = statistics.median(timed(1) for _ in range(args.runs))
            ms = (full - first) / (args.new_tokens - 1) * 1e3
            row[name] = {"ms_per_step": ms, "tok_s": batch * 1e3 / ms}
            token_ids[name] = generate(args.new_tokens).token_ids
            generator.close()
        row["speedup"] = row["1 device"]["ms_per_step"] / row[f"{args.devices} devices"]["ms_per_step"]
        row["same_greedy_tokens"] = len(set(map(tuple, token_ids.values()))) == 1
        rows.append(row)
    print(json.dumps({
        "device": str(jax.devices()[0].device_kind), "shape": args.shape, "dtype": args.dtype,
        "attention": f"{attention}; split model: per device in shard_map over the heads",
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "results": rows,
        "split_collectives": collectives(split, config.num_layers),
    }, indent=2))


def collectives(model: Any, layers: int) -> dict[str, Any]:
    """Per kind of compiled step of the split model, each distinct count: all-reduces per layer (2:
    attention and MLP; XLA may combine some) and the collectives that gather or move data (0 when
    attention ran on each device's own heads)."""
    from zgen.runtime.runner import runner_for

    counts: dict[str, list[dict[str, float]]] = {}
    for key, compiled in runner_for(model)._executables.items():
        text = compiled.as_text()
        count = {
            "all_reduce_per_layer": len(re.findall(r"all-reduce(?:-start)?\(", text)) / layers,
            "gathers": len(re.findall(r"all-gather(?:-start)?\(|all-to-all\(|collective-permute(?:-start)?\(", text)),
        }
        if count not in counts.setdefault(str(key[0]), []):
            counts[str(key[0])].append(count)
    return counts


if __name__ == "__main__":
    main()
