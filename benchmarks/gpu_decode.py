"""Batch-1 decode speed on a GPU: zgen vs HF transformers (static cache + torch.compile), bfloat16.

Random weights of two shapes — SmolLM2-135M and Llama-3-8B — so no checkpoint has to be present.
Both frameworks are timed the same way: wall time of generate(N new tokens) minus generate(1), over
N − 1 tokens, median of several runs after warm-up, EOS never stops early. Each framework runs in its
own process (JAX and torch would otherwise fight over GPU memory); run with no arguments to do both.

    python benchmarks/gpu_decode.py                 # both shapes, both frameworks, JSON at the end
    python benchmarks/gpu_decode.py --only zgen --shape smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
}
PROMPT = list(range(100, 116))


def per_token_s(generate: Callable[[int], None], new_tokens: int, runs: int) -> float:
    def timed(n: int) -> float:
        start = time.perf_counter()
        generate(n)
        return time.perf_counter() - start

    for n in (new_tokens, 1, new_tokens):  # warm-up: compilation for both lengths
        timed(n)
    full = statistics.median(timed(new_tokens) for _ in range(runs))
    one = statistics.median(timed(1) for _ in range(runs))
    return (full - one) / (new_tokens - 1)


def bench_zgen(shape: str, new_tokens: int, runs: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import tokenizers
    from tokenizers.models import WordLevel

    from zgen import Generator, ModelConfig, SamplingConfig
    from zgen.graph.decoder import build_decoder
    from zgen.model import LoadTimings, Model
    from zgen.tokenizer import Tokenizer

    raw = SHAPES[shape]
    config = ModelConfig.from_hf({**raw, "model_type": "llama", "rms_norm_eps": 1e-5})
    graph = build_decoder(config)
    key = jax.random.key(0)
    params = {}
    for i, (name, dims) in enumerate(sorted(graph.param_shapes().items())):
        scale = 1.0 if len(dims) == 1 else dims[-1] ** -0.5
        params[name] = (scale * jax.random.normal(jax.random.fold_in(key, i), dims, jnp.float32)).astype(jnp.bfloat16)
    backend = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    tokenizer = Tokenizer(backend=backend, bos_id=None, eos_ids=())
    model = Model(config, tokenizer, graph, params, jnp.dtype(jnp.bfloat16), source=None,
                  load_timings=LoadTimings("random", 0.0, 0.0))
    gen = Generator(model)

    def generate(n: int) -> None:
        gen.generate(PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True))

    seconds = per_token_s(generate, new_tokens, runs)
    return {"framework": "zgen", "shape": shape, "device": jax.devices()[0].device_kind,
            "ms_per_token": seconds * 1e3, "tok_s": 1 / seconds}


def bench_hf(shape: str, new_tokens: int, runs: int) -> dict[str, Any]:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    # A static cache makes generate() compile the decoding forward itself (torch.compile,
    # "reduce-overhead" = CUDA graphs, fullgraph), transformers' documented fast path.
    model.generation_config.cache_implementation = "static"
    ids = torch.tensor([PROMPT], device="cuda")

    def generate(n: int) -> None:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()

    seconds = per_token_s(generate, new_tokens, runs)
    compiled = getattr(model, "_compiled_call", None) is not None
    return {"framework": "hf-static-compile", "shape": shape, "device": torch.cuda.get_device_name(), "compiled": compiled,
            "ms_per_token": seconds * 1e3, "tok_s": 1 / seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["zgen", "hf"])
    parser.add_argument("--shape", choices=list(SHAPES))
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if args.only:
        bench = bench_zgen if args.only == "zgen" else bench_hf
        print("RESULT " + json.dumps(bench(args.shape, args.new_tokens, args.runs)), flush=True)
        return
    results = []
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    for shape in [args.shape] if args.shape else list(SHAPES):
        for framework in ("zgen", "hf"):
            cmd = [sys.executable, __file__, "--only", framework, "--shape", shape,
                   "--new-tokens", str(args.new_tokens), "--runs", str(args.runs)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                results.append({"framework": framework, "shape": shape, "error": proc.returncode})
                continue
            results.append(json.loads(lines[-1][len("RESULT "):]))
            print(results[-1], flush=True)
    for shape in {r["shape"] for r in results}:
        pair = {r["framework"]: r for r in results if r["shape"] == shape and "tok_s" in r}
        if len(pair) == 2:
            print(f"{shape}: zgen {pair['zgen']['tok_s']:.1f} tok/s vs HF {pair['hf-static-compile']['tok_s']:.1f} "
                  f"tok/s = {pair['zgen']['tok_s'] / pair['hf-static-compile']['tok_s']:.2f}x")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_decode.json"), "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
