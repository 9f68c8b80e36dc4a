"""zgen vs HF transformers on this CPU: SmolLM2-135M-Instruct, float32, batch 1, same process.

Decode: tokens/s of a 128-token greedy continuation (EOS ignored), prefill excluded.
Prefill: tokens/s of one 512-token prompt. Each number is the median of several runs after warm-up.

    python benchmarks/cpu_decode.py [--runs 5] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import transformers

from zgen import Generator, SamplingConfig, load_model
from zgen.loading.builtin import builtin_model_path


def median_time(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up: compilation, caches
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    args = parser.parse_args()
    n_new, n_prompt = args.new_tokens, args.prefill_tokens

    model = load_model("smollm2", dtype="float32")
    gen = Generator(model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, model.config.vocab_size, size=n_prompt).tolist()
    short = prompt[:16]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=n_new, ignore_eos=True)

    def zgen_decode_s() -> float:
        return gen.generate(short, sampling).timings.decode_s

    zgen_decode_s()
    zgen_decode = statistics.median(zgen_decode_s() for _ in range(args.runs)) / n_new
    zgen_prefill = median_time(lambda: gen.logits(prompt)[-1], args.runs) / n_prompt

    path = builtin_model_path("smollm2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([short])

    def hf_generate(new: int) -> None:
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)

    # HF decode time per token: (generate N) − (generate 1) removes the prefill and setup.
    hf_decode = (median_time(lambda: hf_generate(n_new), args.runs) - median_time(lambda: hf_generate(1), args.runs)) / (n_new - 1)
    with torch.no_grad():
        long_ids = torch.tensor([prompt])
        hf_prefill = median_time(lambda: hf(long_ids), args.runs) / n_prompt

    result = {
        "device": f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)",
        "zgen_decode_tok_s": 1 / zgen_decode,
        "hf_decode_tok_s": 1 / hf_decode,
        "decode_ratio": hf_decode / zgen_decode,
        "zgen_prefill_tok_s": 1 / zgen_prefill,
        "hf_prefill_tok_s": 1 / hf_prefill,
        "prefill_ratio": hf_prefill / zgen_prefill,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
