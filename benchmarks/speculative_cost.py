"""What a speculative loop costs when no draft is accepted: plain decoding vs an untrained EAGLE head.

An untrained head (``EagleHead.init``) drafts tokens that are never accepted, so every millisecond a
speculative generation takes beyond plain decoding's is the loop's own: with ``adaptive=True`` the
fallback's cost (its probes, its plain stretches, the loop call's start and end), with
``adaptive=False`` a pass's cost (every iteration drafts and verifies ``--num-draft-tokens``). Each
``--batch`` and answer length (``--lengths``) is timed in interleaved rounds after a warm-up
(median of ``--runs``), with the engine's loop calls, plain steps and passes per generation and what
it measured a pass to cost in plain steps. ``--trace N`` adds, on a GPU, the N kernels that take
most of a non-adaptive pass (``benchmarks/kernel_trace.py``: launches and microseconds a pass; the
``MemcpyD2H`` row counts the loop predicates a pass brings to the host); ``--trace-sides`` picks the
sides traced (``plain adaptive``: what a token of the fallback's plain stretches costs on the device
beside a plain decode loop's).

    python benchmarks/speculative_cost.py                           # random SmolLM2 shape, batch 1 and 8
    python benchmarks/speculative_cost.py --batch 1 --lengths 128 --trace 30
    python benchmarks/speculative_cost.py --batch 1 --lengths 128 --runs 0 --trace 12 --trace-sides plain adaptive
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_trace import decode_step_kernels  # noqa: E402 - the benchmarks' shared kernel tracer
from speculative import load, prompts  # noqa: E402 - the shared model loader and prompt set


SIDES = ("plain", "adaptive", "every pass")  # plain decoding; the head with its fallback; every pass drafting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="built-in name, .gguf or HF directory (default: random SmolLM2 shape)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512], help="new tokens per answer")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--trace", type=int, default=0, help="the top N kernels a generated token of each --trace-sides side (GPU only)")
    parser.add_argument("--trace-sides", nargs="+", default=["every pass"], choices=SIDES, help="the sides --trace traces")
    args = parser.parse_args()

    from zgen import Generator, Request, SamplingConfig
    from zgen.speculative import Eagle
    from zgen.speculative.eagle.head import EagleHead

    model = load(args)
    head = EagleHead.init(model, 1)

    def side(name: str, batch: int) -> Generator:
        speculative = None if name == "plain" else Eagle(head, args.num_draft_tokens, adaptive=name == "adaptive")
        return Generator(model, max_batch_size=batch, speculative=speculative)

    print(f"{'batch':>5} {'new':>5} {'side':<14} {'ms':>9} {'vs plain':>8} {'extra ms':>9} {'calls':>6} {'plain steps':>11} {'passes':>7} {'pass (steps)':>12}")
    for batch in args.batch:
        for new in args.lengths if args.runs else ():  # --runs 0: the traces alone
            sampling = SamplingConfig(temperature=0.0, max_new_tokens=new, ignore_eos=True)
            requests = [Request(p, sampling) for p in prompts(model, batch, real=args.model is not None)]
            sides = {name: side(name, batch) for name in SIDES}
            for generator in sides.values():
                for _ in range(3):  # compiles, then times the plain step and a pass (the adaptive side)
                    generator.batch_generate(requests)
            before = {name: (g.engine.stats.steps, g.engine.stats.fallback_steps) for name, g in sides.items()}
            seconds: dict[str, list[float]] = {name: [] for name in sides}
            results: dict[str, Any] = {}
            for r in range(args.runs):
                names = list(sides)
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    started = time.perf_counter()
                    results[name] = sides[name].batch_generate(requests)
                    seconds[name].append(time.perf_counter() - started)
            plain = statistics.median(seconds["plain"])
            for name, generator in sides.items():
                stats, (calls, fallback) = generator.engine.stats, before[name]
                took = statistics.median(seconds[name])
                passes = [r.speculative.steps for r in results[name] if r.speculative is not None]
                cost = generator.engine.loop_times.pass_cost(batch, generator.speculative) if generator.speculative is not None else 0.0
                print(
                    f"{batch:>5} {new:>5} {name:<14} {took * 1e3:>9.2f} {plain / took:>7.3f}x {1e3 * (took - plain):>+9.2f} "
                    f"{(stats.steps - calls) / args.runs:>6.1f} {(stats.fallback_steps - fallback) / args.runs:>11.1f} "
                    f"{statistics.mean(passes) if passes else 0.0:>7.1f} {cost:>12.2f}",
                    flush=True,
                )
        for name in args.trace_sides if args.trace else ():
            traced = side(name, batch)
            ids = prompts(model, batch, real=args.model is not None)

            def generate(new: int) -> Any:
                config = SamplingConfig(temperature=0.0, max_new_tokens=new, ignore_eos=True)
                return traced.batch_generate([Request(p, config) for p in ids])

            for _ in range(3):  # compiled, and (adaptive) the plain step and a pass timed, before the traces
                generate(128), generate(1)
            print(f"batch {batch}, {name}: the kernels of a step (launches and microseconds a generated token)")
            for row in decode_step_kernels(generate, 128, args.trace):
                print(f"   {row['us_per_step']:>9.1f} us {row['per_step']:>6.2f}x  {row['kernel']}")


if __name__ == "__main__":
    main()
