"""zgen vs HF transformers on this CPU: SmolLM2-135M-Instruct, float32, batch 1, same process.

Decode: tokens/s of a 128-token greedy continuation (EOS ignored), prefill excluded.
Prefill: tokens/s of one 512-token prompt, twice: with the logits of every position (zgen's
``Generator.logits``, HF's plain forward) and to the first token (the last position's logits only:
zgen's ``generate`` of one token, HF's forward with ``logits_to_keep=1``), which is what a generation
pays. Each number is the median of several runs after warm-up.

    python benchmarks/cpu_decode.py [--runs 5] [--new-tokens 128] [--dense-attention xla]

``--dense-attention`` picks the tensor cache's attention (default "auto": on CPU the einsum for decode
and "xla", the blocked online-softmax path that skips key blocks no query can see, for prefill).

``--kv-formats``: instead, every KV storage format of zgen side by side (no HF): the dense ("tensor")
cache in fp32, bf16 and fp16 and the paged cache (default 512 MB pool) in every format, each answering
the same short prompt with ``--new-tokens`` greedy tokens (32 is the usual answer). The rounds
interleave the formats, so load from other processes spreads over all of them; each line gives the
median decode ms/token, the median time of the whole answer (prefill included) and both against the
default cache (tensor fp32), and whether its tokens equal the default's.

    python benchmarks/cpu_decode.py --kv-formats --new-tokens 32 --runs 5
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
from zgen.cache.factory import CacheOption, cache_kind, dense_attention, kv_dtype
from zgen.loading.builtin import builtin_model_path
from zgen.model import Model

# (label, cache options): the first is the baseline every other line is compared with.
KV_FORMAT_CACHES: tuple[tuple[str, tuple[CacheOption, ...]], ...] = (
    ("tensor fp32 (default)", ()),
    ("tensor bf16", (kv_dtype("bf16"),)),
    ("tensor fp16", (kv_dtype("fp16"),)),
    *((f"paged {name}", (cache_kind("paged"), kv_dtype(name))) for name in ("fp32", "bf16", "fp16", "fp8", "q4", "q3")),
)


def median_time(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up: compilation, caches
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kv_formats(model: Model, prompt: list[int], sampling: SamplingConfig, runs: int) -> list[dict[str, object]]:
    """Decode ms/token and answer time of every cache in KV_FORMAT_CACHES, rounds interleaved."""
    generators = {label: Generator(model, *options) for label, options in KV_FORMAT_CACHES}
    tokens = {label: gen.generate(prompt, sampling).token_ids for label, gen in generators.items()}  # warm-up
    decode: dict[str, list[float]] = {label: [] for label in generators}
    total: dict[str, list[float]] = {label: [] for label in generators}
    for _ in range(runs):
        for label, gen in generators.items():
            start = time.perf_counter()
            result = gen.generate(prompt, sampling)
            total[label].append(time.perf_counter() - start)
            decode[label].append(result.timings.decode_s / len(result.token_ids))
    base = KV_FORMAT_CACHES[0][0]
    base_decode, base_total = statistics.median(decode[base]), statistics.median(total[base])
    rows = []
    for label in generators:
        d, t = statistics.median(decode[label]), statistics.median(total[label])
        rows.append({
            "cache": label, "decode_ms_per_token": 1e3 * d, "decode_vs_default": d / base_decode,
            "answer_ms": 1e3 * t, "answer_vs_default": t / base_total, "same_tokens": tokens[label] == tokens[base],
        })
    for gen in generators.values():
        gen.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--kv-formats", action="store_true", help="every KV format side by side instead (no HF)")
    parser.add_argument("--dense-attention", default="auto", choices=["auto", "einsum", "xla"])
    args = parser.parse_args()
    n_new, n_prompt = args.new_tokens, args.prefill_tokens

    model = load_model("smollm2", dtype="float32")
    if args.kv_formats:
        rng = np.random.default_rng(0)
        short = rng.integers(100, model.config.vocab_size, size=16).tolist()
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=n_new, ignore_eos=True)
        print(f"{'cache':<22} {'decode ms/tok':>13} {'x default':>9} {'answer ms':>9} {'x default':>9}  same tokens")
        for row in kv_formats(model, short, sampling, args.runs):
            print(f"{row['cache']:<22} {row['decode_ms_per_token']:>13.2f} {row['decode_vs_default']:>9.2f} "
                  f"{row['answer_ms']:>9.1f} {row['answer_vs_default']:>9.2f}  {row['same_tokens']}")
        return
    gen = Generator(model, dense_attention(args.dense_attention))
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, model.config.vocab_size, size=n_prompt).tolist()
    short = prompt[:16]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=n_new, ignore_eos=True)

    def zgen_decode_s() -> float:
        return gen.generate(short, sampling).timings.decode_s

    zgen_decode_s()
    zgen_decode = statistics.median(zgen_decode_s() for _ in range(args.runs)) / n_new
    zgen_prefill = median_time(lambda: gen.logits(prompt)[-1], args.runs) / n_prompt
    first = SamplingConfig(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    zgen_first = median_time(lambda: gen.generate(prompt, first), args.runs) / n_prompt

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
        hf_first = median_time(lambda: hf(long_ids, logits_to_keep=1).logits.argmax(-1), args.runs) / n_prompt

    result = {
        "device": f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)",
        "zgen_decode_tok_s": 1 / zgen_decode,
        "hf_decode_tok_s": 1 / hf_decode,
        "decode_ratio": hf_decode / zgen_decode,
        "zgen_prefill_tok_s": 1 / zgen_prefill,
        "hf_prefill_tok_s": 1 / hf_prefill,
        "prefill_ratio": hf_prefill / zgen_prefill,
        "zgen_prefill_first_token_tok_s": 1 / zgen_first,
        "hf_prefill_first_token_tok_s": 1 / hf_first,
        "prefill_first_token_ratio": hf_first / zgen_first,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
