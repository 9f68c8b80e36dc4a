"""Weight-only quantization: decode speed on a GPU and SmolLM2's perplexity, each format beside its baseline.

``speed`` (a GPU): batch-1 greedy decode, ms per token, of random bf16 weights of the Llama-3-8B and
SmolLM2 shapes against the same weights quantized to int8 (per output channel) and int4 (groups of
128 for Llama-3-8B, 32 for SmolLM2's width 576), as the named formats do it (Llama-3-8B's untied LM
head in int8; SmolLM2's is tied to its embeddings and stays bf16), in one process, same prompt and method as
``gpu_decode.py`` (generate N tokens minus generate 1). Each quantized format runs with each
``--matmul`` way of computing the product (``zgen.quantized_weights.MATMULS``: dequantize-then-dot;
dots over the raw codes per group with the scales applied after; or, for decode, a multiply-and-sum
reduction). Also one matmul alone (batch 1
by the MLP's down projection), where only the weight bytes differ. Goals: int8 ≥ 1.7×, int4 ≥ 2.8×
bf16's tokens/s at the Llama-3-8B shape.

``products`` (a GPU): each of a decoder layer's four products alone (qkv, o, gate/up, down; ``--rows``
rows), bf16 against int8 (per output channel) and int4 (default groups: 128 at Llama-3-8B) in each
``--matmul`` form (with ``kernel``, int4 also on the tensor cores, ``int4-mma``: ``zgen.pallas.quantized_matmul.triton_mma``): device
time per product from a profiler trace of every kernel the call launches (arrangement fusions
included), over ``--weights`` distinct matrices per format so that the codes come from memory, not
from L2.

``ppl`` (any machine; CPU is fine): SmolLM2-135M-Instruct's perplexity over the start of
``docs/eval/english.txt`` (``zgen.evaluation.perplexity``, dense float32 cache) for the GGUF
dequantized to float32 (today's default), the GGUF's own Q4_1 blocks computed directly
(``weights="gguf"``), and the dequantized weights re-quantized to int8 and int4.

    python benchmarks/quantized_weights.py speed                # GPU: both shapes, JSON lines
    python benchmarks/quantized_weights.py speed --shape llama3-8b --new-tokens 128
    python benchmarks/quantized_weights.py products --matmul reduce kernel   # GPU: per product, µs
    python benchmarks/quantized_weights.py ppl --tokens 1024    # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from gpu_decode import SHAPES, per_token_s, prompt_ids, random_shape_model  # benchmarks/ is on sys.path when this script runs
from zgen import Generator, SamplingConfig
from zgen.model import Model, load_model, quantize_model
from zgen.pallas.quantized_matmul import quantized_matmul
from zgen.quantized_weights import MATMULS, WEIGHT_FORMATS, QuantizedWeight, WeightQuantization, dequantize, quantize, quantized_linear

TEXT = Path(__file__).resolve().parent.parent / "docs" / "eval" / "english.txt"


def weight_bytes(model: Model) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(model.params))


def decode_ms(model: Model, new_tokens: int, runs: int, prompt_tokens: int) -> tuple[float, list[int]]:
    gen = Generator(model)
    prompt = prompt_ids(prompt_tokens)

    def generate(n: int) -> Any:
        return gen.generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True))

    seconds = per_token_s(generate, new_tokens, runs)
    tokens = generate(new_tokens).token_ids[:32]
    gen.close()
    return seconds * 1e3, tokens


def product(x: jax.Array, weight: QuantizedWeight) -> jax.Array:
    """The product as a decode step computes it: "kernel" weights through zgen's Triton kernel."""
    return quantized_matmul(x, weight) if weight.matmul == "kernel" else quantized_linear(x, weight)


def matmul_ms(hidden: int, intermediate: int, schemes: dict[str, WeightQuantization | None], runs: int) -> dict[str, float]:
    """x [1, intermediate] @ W.T, W [hidden, intermediate] (the down projection), per format."""
    key = jax.random.key(0)
    weight = (jax.random.normal(key, (hidden, intermediate), jnp.float32) * intermediate**-0.5).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 1), (1, intermediate), jnp.bfloat16)
    times: dict[str, float] = {}
    for name, scheme in schemes.items():
        w = weight if scheme is None else quantize(weight, scheme, jnp.dtype(jnp.float16))
        fn = jax.jit(lambda x, w: product(x, w) if isinstance(w, QuantizedWeight) else x @ w.T)
        fn(x, w).block_until_ready()
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            for _ in range(100):
                out = fn(x, w)
            out.block_until_ready()
            samples.append((time.perf_counter() - start) / 100)
        times[name] = statistics.median(samples) * 1e3
    return times


def named_schemes(matmuls: list[str]) -> dict[str, WeightQuantization | None]:
    """bf16 and each named format (its int8 LM head included) with each product form."""
    schemes: dict[str, WeightQuantization | None] = {"bf16": None}
    for bits in (8, 4):
        for matmul in matmuls:
            schemes[f"int{bits}-{matmul}"] = dataclasses.replace(WEIGHT_FORMATS[f"int{bits}"], matmul=matmul)
    return schemes


def speed(args: argparse.Namespace) -> None:
    schemes = named_schemes(args.matmul)
    for shape in args.shape:
        base = random_shape_model(shape)
        c = base.config
        mm = matmul_ms(c.hidden_size, c.intermediate_size, schemes, args.runs)
        reference_ms: float | None = None
        reference_tokens: list[int] = []
        for name, scheme in schemes.items():
            model = base if scheme is None else quantize_model(base, scheme)
            ms, tokens = decode_ms(model, args.new_tokens, args.runs, args.prompt_tokens)
            if reference_ms is None:
                reference_ms, reference_tokens = ms, tokens
            weights = weight_bytes(model)
            print(json.dumps({
                "shape": shape, "weights": name, "device": jax.devices()[0].device_kind,
                "ms_per_token": round(ms, 3), "tok_s": round(1e3 / ms, 1), "speedup_vs_bf16": round(reference_ms / ms, 3),
                "weight_gb": round(weights / 1e9, 3), "weight_gb_s": round(weights / 1e9 / (ms / 1e3), 1),
                "matmul_ms": round(mm[name], 4), "matmul_speedup_vs_bf16": round(mm["bf16"] / mm[name], 3),
                "greedy_prefix_equal_bf16": tokens[:8] == reference_tokens[:8],
            }), flush=True)
            del model
        del base


def layer_products(shape: str) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of a decoder layer's four products at ``shape``."""
    from zgen import ModelConfig

    c = ModelConfig.from_hf({**SHAPES[shape], "model_type": "llama", "rms_norm_eps": 1e-5})
    return {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }


def products(args: argparse.Namespace) -> None:
    from kernel_trace import _kernel_times  # benchmarks/ is on sys.path when this script runs
    from zgen.pallas.common import platform

    if platform() != "gpu":
        raise SystemExit("products reads device time from a GPU's stream events; run it on a GPU")
    schemes = named_schemes(args.matmul)
    forms = {label: product for label in schemes}
    if "kernel" in args.matmul:  # the tensor-core kernel for 4-bit codes beside the default
        schemes["int4-mma"] = schemes["int4-kernel"]
        forms["int4-mma"] = lambda x, w: quantized_matmul(x, w, implementation="triton-mma")
    key = jax.random.key(0)
    rows = []
    for name, (out, inp) in layer_products(args.shape).items():
        floats = [(jax.random.normal(jax.random.fold_in(key, i), (out, inp), jnp.float32) * inp**-0.5).astype(jnp.bfloat16) for i in range(args.weights)]
        x = jax.random.normal(jax.random.fold_in(key, args.weights), (args.rows, inp), jnp.bfloat16)
        row: dict[str, Any] = {"product": name, "shape": [out, inp], "rows": args.rows, "device": jax.devices()[0].device_kind}
        for label, scheme in schemes.items():
            weights: list[Any] = floats if scheme is None else [quantize(w, scheme, jnp.dtype(jnp.bfloat16)) for w in floats]
            form = forms[label]
            fn = jax.jit(lambda ws, x: [form(x, w) if isinstance(w, QuantizedWeight) else x @ w.T for w in ws])
            outputs = jax.block_until_ready(fn(weights, x))
            if scheme is not None:  # every form against the dequantized product, in float32
                expected = x.astype(jnp.float32) @ dequantize(weights[0]).T
                row[f"{label}_max_error"] = float(jnp.max(jnp.abs(outputs[0].astype(jnp.float32) - expected)))
            samples = []
            for _ in range(args.runs):
                times = _kernel_times(lambda: jax.block_until_ready(fn(weights, x)))
                samples.append(sum(v for k, v in times.items() if not k.startswith("#")) / len(weights))
            row[label] = round(statistics.median(samples), 2)
            del weights
        rows.append(row)
        print(json.dumps(row), flush=True)
    labels = list(schemes)
    print(f"\n{args.rows} row(s); device time per product")
    print("| product | " + " | ".join(labels) + " |\n| --- | " + " | ".join("---:" for _ in labels) + " |")
    for row in rows:
        print(f"| {row['product']} {row['shape'][1]} -> {row['shape'][0]} | " + " | ".join(f"{row[k]:.1f} µs" for k in labels) + " |")


def ppl(args: argparse.Namespace) -> None:
    from zgen.evaluation import perplexity, read_text_file

    loads: dict[str, dict[str, Any]] = {
        "float32 (GGUF dequantized)": dict(),
        "Q4_1 direct (weights='gguf')": dict(weights="gguf"),
        "int8 re-quantized": dict(weights="int8"),
        "int4 re-quantized (default groups: 32, 128 for the down projection)": dict(weights="int4"),
        "int4 re-quantized, groups of 32": dict(weights=WeightQuantization(4, 32)),
    }
    ids: list[int] = []
    rows = []
    for label, options in loads.items():
        model = load_model("smollm2", dtype="float32", **options)
        if not ids:
            ids = model.tokenizer.encode(read_text_file(TEXT), add_special_tokens=False)[: args.tokens]
        start = time.perf_counter()
        result = perplexity(model, ids, window=args.window, chunk=args.chunk)
        linear = sum(w.nbytes for w in model.params.values() if isinstance(w, QuantizedWeight))
        rows.append({"weights": label, "ppl": round(result.ppl, 4), "tokens_scored": result.tokens_scored,
                     "quantized_linear_mb": round(linear / 2**20, 1), "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["ppl"]
    print("\n| weights | perplexity | vs float32 |\n| --- | ---: | ---: |")
    for row in rows:
        print(f"| {row['weights']} | {row['ppl']:.3f} | {100 * (row['ppl'] / base - 1):+.2f} % |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    fast = parts.add_parser("speed")
    fast.add_argument("--shape", nargs="+", choices=list(SHAPES), default=["llama3-8b", "smollm2"])
    fast.add_argument("--new-tokens", type=int, default=128)
    fast.add_argument("--prompt-tokens", type=int, default=16)
    fast.add_argument("--runs", type=int, default=5)
    fast.add_argument("--matmul", nargs="+", choices=MATMULS, default=list(MATMULS))
    per_product = parts.add_parser("products")
    per_product.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    per_product.add_argument("--matmul", nargs="+", choices=MATMULS, default=["reduce", "kernel"])
    per_product.add_argument("--weights", type=int, default=4, help="Distinct matrices per format, timed one after another.")
    per_product.add_argument("--rows", type=int, default=1, help="Rows of the activations (a decode step's batch).")
    per_product.add_argument("--runs", type=int, default=3)
    quality = parts.add_parser("ppl")
    quality.add_argument("--tokens", type=int, default=1024, help="Score the text's first N tokens.")
    quality.add_argument("--window", type=int, default=512)
    quality.add_argument("--chunk", type=int, default=64)
    args = parser.parse_args()
    {"speed": speed, "products": products, "ppl": ppl}[args.part](args)


if __name__ == "__main__":
    main()
