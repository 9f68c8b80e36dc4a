"""Token-tree speculation: plain greedy decode vs an early-exit draft's chains vs its EAGLE-2 trees.

For every batch size: tokens/s of the whole generation (wall time of ``batch_generate``, median of
``--runs`` rounds that time every side in turn, after warm-ups that compile), the speedup over plain
decoding of the same requests (the median of the rounds' ratios, with their range), the
mean accepted length (tokens accepted per verification pass; each pass also produces one token of the
target's own) and the acceptance rate (for a tree: accepted over the depth it drafted), and a check
that the greedy tokens equal plain decoding's token for token (``same``: False marks a bug, or a
near-tie flipped by bf16 rounding; run ``--dtype float32`` to tell them apart).

The draft is ``DraftModel.early_exit(model, layers=--layers)``, drafting chains of
``--num-draft-tokens`` and trees of that depth for every ``--trees WIDTH:SIZE``. Drafts are not
adaptive by default (every pass verifies a full draft, so the timings compare verification shapes);
``--adaptive`` turns the adaptive length and fallback on. With random weights (the default: SmolLM2's
shape, no checkpoint needed) the timings of the loop are real but acceptance is not meaningful; pass
``--model smollm2`` (the GGUF) for real acceptance.

    python benchmarks/speculative_tree.py                                        # random SmolLM2 shape
    python benchmarks/speculative_tree.py --model smollm2 --layers 24 --trees 4:16 8:32
    python benchmarks/speculative_tree.py --model smollm2 --kv-cache paged --kv-dtype q4 --batch 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import common_arguments, figures, interleaved, load, median, print_rows, prompts, speedup  # noqa: E402 - shared with the speculative benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(parser)
    parser.add_argument("--layers", type=int, default=8, help="early-exit draft layers")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="chain length and tree depth")
    parser.add_argument("--trees", nargs="+", default=["4:16", "8:32"], help="tree shapes WIDTH:SIZE")
    parser.add_argument("--adaptive", action="store_true", help="adaptive draft length and fallback")
    args = parser.parse_args()

    import jax

    from zgen import Generator, Request, SamplingConfig
    from zgen.cache.factory import cache_kind, kv_dtype
    from zgen.speculative import DraftModel, TreeShape

    model = load(args)
    options = ([cache_kind(args.kv_cache)] if args.kv_cache else []) + ([kv_dtype(args.kv_dtype)] if args.kv_dtype else [])
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    k = args.num_draft_tokens
    speculators = {f"chain:{k}": DraftModel.early_exit(model, args.layers, k, adaptive=args.adaptive)}
    for shape in args.trees:
        width, _, size = shape.partition(":")
        tree = TreeShape(width=int(width), size=int(size))
        speculators[f"tree:{k}x{width}:{size}"] = DraftModel.early_exit(model, args.layers, k, adaptive=args.adaptive, tree=tree)
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        requests = [Request(p, sampling) for p in prompts(model, batch, real=args.model is not None, every=True)]
        drafting = {name: Generator(model, *options, max_batch_size=max(batch, 1), speculative=spec) for name, spec in speculators.items()}
        timed = interleaved({"plain": Generator(model, *options, max_batch_size=max(batch, 1)), **drafting}, requests, args.runs)
        base, base_s = timed["plain"]["results"], timed["plain"]["seconds"]
        tokens = sum(len(r.token_ids) for r in base)
        rows.append(dict(batch=batch, speculator="plain", tokens_per_s=tokens / median(base_s), speedup=1.0, same=True))
        for name in speculators:
            seconds, results = timed[name]["seconds"], timed[name]["results"]
            ratio, least, most = speedup(base_s, seconds)
            rows.append(dict(
                batch=batch, speculator=name, tokens_per_s=tokens / median(seconds), speedup=ratio,
                speedup_range=[round(least, 3), round(most, 3)],
                same=[r.token_ids for r in results] == [r.token_ids for r in base], **figures(results),
            ))
    report = dict(device=str(jax.devices()[0]), model=args.model or "random smollm2 shape", dtype=args.dtype, layers=args.layers,
                  new_tokens=args.new_tokens, adaptive=args.adaptive, kv_cache=args.kv_cache, kv_dtype=args.kv_dtype, rows=rows)
    if not args.json:
        print(f"{report['device']}  {report['model']}  {args.dtype}  early exit after {args.layers} layers  {args.new_tokens} new tokens")
        print_rows(rows)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
