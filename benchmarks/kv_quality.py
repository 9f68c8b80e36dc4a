"""KV-cache quantization and compression study on SmolLM2: perplexity, bytes per token, plot.

For each storage kind, the perplexity of `docs/eval/english.txt` (the method of
`zgen.evaluation.perplexity`: windows of 512 tokens, chunks of 64, every read through the cache) and
the bytes one token takes per layer, measured from the cache's real arrays. Writes the table to
stdout (markdown) and the plot to docs/kv_quantization.png.

    python benchmarks/kv_quality.py [--window 512] [--chunk 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jax

from zgen import Generator, load_model
from zgen.cache.base import CacheBackend
from zgen.cache.compressed import CompressedBackend
from zgen.cache.options import kv_dtype, paged_kv
from zgen.cache.paged import PagedBackend, bytes_per_token_per_layer
from zgen.evaluation import perplexity
from zgen.model import Model

ROOT = Path(__file__).resolve().parent.parent


def state_bytes_per_token_per_layer(backend: CacheBackend[Any], model: Model, tokens: int) -> float:
    """Device bytes of one layer's K/V state holding ``tokens`` tokens, divided by ``tokens``."""
    if isinstance(backend, PagedBackend):  # its state holds the whole pool: count one token's page slots
        c = backend.config
        return bytes_per_token_per_layer(c.kv_dtype, c.kv_heads, c.head_dim, c.page_size)
    state = backend.allocate(1, tokens)
    leaves = jax.tree_util.tree_leaves(state)
    total = sum(leaf.nbytes for leaf in leaves if leaf.ndim > 2)  # per-layer arrays, not block tables
    backend.release(state)
    return total / model.config.num_layers / tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--compressed-chunk", type=int, default=16)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "kv_quantization.png")
    args = parser.parse_args()

    model = load_model("smollm2", dtype="float32")
    ids = model.tokenizer.encode((ROOT / "docs" / "eval" / "english.txt").read_text(), add_special_tokens=False)
    c = model.config
    kinds: dict[str, CacheBackend[Any]] = {
        name: Generator(model, paged_kv(256), kv_dtype(name)).kv_backend for name in ("fp32", "fp16", "bf16", "fp8", "q4", "q3")
    }
    # Raw ring of 4 chunks: bounded memory, and room for a prefill chunk of `args.chunk` tokens.
    ring = max(4 * args.compressed_chunk, args.chunk + args.compressed_chunk)
    kinds[f"compressed (chunk {args.compressed_chunk})"] = CompressedBackend(
        c.num_layers, c.num_kv_heads, c.head_dim, args.compressed_chunk, model.dtype, raw_slots=ring
    )
    rows: list[dict[str, Any]] = []
    for name, backend in kinds.items():
        result = perplexity(model, ids, window=args.window, chunk=args.chunk, backend=backend)
        per_token = state_bytes_per_token_per_layer(backend, model, args.window)
        rows.append({"kind": name, "ppl": result.ppl, "nll": result.nll, "tokens": result.tokens_scored,
                     "bytes_per_token_per_layer": per_token})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["ppl"]
    print(f"\n{len(ids)} tokens, window {args.window}, chunk {args.chunk}\n")
    print("| kind | PPL | vs fp32 | bytes/token/layer |\n| --- | ---: | ---: | ---: |")
    for row in rows:
        row["increase_pct"] = 100 * (row["ppl"] / base - 1)
        print(f"| {row['kind']} | {row['ppl']:.3f} | {row['increase_pct']:+.2f} % | {row['bytes_per_token_per_layer']:.0f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for row in rows:
        ax.scatter(row["bytes_per_token_per_layer"], row["increase_pct"])
        ax.annotate(row["kind"], (row["bytes_per_token_per_layer"], row["increase_pct"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes per token per layer (K + V)")
    ax.set_ylabel("perplexity increase over fp32 (%)")
    ax.set_title(f"SmolLM2-135M, {len(ids)}-token English text")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
