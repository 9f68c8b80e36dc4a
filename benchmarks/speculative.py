"""Speculative decoding: plain greedy decode vs each speculator, batch 1 and 8, in one run.

For every batch size and speculator: tokens/s of the whole generation (wall time of
``batch_generate``, median of ``--runs`` after a warm-up that compiles), the speedup over plain
decoding of the same requests, the acceptance figures (drafted, accepted, acceptance rate, mean
accepted per verification pass) and a check that the greedy tokens equal plain decoding's token for
token (``same``: False marks a bug, or a near-tie flipped by bf16 rounding in a longer verification
pass; run ``--dtype float32`` to tell them apart).

The prompt set mixes chat questions, code, and summarising a given passage (where prompt lookup
should pay). With random weights (the default: SmolLM2's shape, no checkpoint needed) the timings of
the loop are real but acceptance is not meaningful (a random model's early layers predict nothing and
its text does not quote the prompt); pass a model (``--model smollm2``, a .gguf path or an HF
directory) for real acceptance.

    python benchmarks/speculative.py                                   # random SmolLM2 shape
    python benchmarks/speculative.py --model smollm2 --new-tokens 128  # the real GGUF weights
    python benchmarks/speculative.py --model /path/SmolLM2-135M-Instruct.Q4_1.gguf --speculators prompt-lookup early-exit:8
    python benchmarks/speculative.py --speculators draft:smollm2 --kv-dtype fp8 --json
    python benchmarks/speculative.py --model smollm2 --speculators prompt-lookup jacobi jacobi:adaptive

``jacobi`` is Jacobi (lookahead) decoding with its default fixed draft width (every pass verifies
``--num-draft-tokens`` guesses, default 8); ``jacobi:adaptive`` adds the adaptive draft length and
fallback to plain decoding. ``eagle:DIR`` drafts with the EAGLE head in DIR (trained for the same
model and weights, e.g. by ``benchmarks/eagle.py --out DIR``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import SHAPES  # noqa: E402 - the shapes every benchmark shares

if TYPE_CHECKING:
    from zgen import GenerationResult, Generator, Model
    from zgen.speculative import Speculator

PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin spans seven "
    "million square kilometres, of which five and a half million are covered by the rainforest. The "
    "region includes territory belonging to nine nations. The majority of the forest is contained within "
    "Brazil, with sixty percent of the rainforest, followed by Peru with thirteen percent and Colombia "
    "with ten percent. The rainforest represents over half of the planet's remaining rainforests and is "
    "the largest and most biodiverse tract of tropical rainforest in the world."
)
PROMPTS = {
    "chat": "What are three good habits for staying healthy? Answer briefly.",
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "summary": f"Summarise this passage in three sentences, quoting its figures:\n\n{PASSAGE}",
    "summary-2": f"Rewrite this passage in plain words, keeping every number:\n\n{PASSAGE}",
}


def load(args: argparse.Namespace) -> Model:
    from zgen import ModelConfig, load_model
    from zgen.model import random_model

    if args.model is None:
        config = ModelConfig.from_hf({**SHAPES["smollm2"], "model_type": "llama", "rms_norm_eps": 1e-5})
        return random_model(config, dtype=args.dtype)
    return load_model(args.model, dtype=args.dtype)


def prompts(model: Model, batch: int, real: bool) -> list[Any]:
    """``batch`` prompts cycling over the set: chat messages with real weights (text where the model
    has no chat template); with random weights, token ids of the same lengths whose passage repeats
    (the random tokenizer knows no words)."""
    names = list(PROMPTS)
    chosen = [names[i % len(names)] for i in range(batch)]
    if real:
        if model.tokenizer.chat_template is None:
            return [PROMPTS[name] for name in chosen]
        return [[{"role": "user", "content": PROMPTS[name]}] for name in chosen]
    vocab = model.config.vocab_size
    out = []
    for i, name in enumerate(chosen):
        passage = [(1000 + 37 * j + 11 * i) % vocab for j in range(len(PROMPTS[name].split()) * 2)]
        out.append(passage + passage[: len(passage) // 3])
    return out


def speculator(spec: str, model: Model, args: argparse.Namespace) -> Speculator:
    from zgen import load_model
    from zgen.speculative import DraftModel, Eagle, Jacobi, PromptLookup

    kind, _, value = spec.partition(":")
    if kind == "prompt-lookup":
        return PromptLookup(num_tokens=args.num_draft_tokens or 8)
    if kind == "early-exit":
        return DraftModel.early_exit(model, layers=int(value or 8), num_tokens=args.num_draft_tokens or 4)
    if kind == "draft":
        return DraftModel(load_model(value, dtype=args.dtype), args.num_draft_tokens or 4)
    if kind == "eagle" and value:
        return Eagle.load(value, model, args.num_draft_tokens or 4)
    if kind == "jacobi" and value in ("", "adaptive"):
        return Jacobi(args.num_draft_tokens or 8, adaptive=value == "adaptive")
    raise SystemExit(f"unknown speculator {spec!r}: prompt-lookup, early-exit:N, draft:MODEL, eagle:DIR, jacobi or jacobi:adaptive")


def timed(generator: Generator, requests: list[Any], runs: int) -> tuple[float, list[GenerationResult]]:
    generator.batch_generate(requests)  # compiles
    times, results = [], []
    for _ in range(runs):
        start = time.perf_counter()
        results = generator.batch_generate(requests)
        times.append(time.perf_counter() - start)
    return statistics.median(times), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="built-in name, .gguf or HF directory (default: random SmolLM2 shape)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--speculators", nargs="+", default=["prompt-lookup", "early-exit:8"])
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--kv-cache", default=None, help="cache kind (tensor, flat, paged, tiered)")
    parser.add_argument("--kv-dtype", default=None, help="KV format (fp32, bf16, fp16, fp8, q4, q3)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")
    args = parser.parse_args()

    import jax

    from zgen import Generator, Request, SamplingConfig
    from zgen.cache.factory import cache_kind, kv_dtype

    model = load(args)
    options = ([cache_kind(args.kv_cache)] if args.kv_cache else []) + ([kv_dtype(args.kv_dtype)] if args.kv_dtype else [])
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    speculators = {spec: speculator(spec, model, args) for spec in args.speculators}
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        requests = [Request(p, sampling) for p in prompts(model, batch, real=args.model is not None)]
        base_s, base = timed(Generator(model, *options, max_batch_size=max(batch, 1)), requests, args.runs)
        tokens = sum(len(r.token_ids) for r in base)
        rows.append(dict(batch=batch, speculator="plain", tokens_per_s=tokens / base_s, speedup=1.0, same=True))
        for name, spec in speculators.items():
            seconds, results = timed(Generator(model, *options, max_batch_size=max(batch, 1), speculative=spec), requests, args.runs)
            stats = [r.speculative for r in results if r.speculative is not None]
            drafted, accepted, passes = (sum(getattr(s, f) for s in stats) for f in ("draft_tokens", "accepted_tokens", "steps"))
            rows.append(dict(
                batch=batch, speculator=name, tokens_per_s=tokens / seconds, speedup=base_s / seconds,
                same=[r.token_ids for r in results] == [r.token_ids for r in base],
                draft_tokens=drafted, accepted_tokens=accepted,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                mean_accepted_per_step=accepted / passes if passes else 0.0,
            ))
    report = dict(device=str(jax.devices()[0]), model=args.model or "random smollm2 shape", dtype=args.dtype,
                  new_tokens=args.new_tokens, kv_cache=args.kv_cache, kv_dtype=args.kv_dtype, rows=rows)
    if not args.json:
        print(f"{report['device']}  {report['model']}  {args.dtype}  {args.new_tokens} new tokens")
        print(f"{'batch':>5} {'speculator':<16} {'tok/s':>9} {'speedup':>8} {'accept':>7} {'acc/pass':>8} same")
        for row in rows:
            print(f"{row['batch']:>5} {row['speculator']:<16} {row['tokens_per_s']:>9.1f} {row['speedup']:>7.2f}x "
                  f"{row.get('acceptance_rate', 0.0):>7.2f} {row.get('mean_accepted_per_step', 0.0):>8.2f} {row['same']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
