"""Decode speed with LoRA adapters: no adapter vs one vs a batch of rows with different adapters.

Random weights of the SmolLM2-135M shape (or Llama-3-8B) in bfloat16 and random rank-16 adapters on
q/k/v/o/gate/up/down, so nothing has to be downloaded. All cases run in one process on one
Generator (dense cache), timed the same way: wall time of generate(N new tokens) minus generate(1),
over N − 1 tokens, median of several runs after warm-up, EOS never stops early.

* ``base-b1`` / ``lora-b1``: batch 1 without / with one adapter (the per-row gathered correction);
* ``merged-b1``: batch 1 with the adapter merged into the weights (should equal ``base-b1``);
* ``base-b8`` / ``lora4-b8``: 8 rows without adapters / with 4 different adapters (2 rows each), the
  S-LoRA/Punica case: one step, each row gathering its own adapter.

Ratios against the matching base case are printed with the device name, JSON at the end.

    python benchmarks/lora.py                        # SmolLM2 shape, rank 16
    python benchmarks/lora.py --shape llama3-8b --rank 16 --new-tokens 128
    python benchmarks/lora.py --shape tiny --dtype float32 --new-tokens 8 --runs 1   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import SHAPES as GPU_SHAPES, per_token_s  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    **GPU_SHAPES,
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    import jax

    from zgen import Generator, ModelConfig, Request, SamplingConfig
    from zgen.lora import random_adapter
    from zgen.model import random_model

    config = ModelConfig.from_hf({**SHAPES[args.shape], "model_type": "llama", "rms_norm_eps": 1e-5})
    model = random_model(config, dtype=args.dtype)
    adapters = [random_adapter(config, args.rank, seed=seed) for seed in range(4)]
    generator = Generator(model, max_batch_size=8)
    prompt = [100 + i % 400 for i in range(args.prompt_tokens)]

    def case(rows: list[Any]) -> Callable[[int], object]:
        def generate(n: int) -> object:
            sampling = SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True)
            return generator.batch_generate([Request(prompt, sampling, adapter=adapter) for adapter in rows])

        return generate

    results: dict[str, float] = {}
    for name, rows in [
        ("base-b1", [None]),
        ("lora-b1", [adapters[0]]),
        ("base-b8", [None] * 8),
        ("lora4-b8", [adapters[i % 4] for i in range(8)]),
    ]:
        results[name] = per_token_s(case(rows), args.new_tokens, args.runs) * 1e3
        print(f"{name:>10}: {results[name]:.3f} ms/step", flush=True)
    model.merge_adapter(adapters[0])
    results["merged-b1"] = per_token_s(case([None]), args.new_tokens, args.runs) * 1e3
    print(f"{'merged-b1':>10}: {results['merged-b1']:.3f} ms/step", flush=True)
    model.unmerge_adapter()

    ratios = {
        "lora-b1/base-b1": results["lora-b1"] / results["base-b1"],
        "merged-b1/base-b1": results["merged-b1"] / results["base-b1"],
        "lora4-b8/base-b8": results["lora4-b8"] / results["base-b8"],
    }
    for name, ratio in ratios.items():
        print(f"{name:>18}: {ratio:.3f}x")
    print(json.dumps({
        "device": jax.devices()[0].device_kind, "shape": args.shape, "dtype": args.dtype, "rank": args.rank,
        "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens, "ms_per_step": results, "ratios": ratios,
    }))


if __name__ == "__main__":
    main()
