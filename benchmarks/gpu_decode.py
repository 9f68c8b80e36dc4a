"""Decode speed on a GPU: zgen vs HF transformers (static cache + torch.compile), bfloat16 (``--dtype``).

Random weights of two shapes — SmolLM2-135M and Llama-3-8B — so no checkpoint has to be present.
Both frameworks are timed the same way: wall time of generate(N new tokens) minus generate(1), over
N − 1 tokens, median of several runs after warm-up, EOS never stops early. Each framework (and each
zgen attention path) runs in its own process (JAX and torch would otherwise fight over GPU memory);
run with no arguments to do both. Each zgen result also gives the step's roofline: every weight and
the valid KV (at the decode's mean length) read once, at the read bandwidth measured in the same process.

zgen's default dense cache attends through the Pallas kernels on the GPU (``--attention auto`` =
``triton``: the flash prefill kernel and the split-K decode kernel, over the valid slots only);
``einsum`` is the old XLA path over the whole cache buffer. Naming several paths times them side by
side in one run and prints the ratio; a long ``--prompt-tokens`` makes attention matter (the buffer
is the next power of two above prompt + new tokens).

``--contexts`` also times one context alone (``zgen.Context`` on an engine with a paged cache, greedy,
the same prompt and new tokens, same method) beside the Generator at batch 1 on the same shape, in a
process of its own, and prints the context's speed as a fraction of the Generator's.

    python benchmarks/gpu_decode.py                 # both shapes, both frameworks, JSON at the end
    python benchmarks/gpu_decode.py --only zgen --shape smollm2
    python benchmarks/gpu_decode.py --no-hf --attention einsum triton --prompt-tokens 4000 --batch 8
    python benchmarks/gpu_decode.py --no-hf --contexts --shape smollm2
    python benchmarks/gpu_decode.py --no-hf --shape smollm2 --dtype float32 --trace-kernels 25

``--trace-kernels N`` also lists each zgen run's N costliest kernels per decode step (launches and µs
per step, from a profile of the same generations: ``kernel_trace.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from zgen import GenerationResult, Model

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
}
# zgen.cache.tensor.DenseAttention, and "paged": the Generator on a paged cache (its paged kernel)
ATTENTION_PATHS = ("auto", "einsum", "xla", "triton", "paged")


def prompt_ids(tokens: int) -> list[int]:
    return [100 + i % 1000 for i in range(tokens)]


def random_shape_model(shape: str, context: int = 0, dtype: str = "bfloat16") -> Model:
    """Random weights of ``shape`` in ``dtype``; a ``context`` longer than the shape's positions raises
    them (as Llama-3.1 does Llama-3's 8,192: the same weights' shapes)."""
    from zgen import ModelConfig
    from zgen.model import random_model

    positions = max(SHAPES[shape]["max_position_embeddings"], context)
    config = {**SHAPES[shape], "max_position_embeddings": positions, "model_type": "llama", "rms_norm_eps": 1e-5}
    return random_model(ModelConfig.from_hf(config), dtype=dtype)


@dataclasses.dataclass
class Timing:
    per_token_s: float  # wall time of N new tokens minus 1, over N - 1 (medians)
    full: list[Any]  # what the timed N-token generations returned
    one: list[Any]  # ... and the 1-token ones


def time_generations(
    generate: Callable[[int], Any], new_tokens: int, runs: int, warmups: tuple[int, ...] | None = None
) -> Timing:
    """``runs`` timed generations of ``new_tokens`` and of 1 token after ``warmups`` (default N, 1, N:
    compilation for both lengths), keeping what they returned."""
    def timed(n: int) -> tuple[float, Any]:
        start = time.perf_counter()
        out = generate(n)
        return time.perf_counter() - start, out

    for n in warmups or (new_tokens, 1, new_tokens):
        timed(n)
    full = [timed(new_tokens) for _ in range(runs)]
    one = [timed(1) for _ in range(runs)]
    seconds = (statistics.median(t for t, _ in full) - statistics.median(t for t, _ in one)) / (new_tokens - 1)
    return Timing(seconds, [out for _, out in full], [out for _, out in one])


def per_token_s(generate: Callable[[int], object], new_tokens: int, runs: int) -> float:
    return time_generations(generate, new_tokens, runs).per_token_s


def interleaved_per_token_s(generates: dict[str, Callable[[int], object]], new_tokens: int, runs: int) -> dict[str, list[float]]:
    """Per-token seconds of each way of generating, round by round: every round times each one's
    ``new_tokens`` and 1-token generations back to back, so that a drift of the machine's speed
    (clocks, a neighbour) falls on all of them alike, and the spread between rounds shows the noise."""
    def timed(generate: Callable[[int], object], n: int) -> float:
        start = time.perf_counter()
        generate(n)
        return time.perf_counter() - start

    for generate in generates.values():
        for n in (new_tokens, 1, new_tokens):
            timed(generate, n)
    rounds: dict[str, list[float]] = {name: [] for name in generates}
    for _ in range(runs):
        for name, generate in generates.items():
            rounds[name].append((timed(generate, new_tokens) - timed(generate, 1)) / (new_tokens - 1))
    return rounds


def pool_megabytes(model: Model, dtype: str, tokens: int, page_size: int) -> float:
    """MiB of pages that hold ``tokens`` of the model's K/V in ``dtype``."""
    from zgen.cache.formats import bytes_per_token_per_layer

    c = model.config
    storage = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    return tokens * c.num_layers * bytes_per_token_per_layer(storage, c.num_kv_heads, c.head_dim, page_size) / 2**20


def bench_zgen(
    shape: str, new_tokens: int, runs: int, attention: str, prompt_tokens: int, batch: int, dtype: str, trace_kernels: int
) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from kernel_trace import decode_step_kernels
    from zgen import Generator, Request, SamplingConfig
    from zgen.cache.factory import dense_attention, paged_kv
    from zgen.cache.tensor import DenseAttention

    model = random_shape_model(shape, dtype=dtype)
    # A pool for every row's whole sequence, a page to spare: a smaller one makes rows wait or
    # recompute, and the run would time that instead of decoding.
    pool_mb = pool_megabytes(model, dtype, batch * (prompt_tokens + new_tokens + 64), page_size=64)
    cache = paged_kv(max(2048.0, pool_mb)) if attention == "paged" else dense_attention(cast(DenseAttention, attention))
    gen = Generator(model, cache, max_batch_size=batch)
    prompt = prompt_ids(prompt_tokens)

    def generate(n: int) -> Any:
        request = Request(prompt, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True))
        return gen.batch_generate([request] * batch)[0]

    seconds = per_token_s(generate, new_tokens, runs)
    prefill_s = statistics.median(generate(1).timings.prefill_s for _ in range(runs))
    # The step's bound: every weight and the valid KV (at the decode's mean length) read once.
    c = model.config
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    kv_bytes = batch * (prompt_tokens + new_tokens / 2) * c.num_layers * 2 * c.num_kv_heads * c.head_dim * jnp.dtype(dtype).itemsize
    bandwidth = read_bandwidth(runs)
    roofline_s = (weight_bytes + kv_bytes) / bandwidth
    kernels = decode_step_kernels(generate, new_tokens, trace_kernels) if trace_kernels else []
    return {"framework": "zgen", "attention": attention, "shape": shape, "dtype": dtype, "device": jax.devices()[0].device_kind,
            "batch": batch, "prompt_tokens": prompt_tokens, "ms_per_token": seconds * 1e3, "tok_s": batch / seconds,
            "prefill_ms": prefill_s * 1e3, "read_tb_s": bandwidth / 1e12, "roofline_ms": roofline_s * 1e3,
            "of_roofline": roofline_s / seconds, "token_ids": generate(new_tokens).token_ids[:64], "kernels": kernels}


def read_bandwidth(runs: int) -> float:
    """Bytes per second read from a 4 GiB bfloat16 matrix, measured in this process: the faster of a
    row sum and a matrix-vector product (what a decode step does with its weights)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((256 * 1024, 8192), jnp.bfloat16)
    vector = jnp.ones((8192,), jnp.bfloat16)
    passes = [
        (jax.jit(lambda x: jnp.sum(x, axis=1, dtype=jnp.float32)), (x,)),
        (jax.jit(lambda x, v: x @ v), (x, vector)),
    ]
    best, queued = float("inf"), 10  # calls queued back to back: one wait, no per-call dispatch gap
    for fn, args in passes:
        fn(*args).block_until_ready()
        for _ in range(max(runs, 5)):
            start = time.perf_counter()
            results = [fn(*args) for _ in range(queued)]
            results[-1].block_until_ready()
            best = min(best, (time.perf_counter() - start) / queued)
    return x.nbytes / best


def bench_context(shape: str, new_tokens: int, runs: int, prompt_tokens: int, dtype: str) -> dict[str, Any]:
    """One context alone on an engine with a paged cache: fill the prompt, generate greedily, release."""
    import jax

    from zgen import Context, Engine, Sampler, stop
    from zgen.cache.factory import paged_kv

    model = random_shape_model(shape, dtype=dtype)
    page_size = 16
    need_mb = pool_megabytes(model, dtype, prompt_tokens + new_tokens + page_size, page_size)  # a page to spare
    engine = Engine(model, paged_kv(max(512.0, 2 * need_mb), page_size))
    prompt = prompt_ids(prompt_tokens)

    def generate(n: int) -> GenerationResult:
        with Context(engine) as ctx:
            ctx.fill_tokens(prompt)
            return ctx.generate_result(Sampler.greedy(), stop.max_len(n))  # no EOS stop

    seconds = per_token_s(generate, new_tokens, runs)
    prefill_s = statistics.median(generate(1).timings.prefill_s for _ in range(runs))
    return {"framework": "zgen-context", "attention": "paged", "shape": shape, "device": jax.devices()[0].device_kind,
            "batch": 1, "prompt_tokens": prompt_tokens, "ms_per_token": seconds * 1e3, "tok_s": 1 / seconds,
            "prefill_ms": prefill_s * 1e3, "token_ids": generate(new_tokens).token_ids[:64]}


def bench_hf(shape: str, new_tokens: int, runs: int, prompt_tokens: int, batch: int, dtype: str) -> dict[str, Any]:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    # A static cache makes generate() compile the decoding forward itself (torch.compile,
    # "reduce-overhead" = CUDA graphs, fullgraph), transformers' documented fast path.
    model.generation_config.cache_implementation = "static"
    ids = torch.tensor([prompt_ids(prompt_tokens)] * batch, device="cuda")

    def generate(n: int) -> None:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()

    seconds = per_token_s(generate, new_tokens, runs)
    compiled = getattr(model, "_compiled_call", None) is not None
    return {"framework": "hf-static-compile", "shape": shape, "device": torch.cuda.get_device_name(), "compiled": compiled,
            "batch": batch, "prompt_tokens": prompt_tokens, "ms_per_token": seconds * 1e3, "tok_s": batch / seconds}


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["zgen", "context", "hf"])
    parser.add_argument("--shape", choices=list(SHAPES))
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--attention", nargs="+", choices=ATTENTION_PATHS, default=["auto"],
                        help="zgen attention paths to time (dense cache: einsum = XLA, triton = the kernels; paged: a paged cache)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together (copies of the prompt)")
    parser.add_argument("--no-hf", action="store_true", help="time zgen only")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16", help="weights and activations, both frameworks")
    parser.add_argument("--trace-kernels", type=int, default=0, metavar="N",
                        help="also list zgen's N costliest kernels per decode step (a GPU profile, kernel_trace.py)")
    parser.add_argument("--contexts", action="store_true",
                        help="also time one context alone (paged cache) beside the Generator at batch 1")
    args = parser.parse_args()
    if (args.contexts or args.only == "context") and args.batch != 1:
        parser.error("one context alone is compared with the Generator at batch 1: leave --batch at 1")
    if args.only:
        if args.only == "zgen":
            result = bench_zgen(
                args.shape, args.new_tokens, args.runs, args.attention[0], args.prompt_tokens, args.batch, args.dtype, args.trace_kernels
            )
        elif args.only == "context":
            result = bench_context(args.shape, args.new_tokens, args.runs, args.prompt_tokens, args.dtype)
        else:
            result = bench_hf(args.shape, args.new_tokens, args.runs, args.prompt_tokens, args.batch, args.dtype)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    runs = [("zgen", path) for path in args.attention] + ([("context", "")] if args.contexts else [])
    runs += [] if args.no_hf else [("hf", "")]
    for shape in [args.shape] if args.shape else list(SHAPES):
        for framework, attention in runs:
            cmd = [sys.executable, __file__, "--only", framework, "--shape", shape,
                   "--new-tokens", str(args.new_tokens), "--runs", str(args.runs),
                   "--prompt-tokens", str(args.prompt_tokens), "--batch", str(args.batch), "--dtype", args.dtype,
                   "--trace-kernels", str(args.trace_kernels)]
            cmd += ["--attention", attention] if attention else []
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                results.append({"framework": framework, "attention": attention, "shape": shape, "error": proc.returncode})
                continue
            results.append(json.loads(lines[-1][len("RESULT "):]))
            print({k: v for k, v in results[-1].items() if k not in ("token_ids", "kernels")}, flush=True)
            for kernel in results[-1].get("kernels", []):
                print(f"  {kernel['per_step']:6.1f} x {kernel['us_per_step']:8.1f} us  {kernel['kernel'][:100]}", flush=True)
    for shape in {r["shape"] for r in results}:
        timed = [r for r in results if r["shape"] == shape and "tok_s" in r]
        hf = next((r for r in timed if r["framework"] == "hf-static-compile"), None)
        zgen = [r for r in timed if r["framework"] == "zgen"]
        for r in zgen:
            line = (f"{shape} zgen[{r['attention']}]: {r['tok_s']:.1f} tok/s, {r['ms_per_token']:.3f} ms/step, prefill "
                    f"{r['prefill_ms']:.1f} ms; {r['of_roofline']:.0%} of the {r['roofline_ms']:.2f} ms roofline "
                    f"(weights + valid KV at {r['read_tb_s']:.2f} TB/s read)")
            if hf:
                line += f"; HF {hf['tok_s']:.1f} tok/s = {r['tok_s'] / hf['tok_s']:.2f}x"
            print(line)
        old = next((r for r in zgen if r["attention"] == "einsum"), None)
        for new in (r for r in zgen if old and r is not old):
            assert old is not None
            agree = agreement(old["token_ids"], new["token_ids"])
            print(f"{shape} {new['attention']} vs einsum: decode speedup {old['ms_per_token'] / new['ms_per_token']:.2f}x, "
                  f"prefill speedup {old['prefill_ms'] / new['prefill_ms']:.2f}x; greedy tokens agree for the first {agree}")
        context = next((r for r in timed if r["framework"] == "zgen-context"), None)
        generator = next((r for r in zgen if r["attention"] == "auto"), zgen[0] if zgen else None)
        if context:
            line = f"{shape} one context (paged): {context['tok_s']:.1f} tok/s, {context['ms_per_token']:.3f} ms/step"
            if generator:
                line += (f"; Generator[{generator['attention']}] at batch 1 {generator['tok_s']:.1f} tok/s: the context "
                         f"decodes at {context['tok_s'] / generator['tok_s']:.2f}x its speed; greedy tokens agree for "
                         f"the first {agreement(generator['token_ids'], context['token_ids'])}")
            print(line)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_decode.json"), "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
