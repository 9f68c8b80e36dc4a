"""Speculative decoding: plain greedy decode vs each speculator, batch 1 and 8, in one run.

For every batch size, prompt group and speculator: tokens/s of the whole generation (wall time of
``batch_generate``, median of ``--runs`` after a warm-up that compiles), the speedup over plain
decoding of the same requests (the median of ``--runs`` rounds, each timing plain decoding and every
speculator once, in an order rotated every round, with the rounds' least and largest speedup beside
it: a speedup whose range straddles 1.0 is not told apart from plain), the acceptance figures (drafted, accepted, acceptance rate, mean
accepted per verification pass), how many plain decode steps the speculative loops took (every row
in fallback, or nothing drafted; over the warm-up and the timed runs), what the engine measured a
plain decode step to take and a pass to cost in plain steps at the batch's width, and a check that the greedy tokens equal plain
decoding's token for token (``same``: False marks a bug, or a near-tie flipped by bf16 rounding in a
longer verification pass; run ``--dtype float32`` to tell them apart).

The prompts are chat questions, code, and summaries of two given passages of about 300 tokens
(where prompt lookup should pay); ``--prompts`` picks the groups measured apart (``summary``, ``mix``:
all of them in turn, ``chat``, ``code``). A timed generation is every prompt of the group, or
``batch`` of them cycling over it where the batch is wider: at batch 1 the mix is its 6 prompts one
after another (until 2026-12-07 a batch-1 row timed the group's first prompt alone: the chat
question for ``mix``). With random weights (the default: SmolLM2's shape, no
checkpoint needed) the timings of the loop are real but acceptance is not meaningful (a random model's
early layers predict nothing and its text does not quote the prompt); pass a model (``--model
smollm2``, a .gguf path or an HF directory) for real acceptance. ``--runs 0`` skips the timing
(acceptance only, e.g. on a CPU: acceptance does not depend on the device).

    python benchmarks/speculative.py                                   # random SmolLM2 shape
    python benchmarks/speculative.py --model SmolLM2-135M-Instruct.Q4_1.gguf --speculators prompt-lookup early-exit:8
    python benchmarks/speculative.py --model smollm2 --dtype float32 --batch 1 --runs 0 --prompts summary \\
        --speculators prompt-lookup:3-1 prompt-lookup:4-2                # acceptance of two n-gram ranges
    python benchmarks/speculative.py --speculators draft:smollm2 --kv-dtype fp8 --json
    python benchmarks/speculative.py --model smollm2 --speculators prompt-lookup prompt-lookup:fixed jacobi jacobi:fixed

``prompt-lookup:MAX-MIN`` tries n-grams of MAX down to MIN tokens (default 3-1); ``prompt-lookup:MAX-MINxR``
verifies what followed the R best matches as one token tree (``PromptLookup(branches=R)``). ``jacobi`` is
Jacobi (lookahead) decoding verifying up to ``--num-draft-tokens`` guesses a pass (default 8). Both take
the adaptive fallback to plain decoding (their default); a ``+fixed`` suffix (``prompt-lookup:fixed`` or
``jacobi:fixed`` alone for the defaults) makes every step a pass (``adaptive=False``), and ``+adaptive``
names the default (older commands in BENCHMARKS.md use it). ``eagle:DIR`` drafts with the EAGLE head in
DIR (trained for the same model and weights, e.g. by ``benchmarks/eagle.py --out DIR``).
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

# Two passages of a few hundred tokens each to summarise (where prompt lookup should pay: a summary
# quotes its source's names, figures and phrases).
PASSAGES = (
    "The town of Harrowmere drew its water from a single reservoir until the dry summer of 2019, when "
    "the level fell to eleven percent of capacity and the council imposed a ban on garden hoses for "
    "nine weeks. In the following spring the council approved a plan with three parts. First, the old "
    "cast-iron mains under the market district, laid between 1890 and 1910, would be replaced with "
    "polyethylene pipe, because surveys showed that they lost about a quarter of the water they carried "
    "through cracks and failed joints. Second, a second reservoir would be built in the Fell valley, "
    "four kilometres north of the town, holding 2.4 million cubic metres, roughly the same as the first. "
    "Third, every household would receive a water meter, so that bills would follow use rather than the "
    "rateable value of the house. The replacement of the mains took three years and cost 14 million "
    "pounds, two million more than planned, mostly because the excavations uncovered medieval cellars "
    "that archaeologists had to record before work could continue. The Fell valley reservoir opened in "
    "2023, six months late. The meters proved the most contested part of the plan: a petition against "
    "them gathered 3,100 signatures, and the council agreed to cap the bills of pensioners living alone. "
    "By 2024 the town used 18 percent less water per person than in 2019, and leakage had fallen from "
    "about a quarter to under eight percent.",
    "Mira Castellan began keeping bees on the roof of her bakery in 2015 with two hives bought from a "
    "retiring beekeeper. Within five years she ran forty hives on eleven roofs across the city, placed "
    "on hotels, a library, two schools and the central railway station. Each hive produced between "
    "twelve and twenty kilograms of honey a year, and the honey from each roof tasted different, "
    "because the bees foraged on whatever grew within about three kilometres: lime trees near the "
    "station, lavender and rosemary around the library, and clover in the parks by the schools. "
    "Castellan sold the honey in jars labelled by roof, and the station honey became the most popular, "
    "selling out each September. The schools used their hives in biology lessons, and pupils weighed "
    "the frames and counted the bees returning with pollen. In 2021 a hard winter killed nine of the "
    "forty colonies, and Castellan changed how she prepared them for the cold: she left more honey in "
    "each hive, added wooden insulation boards and moved the most exposed hives away from the edges of "
    "the roofs. The next winter only two colonies died. She now trains twenty new urban beekeepers a "
    "year and says the main limit on the city's bees is no longer the cold but the number of flowers.",
)
PROMPTS = {
    "chat": ("What are three good habits for staying healthy? Answer briefly.",),
    "code": ("Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",),
    "summary": tuple(
        f"{task}\n\n{passage}"
        for passage in PASSAGES
        for task in ("Summarise this passage in a few sentences, keeping its names and figures:",
                     "Summarise the passage below. Quote its key figures.")
    ),
}
#: Prompt groups a row is measured on: each kind alone, and every prompt in turn.
GROUPS = (*PROMPTS, "mix")


def load(args: argparse.Namespace) -> Model:
    from zgen import ModelConfig, load_model
    from zgen.model import random_model

    if args.model is None:
        config = ModelConfig.from_hf({**SHAPES["smollm2"], "model_type": "llama", "rms_norm_eps": 1e-5})
        return random_model(config, dtype=args.dtype)
    return load_model(args.model, dtype=args.dtype)


def prompts(model: Model, batch: int, real: bool, group: str = "mix", *, every: bool = False) -> list[Any]:
    """``batch`` prompts cycling over ``group`` (a kind of :data:`PROMPTS`, or ``mix``: every prompt),
    or with ``every`` at least each of the group's once (a batch narrower than the group then runs its
    prompts a batch after another, as a server would): chat messages with real weights (text where the
    model has no chat template); with random weights, token ids of the same lengths whose text repeats
    (the random tokenizer knows no words)."""
    texts = [text for kind, texts in PROMPTS.items() if group in (kind, "mix") for text in texts]
    chosen = [texts[i % len(texts)] for i in range(max(batch, len(texts)) if every else batch)]
    if real:
        if model.tokenizer.chat_template is None:
            return chosen
        return [[{"role": "user", "content": text}] for text in chosen]
    vocab = model.config.vocab_size
    out = []
    for i, text in enumerate(chosen):
        passage = [(1000 + 37 * j + 11 * i) % vocab for j in range(len(text.split()) * 2)]
        out.append(passage + passage[: len(passage) // 3])
    return out


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every speculative benchmark shares: the model, batch sizes, lengths and cache."""
    parser.add_argument("--model", default=None, help="built-in name, .gguf or HF directory (default: random SmolLM2 shape)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3, help="timed runs after the warm-up (0: the warm-up only, no timing)")
    parser.add_argument("--kv-cache", default=None, help="cache kind (tensor, flat, paged, tiered)")
    parser.add_argument("--kv-dtype", default=None, help="KV format (fp32, bf16, fp16, fp8, q4, q3)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")


def figures(results: list[GenerationResult]) -> dict[str, float]:
    """The speculative figures of a batch of results: drafted, accepted, rate, accepted per pass."""
    stats = [r.speculative for r in results if r.speculative is not None]
    drafted, accepted, passes = (sum(getattr(s, f) for s in stats) for f in ("draft_tokens", "accepted_tokens", "steps"))
    return dict(
        draft_tokens=drafted, accepted_tokens=accepted, acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_per_step=accepted / passes if passes else 0.0, passes=passes,
    )


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'batch':>5} {'prompts':<8} {'speculator':<22} {'tok/s':>9} {'speedup':>8} {'rounds':>11} {'accept':>7} {'acc/pass':>8} {'same':<5} "
          "fallback steps  plain step (ms)  pass (steps)  compiled in timed runs (s)")
    for row in rows:
        print(f"{row['batch']:>5} {row.get('prompts', 'mix'):<8} {row['speculator']:<22} {row['tokens_per_s']:>9.1f} "
              f"{row['speedup']:>7.2f}x {'-'.join(f'{x:.2f}' for x in row.get('speedup_range', [])):>11} {row.get('acceptance_rate', 0.0):>7.2f} {row.get('mean_accepted_per_step', 0.0):>8.2f} "
              f"{row['same']!s:<5} {row.get('fallback_steps', ''):<15} {row.get('plain_step_ms', ''):<16} {row.get('pass_steps', ''):<13} {row.get('compile_s_in_timed_runs', '')}")


def speculator(spec: str, model: Model, args: argparse.Namespace) -> Speculator:
    from zgen import load_model
    from zgen.speculative import DraftModel, Eagle, Jacobi, PromptLookup

    kind, _, value = spec.partition(":")
    value, adaptive = fallback_mode(value) if kind in ("prompt-lookup", "jacobi") else (value, True)
    if kind == "prompt-lookup":
        ngrams, _, branches = (value or "3-1").partition("x")
        longest, _, shortest = ngrams.partition("-")
        return PromptLookup(
            int(longest), args.num_draft_tokens or 8, min_ngram=int(shortest or longest), branches=int(branches or 1), adaptive=adaptive
        )
    if kind == "early-exit":
        return DraftModel.early_exit(model, layers=int(value or 8), num_tokens=args.num_draft_tokens or 4)
    if kind == "draft":
        return DraftModel(load_model(value, dtype=args.dtype), args.num_draft_tokens or 4)
    if kind == "eagle" and value:
        return Eagle.load(value, model, args.num_draft_tokens or 4)
    if kind == "jacobi" and not value:
        return Jacobi(args.num_draft_tokens or 8, adaptive=adaptive)
    raise SystemExit(
        f"unknown speculator {spec!r}: prompt-lookup[:MAX-MIN[xR]][+fixed], early-exit:N, draft:MODEL, eagle:DIR, jacobi or jacobi:fixed"
    )


def fallback_mode(value: str) -> tuple[str, bool]:
    """A prompt-lookup or jacobi spec's value without its ``+fixed`` / ``+adaptive`` suffix, and whether
    the speculator takes the adaptive fallback (the default)."""
    for mode, adaptive in (("fixed", False), ("adaptive", True)):
        if value == mode or value.endswith(f"+{mode}"):
            return value.removesuffix(mode).removesuffix("+"), adaptive
    return value, True


def warm_up(generator: Generator, requests: list[Any], timing: bool) -> list[GenerationResult]:
    """Generations until one compiles nothing (an adaptive speculator's loops change shape as it learns
    what a pass costs); without ``timing``, one: its results give the acceptance figures."""
    runner = generator.engine.runner
    for _ in range(4 if timing else 1):
        compiled = runner.compile_seconds
        results = generator.batch_generate(requests)
        if runner.compile_seconds == compiled:
            break
    return results


def interleaved(generators: dict[str, Generator], requests: list[Any], runs: int) -> dict[str, dict[str, Any]]:
    """Each generator warmed up, then ``runs`` rounds that time one generation of each, in an order
    rotated every round (load from elsewhere and the device's clocks then spread over every side):
    per side the rounds' seconds, its last results and the seconds it still spent compiling."""
    out: dict[str, dict[str, Any]] = {name: {"results": warm_up(g, requests, runs > 0), "seconds": [], "compiled": 0.0} for name, g in generators.items()}
    names = list(generators)
    for r in range(runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runner = generators[name].engine.runner  # the model's, shared by the sides: count its compiles around this call
            compiled, start = runner.compile_seconds, time.perf_counter()
            out[name]["results"] = generators[name].batch_generate(requests)
            out[name]["seconds"].append(time.perf_counter() - start)
            out[name]["compiled"] += runner.compile_seconds - compiled
    return out


def median(seconds: list[float]) -> float:
    return statistics.median(seconds) if seconds else float("nan")


def speedup(plain: list[float], side: list[float]) -> tuple[float, float, float]:
    """The median, least and largest of the rounds' speedups (plain seconds over the side's, round by
    round): NaN without timed rounds."""
    ratios = sorted(p / s for p, s in zip(plain, side, strict=True))
    return (statistics.median(ratios), ratios[0], ratios[-1]) if ratios else (float("nan"),) * 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(parser)
    parser.add_argument("--speculators", nargs="+", default=["prompt-lookup", "early-exit:8"])
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--prompts", nargs="+", default=["summary", "mix"], choices=GROUPS,
                        help="prompt groups, each measured apart (a kind of prompt, or mix: all of them in turn)")
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
        for group in args.prompts:
            requests = [Request(p, sampling) for p in prompts(model, batch, real=args.model is not None, group=group, every=True)]
            plain = Generator(model, *options, max_batch_size=max(batch, 1))
            drafting = {name: Generator(model, *options, max_batch_size=max(batch, 1), speculative=spec) for name, spec in speculators.items()}
            timed = interleaved({"plain": plain, **drafting}, requests, args.runs)
            base, base_s = timed["plain"]["results"], timed["plain"]["seconds"]
            tokens = sum(len(r.token_ids) for r in base)
            rows.append(dict(batch=batch, prompts=group, speculator="plain", tokens_per_s=tokens / median(base_s), speedup=1.0, same=True))
            for name, spec in speculators.items():
                side, generator = timed[name], drafting[name]
                ratio, least, most = speedup(base_s, side["seconds"])
                rows.append(dict(
                    batch=batch, prompts=group, speculator=name, tokens_per_s=tokens / median(side["seconds"]), speedup=ratio,
                    speedup_range=[round(least, 3), round(most, 3)],
                    same=[r.token_ids for r in side["results"]] == [r.token_ids for r in base], **figures(side["results"]),
                    fallback_steps=generator.engine.stats.fallback_steps, compile_s_in_timed_runs=round(side["compiled"], 2),
                    pass_steps=round(generator.engine.loop_times.pass_cost(batch, spec), 2),
                    plain_step_ms=round((generator.engine.loop_times.per_iteration(("plain", batch)) or 0.0) * 1e3, 3),
                ))
    report = dict(device=str(jax.devices()[0]), model=args.model or "random smollm2 shape", dtype=args.dtype,
                  new_tokens=args.new_tokens, kv_cache=args.kv_cache, kv_dtype=args.kv_dtype, rows=rows)
    if not args.json:
        print(f"{report['device']}  {report['model']}  {args.dtype}  {args.new_tokens} new tokens")
        print_rows(rows)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
