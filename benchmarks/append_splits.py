"""The appending decode kernel's key splits, end to end: the default rule against one split of 64-key blocks.

``zgen.pallas.flash_attention.triton.append_decode_attention`` (RoPE, the cache write and attention of a
decode step in one kernel, the dense cache's decode path on a GPU) splits a buffer of more than one
key block over its keys, one block of 128 a program at least. Before, buffers of up to 16 blocks of
64 ran in one split: at batch 1 the kernel then had one program per KV head walking its blocks one
after another. This script times the Generator with each rule (``Generator.batch_generate``, greedy,
random weights, ms per token as ``gpu_decode.py`` measures it: generate(N) − generate(1) over N − 1)
at several prompt lengths, in interleaved rounds, each rule on its own copy of the weights (compiled
steps are kept per model). GPU only: on a CPU the dense cache attends through XLA and both rules are
the same path.

    python benchmarks/append_splits.py                       # SmolLM2 shape, batch 1
    python benchmarks/append_splits.py --batch 8
    python benchmarks/append_splits.py --shape llama3-8b --prompts 16 1000 --new-tokens 64
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import SHAPES, interleaved_per_token_s, prompt_ids, random_shape_model  # noqa: E402

#: Key blocks of the old rule, and the most of them it kept in one split.
OLD_BLOCK_K, OLD_ONE_SPLIT_BLOCKS = 64, 16


def old_rule(kernel: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The kernel with the old rule: blocks of 64, one split up to 16 of them (longer buffers: the default splits)."""
    slots = args[3].shape[1]
    if kwargs.get("num_splits") is None and slots // OLD_BLOCK_K <= OLD_ONE_SPLIT_BLOCKS:
        kwargs["num_splits"] = 1
    return kernel(*args, **{**kwargs, "block_k": OLD_BLOCK_K})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 450, 900], help="prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    from zgen import Generator, Request, SamplingConfig

    triton = importlib.import_module("zgen.pallas.flash_attention.triton")  # the package's name is also a function's
    default_kernel = triton.append_decode_attention
    rules = {"old": functools.partial(old_rule, default_kernel), "default": default_kernel}
    models = {name: random_shape_model(args.shape, context=max(args.prompts) + args.new_tokens) for name in rules}
    for prompt_tokens in args.prompts:
        prompt = prompt_ids(prompt_tokens)
        generates = {}
        for name, kernel in rules.items():
            generator = Generator(models[name], max_batch_size=args.batch)

            def generate(n: int, generator: Generator = generator) -> Any:
                request = Request(prompt, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                return generator.batch_generate([request] * args.batch)[0]

            setattr(triton, "append_decode_attention", kernel)  # traced with this rule: compile now, for every length timed
            try:
                for n in (args.new_tokens, 1):
                    generate(n)
            finally:
                setattr(triton, "append_decode_attention", default_kernel)
            generates[name] = generate
        rounds = interleaved_per_token_s(generates, args.new_tokens, args.runs)
        old = statistics.median(rounds["old"])
        for name, seconds in rounds.items():
            ms = statistics.median(seconds) * 1e3
            print(
                f"{args.shape} batch {args.batch} prompt {prompt_tokens} + {args.new_tokens}: {name:7s} {ms:.4f} ms/token "
                f"({min(seconds) * 1e3:.4f}-{max(seconds) * 1e3:.4f}), {old * 1e3 / ms:.3f}x the old rule",
                flush=True,
            )


if __name__ == "__main__":
    main()
