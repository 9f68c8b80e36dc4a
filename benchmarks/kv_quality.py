"""KV-cache quantization and compression study on SmolLM2: perplexity, bytes per token, decode speed, plot.

For each storage kind, the perplexity of `docs/eval/english.txt` (the method of
`zgen.evaluation.perplexity`: windows of 512 tokens, chunks of 64, every read through the cache), the
bytes one token takes per layer (measured from the cache's real arrays) and the greedy decode speed
on this machine (batch 1, a 512-token prompt from the text, median of several rounds that interleave
the kinds, after a warm-up; prefill excluded). The coded formats (q4, q3) run twice: with the key calibration of
`zgen.runtime.calibration.key_calibration` (random calibration tokens: nothing of the text is seen) and without
one (Hadamard rotation only). Writes the table to stdout (markdown) and the plot to
docs/kv_quantization.png.

    python benchmarks/kv_quality.py [--window 512] [--chunk 64] [--decode-tokens 64] [--fit-levels]

``--fit-levels`` also refits the Q3 levels by sensitivity-weighted k-means on the calibration tokens
(see `zgen.pallas.paged_attention.layouts`) and prints them next to ``Q3_LEVELS``. ``--text-tokens N``
scores only the first N tokens of the text (a quick check, not the study).
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from zgen import Engine, EngineConfig, load_model, stop
from zgen.cache.compressed import CompressedKVState
from zgen.cache.factory import CacheOption, compressed_kv, kv_dtype, paged_kv
from zgen.cache.formats import FORMATS, KV_DTYPES, bytes_per_token_per_layer, q3_group_size
from zgen.cache.slots import SlotKVManager
from zgen.cache.tensor import causal_attention
from zgen.evaluation import perplexity
from zgen.graph.core import ForwardContext
from zgen.graph.decoder import LOGIT_ROWS, POSITIONS, TOKENS
from zgen.rope import rotary
from zgen.model import Model
from zgen.pallas.paged_attention.layouts import Q3_LEVELS, KeyCalibration, hadamard
from zgen.runtime import ForwardRequest
from zgen.runtime.calibration import key_calibration

ROOT = Path(__file__).resolve().parent.parent
POOL_MB = 256.0
PAGE_SIZE = 16


@dataclass(frozen=True)
class Kind:
    """One storage kind of the study: its cache options and, for the coded formats, the key calibration."""

    options: tuple[CacheOption, ...]
    calibration: tuple[KeyCalibration, ...] | None = None
    page_format: str | None = None  # the paged cache's kv dtype; None: the compressed cache


def paged(name: str, calibration: tuple[KeyCalibration, ...] | None = None) -> Kind:
    return Kind((paged_kv(POOL_MB, PAGE_SIZE), kv_dtype(name)), calibration, page_format=name)


def uncalibrated(model: Model) -> tuple[KeyCalibration, ...]:
    """Identity key calibrations: the coded formats then only rotate keys (Hadamard)."""
    c = model.config
    return tuple(KeyCalibration.identity(c.num_kv_heads, c.head_dim) for _ in range(c.num_layers))


def engine_for(model: Model, kind: Kind, config: EngineConfig) -> Engine:
    return Engine(model, *kind.options, config=config, key_calibration=kind.calibration)


def state_bytes_per_token_per_layer(model: Model, kind: Kind, prefill_chunk: int, tokens: int) -> float:
    """Device bytes of one layer's K/V holding ``tokens`` tokens, divided by ``tokens``.

    Paged kinds: one token's page slots (the pool holds whole pages of every sequence). The compressed
    cache: its pooled sums and raw ring in a state of one row sized to ``tokens`` positions, with the
    ring the engine of the perplexity run gives it (its size depends on the prefill chunk).
    """
    c = model.config
    if kind.page_format is not None:
        return bytes_per_token_per_layer(kind.page_format, c.num_kv_heads, c.head_dim, PAGE_SIZE)
    engine = engine_for(model, kind, EngineConfig(max_batch=1, prefill_chunk=prefill_chunk))
    manager = engine.kv
    assert isinstance(manager, SlotKVManager)
    seq = engine.new_sequence()
    seq.kv.reserve(1)  # the row is allocated at its first reservation
    state = manager.state
    assert isinstance(state, CompressedKVState)
    engine.release(seq)
    shapes = jax.eval_shape(
        lambda: CompressedKVState.zeros(
            c.num_layers, 1, tokens, c.num_kv_heads, c.head_dim, model.dtype, chunk_size=state.chunk_size, raw_slots=state.raw_slots
        )
    )
    leaves = jax.tree_util.tree_leaves(shapes)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves if leaf.ndim > 2)  # K/V arrays, not counts or positions
    return total / c.num_layers / tokens


def decode_seconds(engine: Engine, prompt: Sequence[int], new_tokens: int) -> float:
    """Seconds from the first generated token to the last of a greedy generation (EOS ignored)."""
    seq = engine.new_sequence(prompt)
    try:
        last = len(prompt) - 1
        request = ForwardRequest(end=len(prompt), sample_at=(last,), generate=stop.max_len(new_tokens))
        return engine.wait(engine.submit(seq, request)).decode_s
    finally:
        engine.release(seq)


def decode_tokens_per_s(
    model: Model, kinds: dict[str, Kind], prompt: list[int], new_tokens: int, rounds: int
) -> dict[str, float]:
    """Greedy decode speed per kind at batch 1, the prompt fed in one step; the rounds interleave the
    kinds, so load from other processes on a shared machine spreads over all of them rather than
    landing on one."""
    config = EngineConfig(max_batch=1, prefill_chunk=len(prompt))
    engines = {name: engine_for(model, kind, config) for name, kind in kinds.items()}
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        decode_seconds(engine, prompt, new_tokens)  # warm-up: compilation
    for _ in range(rounds):
        for name, engine in engines.items():
            seconds[name].append(decode_seconds(engine, prompt, new_tokens))
    return {name: new_tokens / statistics.median(times) for name, times in seconds.items()}


class _CodedActivations(ForwardContext):
    """Causal attention of each window over itself, keeping every layer's (rotated) keys and values."""

    def __init__(self) -> None:
        self.keys: list[Array] = []
        self.values: list[Array] = []

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        inv_freq: Float[Array, " half"],
    ) -> Float[Array, "B T H D"]:
        k = rotary(k, positions, inv_freq)
        self.keys.append(k)
        self.values.append(v)
        return causal_attention(q, k, v, positions, sliding_window=None)


def fit_q3_levels(model: Model, calibration: tuple[KeyCalibration, ...], rounds: int = 20, seed: int = 0) -> dict[str, Any]:
    """Sensitivity-weighted k-means of the Q3 levels over coded keys and values of random calibration tokens.

    Each group's values are divided by its least-squares scale for the current levels; a value's weight
    is that scale squared, so the fit minimises the error of the coded values themselves (the keys'
    coding already carries their Fisher-proxy channel weights). Starts from a uniform grid.
    """
    tokens = np.random.default_rng(seed + 1).integers(0, model.config.vocab_size, (4, 512), dtype=np.int32)
    positions = np.broadcast_to(np.arange(512, dtype=np.int32), tokens.shape)
    context = _CodedActivations()
    feeds = {TOKENS: jnp.asarray(tokens), POSITIONS: jnp.asarray(positions), LOGIT_ROWS: jnp.zeros((4, 1), jnp.int32)}
    model.graph.run(model.params, feeds, context)
    group = q3_group_size(model.config.head_dim)
    at = jnp.asarray(positions)[:, :, None]
    coded = {
        "keys": [np.asarray(cal.encode(k, at, head_axis=-2)) for cal, k in zip(calibration, context.keys, strict=True)],
        "values": [np.asarray(hadamard(v)) for v in context.values],
    }
    fits: dict[str, Any] = {}
    for kind, layers in coded.items():
        per_layer = []
        for y in [np.concatenate([x.reshape(-1, group) for x in layers])] + [x.reshape(-1, group) for x in layers]:
            levels = np.linspace(-2.0, 2.0, 8)
            for _ in range(rounds):
                scale = np.sqrt(np.mean(y * y, axis=-1, keepdims=True)) + 1e-12
                for _ in range(3):
                    assigned = levels[np.argmin(np.abs(y[..., None] / scale[..., None] - levels), axis=-1)]
                    scale = np.sum(y * assigned, -1, keepdims=True) / np.sum(assigned**2, -1, keepdims=True) + 1e-12
                u, weight = (y / scale).ravel(), np.broadcast_to(scale**2, y.shape).ravel()
                nearest = np.argmin(np.abs(u[:, None] - levels), axis=-1)
                mass = np.bincount(nearest, weight, 8)
                levels = np.sort(np.where(mass > 0, np.bincount(nearest, weight * u, 8) / np.maximum(mass, 1e-30), levels))
            per_layer.append(levels)
        fits[kind] = {
            "all_layers": np.round(per_layer[0], 3).tolist(),
            "max_layer_deviation_from_Q3_LEVELS": float(np.max(np.abs(np.asarray(per_layer[1:]) - np.asarray(Q3_LEVELS)))),
        }
    return fits


def plot(rows: list[dict[str, Any]], text_tokens: int, path: Path) -> None:
    """PPL increase against bytes per token, one point per kind (kinds on the same point share a label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[tuple[float, float], list[str]] = {}
    for row in rows:
        points.setdefault((row["bytes_per_token_per_layer"], round(row["increase_pct"], 1)), []).append(row["kind"])
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    for (size, increase), names in points.items():
        ax.scatter(size, increase)
        ax.annotate(" / ".join(names), (size, increase), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for goal, label in ((1.0, "fp8 goal"), (2.0, "q4 goal"), (5.0, "q3 goal")):
        ax.axhline(goal, color="grey", linestyle=":", linewidth=0.8)
        ax.annotate(label, (1.0, goal), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=7, color="grey")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_ylim(-0.02, 3000)
    ax.set_xlabel("bytes per token per layer (K + V)")
    ax.set_ylabel("perplexity increase over fp32 (%)")
    ax.set_title(f"SmolLM2-135M, {text_tokens}-token English text")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--compressed-chunk", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-rounds", type=int, default=5)
    parser.add_argument("--fit-levels", action="store_true")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "kv_quantization.png")
    parser.add_argument("--kinds", nargs="*", help="only these kinds (e.g. fp32 q4 q3 compressed); default: all, and the plot")
    parser.add_argument("--text-tokens", type=int, help="score only the text's first N tokens (default: all)")
    parser.add_argument(
        "--format-module", type=Path, action="append", default=[],
        help="a Python file that registers KV formats of its own (e.g. examples/custom_kv_format.py); they join the kinds",
    )
    args = parser.parse_args()
    for path in args.format_module:
        runpy.run_path(str(path))

    model = load_model("smollm2", dtype="float32")
    ids = model.tokenizer.encode((ROOT / "docs" / "eval" / "english.txt").read_text(), add_special_tokens=False)
    ids = ids[: args.text_tokens]
    calibration = key_calibration(model)
    if args.fit_levels:
        print(json.dumps({"q3_levels_fit": fit_q3_levels(model, calibration), "Q3_LEVELS": Q3_LEVELS}), flush=True)
    kinds: dict[str, Kind] = {name: paged(name) for name in ("fp32", "fp16", "bf16", "fp8")}
    for name in ("q4", "q3"):
        kinds[name] = paged(name, calibration)
        kinds[f"{name}, no calibration"] = paged(name, uncalibrated(model))
    kinds.update({name: paged(name) for name in FORMATS if name not in KV_DTYPES})  # registered by --format-module
    compressed = f"compressed (chunk {args.compressed_chunk})"
    kinds[compressed] = Kind((compressed_kv(args.compressed_chunk),))
    if args.kinds:
        kinds = {name: kind for name, kind in kinds.items() if name.split(",")[0].split(" ")[0] in args.kinds}
    rows: list[dict[str, Any]] = []
    for name, kind in kinds.items():
        result = perplexity(model, ids, *kind.options, window=args.window, chunk=args.chunk, key_calibration=kind.calibration)
        rows.append(
            {
                "kind": name,
                "ppl": result.ppl,
                "nll": result.nll,
                "tokens": result.tokens_scored,
                "bytes_per_token_per_layer": state_bytes_per_token_per_layer(model, kind, args.chunk, args.window),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    speeds = decode_tokens_per_s(model, kinds, ids[: args.window], args.decode_tokens, args.decode_rounds)
    for row in rows:
        row["decode_tokens_per_s"] = speeds[row["kind"]]
    print(json.dumps({"decode_tokens_per_s": speeds}), flush=True)
    base = rows[0]["ppl"]
    print(f"\n{len(ids)} tokens, window {args.window}, chunk {args.chunk}; decode: batch 1 after a {args.window}-token prompt\n")
    print("| kind | PPL | vs fp32 | bytes/token/layer | decode tok/s |\n| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        row["increase_pct"] = 100 * (row["ppl"] / base - 1)
        print(
            f"| {row['kind']} | {row['ppl']:.3f} | {row['increase_pct']:+.2f} % | {row['bytes_per_token_per_layer']:.0f} "
            f"| {row['decode_tokens_per_s']:.1f} |"
        )

    if not args.kinds:
        plot(rows, len(ids), args.plot)


if __name__ == "__main__":
    main()
