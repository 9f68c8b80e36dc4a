"""EAGLE on the GPU: train a head for SmolLM2 by self-distillation, then plain decode vs EAGLE.

1. Training: the target's greedy answers to ``--self-distill`` chat prompts (built here from topic ×
   task templates, none of them among the measured prompts) are the data; the head trains
   ``--train-steps`` steps on them. Reported: the generation and training wall time in GPU minutes,
   the tokens trained on, the final loss and the held-out top-1 acceptance (at the first drafted
   token and along a chain of 4). ``--chain-steps N`` adds EAGLE-3's training-time test. The head is
   saved in ``--out``; running again with the same ``--out`` continues training from its last step
   (pass more ``--train-steps``) or, already trained that far, only measures.
2. Speed (``--batch`` with no sizes: none): tokens/s of plain greedy decoding vs EAGLE chains and
   EAGLE-2 trees (``--trees``) at each ``--batch`` on the chat / code / summary prompts of
   ``benchmarks/speculative.py``, timed as there (interleaved rounds after a warm-up that compiles;
   the speedup is the median of the rounds' ratios), the acceptance figures (for a tree: accepted over
   the depth drafted), and ``same``: the greedy tokens equal plain decoding's, token for token.
   ``speculative.py --speculators eagle:DIR eagle:DIR2`` compares heads side by side.

With random weights (the default: SmolLM2's shape) the timings are real but acceptance means nothing
(a random model's answers are noise). For the real model pass the GGUF::

    python benchmarks/eagle.py                                                   # random SmolLM2 shape
    python benchmarks/eagle.py --model /path/SmolLM2-135M-Instruct.Q4_1.gguf     # real weights
    python benchmarks/eagle.py --model smollm2 --train-steps 4000 --fused --out /tmp/head3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import figures, interleaved, load, median, print_rows, prompts, speedup  # noqa: E402 - the shared prompt set, timing and figures

TOPICS = (
    "the water cycle", "black holes", "photosynthesis", "the French revolution", "compound interest", "vaccines",
    "plate tectonics", "the internet", "sleep", "volcanoes", "electric cars", "bees", "the moon landing",
    "inflation", "machine learning", "coffee", "the Roman empire", "recycling", "earthquakes", "chess",
    "sorting algorithms", "the human heart", "climate change", "the printing press", "solar panels", "DNA",
    "the stock market", "rainbows", "antibiotics", "the Great Wall of China", "hash tables", "gravity",
    "the Olympic games", "bread baking", "ocean tides", "democracy", "recursion", "the immune system",
    "renewable energy", "ancient Egypt", "binary numbers", "honey", "jazz music", "glaciers", "password security",
    "the periodic table", "migration of birds", "public libraries", "bicycles", "the speed of light",
)
TASKS = (
    "Explain {t} to a ten-year-old.",
    "Give three facts about {t}.",
    "Write a short paragraph about {t}.",
    "What are common misconceptions about {t}?",
    "Write a Python function related to {t}, with a docstring and a comment per line.",
    "Summarise the history of {t} in five sentences.",
    "List the pros and cons of {t}.",
    "Write a haiku about {t}, then explain it.",
    "How would you teach {t} in a one-hour class?",
    "Write a short dialogue between two students about {t}.",
    "What questions do scientists still ask about {t}?",
    "Describe {t} in the style of a news report.",
    "Write a step-by-step guide related to {t}.",
    "Answer in one sentence: why does {t} matter?",
    "Write a JSON object with five fields describing {t}.",
    "Compare {t} with something from everyday life.",
)


def distill_file(path: Path) -> Path:
    lines = [json.dumps({"messages": [{"role": "user", "content": task.format(t=topic)}]}) for task in TASKS for topic in TOPICS]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="built-in name, .gguf or HF directory (default: random SmolLM2 shape)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/zgen-eagle-head"), help="the head's directory (resumed if it exists)")
    parser.add_argument("--train-steps", type=int, default=2000)
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--self-distill", type=int, default=len(TASKS) * len(TOPICS), help="prompts whose greedy answers are the data")
    parser.add_argument("--data", type=Path, default=None, help="the prompts (.jsonl chats or .txt lines) instead of the built-in ones")
    parser.add_argument("--fused", action="store_true", help="EAGLE-3's low/middle/high feature fusion")
    parser.add_argument("--chain-steps", type=int, default=1, help="EAGLE-3's training-time test over this many chained steps (1: off)")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8], help="batch sizes measured (none: train only)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--no-adaptive", action="store_true", help="fixed draft length, no fallback to plain decoding")
    parser.add_argument("--trees", nargs="*", default=["4x16"], help="EAGLE-2 tree shapes WIDTHxSIZE measured beside the chain")
    args = parser.parse_args()

    import jax

    from zgen import Generator, Request, SamplingConfig
    from zgen.speculative import Eagle, TreeShape
    from zgen.speculative.eagle.train import StepReport, TrainConfig, train

    model = load(args)
    data = args.data or distill_file(args.out.parent / f"{args.out.name}-prompts.jsonl")
    config = TrainConfig(
        steps=args.train_steps, batch_size=args.train_batch, seq_len=args.seq_len, lr=args.lr, self_distill=args.self_distill,
        fused=args.fused, chain_steps=args.chain_steps, save_every=max(args.train_steps // 4, 1), eval_every=max(args.train_steps // 20, 1),
    )

    def show(step: StepReport) -> None:
        if step.acceptance is not None:
            print(f"  step {step.step}/{step.steps}  loss {step.loss:.4f}  held-out acceptance {step.acceptance:.1%}", flush=True)

    started = time.perf_counter()
    report = train(model, data, args.out, config, show)
    training = dict(
        steps=report.steps, first_step=report.first_step, tokens=report.tokens, loss=report.loss, acceptance=report.acceptance,
        chain_acceptance=report.chain_acceptance, chain_steps=args.chain_steps,
        generation_gpu_minutes=report.generation_seconds / 60, training_gpu_minutes=report.seconds / 60,
        total_gpu_minutes=(time.perf_counter() - started) / 60,
    )
    print(f"training: {json.dumps(training)}", flush=True)

    adaptive = not args.no_adaptive
    speculators = {f"eagle:{args.num_draft_tokens}": Eagle.load(args.out, model, args.num_draft_tokens, adaptive=adaptive)}
    for shape in args.trees:
        width, _, size = shape.lower().partition("x")
        tree = TreeShape(width=int(width), size=int(size))
        speculators[f"eagle-tree:{args.num_draft_tokens}x{shape}"] = Eagle.load(args.out, model, args.num_draft_tokens, adaptive=adaptive, tree=tree)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        requests = [Request(p, sampling) for p in prompts(model, batch, real=args.model is not None, every=True)]
        drafting = {name: Generator(model, max_batch_size=batch, speculative=eagle) for name, eagle in speculators.items()}
        timed = interleaved({"plain": Generator(model, max_batch_size=batch), **drafting}, requests, args.runs)
        base, base_s = timed["plain"]["results"], timed["plain"]["seconds"]
        tokens = sum(len(r.token_ids) for r in base)
        rows.append(dict(batch=batch, prompts="mix", speculator="plain", tokens_per_s=tokens / median(base_s), speedup=1.0, same=True))
        for name in speculators:
            side = timed[name]
            ratio, least, most = speedup(base_s, side["seconds"])
            rows.append(dict(
                batch=batch, prompts="mix", speculator=name, tokens_per_s=tokens / median(side["seconds"]), speedup=ratio,
                speedup_range=[round(least, 3), round(most, 3)], same=[r.token_ids for r in side["results"]] == [r.token_ids for r in base],
                fallback_steps=drafting[name].engine.stats.fallback_steps, **figures(side["results"]),
            ))
    result = dict(device=str(jax.devices()[0]), model=args.model or "random smollm2 shape", dtype=args.dtype, fused=args.fused,
                  num_draft_tokens=args.num_draft_tokens, new_tokens=args.new_tokens, training=training, rows=rows)
    print_rows(rows)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
