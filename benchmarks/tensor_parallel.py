"""Decode on N GPUs with tensor parallelism vs one GPU (random bf16 weights, same run).

For each batch size, the same greedy requests on the model as it is (one device) and split over
``--devices`` local devices (``zgen.model.split_model``: heads and MLP columns on a ``"tp"`` mesh
axis); ms per decode step by the method of ``gpu_decode.py`` (generate(N) − generate(1), median after
warm-up, EOS ignored), and whether the greedy tokens agree.

    python benchmarks/tensor_parallel.py --shape llama3-8b --devices 2 --batch 1 64      # 2 x H100
    python benchmarks/tensor_parallel.py --attention einsum ...                          # the XLA attention path
    XLA_FLAGS=--xla_force_host_platform_device_count=3 python benchmarks/tensor_parallel.py --shape smollm2 --devices 3 \\
        --batch 1 --new-tokens 8 --runs 1 --dtype float32                                # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).parent))
from gpu_decode import SHAPES, prompt_ids  # noqa: E402  (benchmarks/ is on sys.path when this script runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto", help="The dense cache's attention path (auto, einsum, xla, triton).")
    args = parser.parse_args()

    import jax

    from zgen import Generator, ModelConfig, Request, SamplingConfig
    from zgen.cache.factory import dense_attention
    from zgen.cache.tensor import DenseAttention
    from zgen.model import random_model, split_model

    config = ModelConfig.from_hf({**SHAPES[args.shape], "model_type": "llama", "rms_norm_eps": 1e-5})
    one = random_model(config, dtype=args.dtype)
    split = split_model(one, args.devices)
    prompt = prompt_ids(args.prompt_tokens)
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        row: dict[str, Any] = {"batch": batch}
        tokens = {}
        for name, model in (("1 device", one), (f"{args.devices} devices", split)):
            generator = Generator(model, dense_attention(cast(DenseAttention, args.attention)), max_batch_size=batch)

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
            tokens[name] = generate(args.new_tokens).token_ids
        row["speedup"] = row["1 device"]["ms_per_step"] / row[f"{args.devices} devices"]["ms_per_step"]
        row["same_greedy_tokens"] = len(set(map(tuple, tokens.values()))) == 1
        rows.append(row)
    print(json.dumps({"device": str(jax.devices()[0].device_kind), "shape": args.shape, "dtype": args.dtype, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
