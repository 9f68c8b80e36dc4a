"""A batch job's output tokens/s: ``zgen.batch.run`` vs ``Generator.batch_generate`` in fixed chunks.

The job (the issue's shape): 1,000 requests, prompts of 256–1,024 tokens, 128–512 new tokens, a
shared 200-token system prompt on half of them; random weights of the SmolLM2 or Llama-3-8B shape,
greedy, token-id prompts (``/v1/completions`` takes them), the same requests on both sides in one run:

* **batch job** — ``zgen.batch.run`` on the JSONL file, on a paged cache (``--kv-memory-mb``), up to
  ``--job-batch-size`` rows: requests queued on the engine as room allows (freed rows refilled
  ``--refill-rows`` at a time into the job's packed prefill steps; ``--step-tokens`` makes them
  streams of that many tokens; ``--variants`` runs other schedules, padded steps among them),
  the prefix cache serving the shared system prompt (``--no-prefix-cache`` turns it off), results
  appended and synced as they finish.
* **fixed chunks** — the baseline a user writes without a job runner: ``Generator.batch_generate``
  over consecutive chunks of ``--max-batch-size`` requests, each chunk waiting for its longest request.

Both sides get the same KV memory: by default the job's page pool is what the chunks' dense cache
allocates (``--max-batch-size`` rows of the next power of two above the longest request, the dense
cache's capacity rule). Rows of a dense cache hold their longest possible length; pages hold what a
row has written, so the same memory runs more rows at once (``--job-batch-size``, default twice the
chunks'), and a row that finds the pool full waits or is recomputed later (the engine's preemption).
``--job-batch-size`` equal to ``--max-batch-size`` compares the two at the same batch instead.

With ``--lora-adapters K`` the batch job also runs a third time with K random rank-``--lora-rank``
LoRA modules registered (``lora_modules=``), request *i* naming module ``i mod (K+1)`` (the last share
on the base model) by its ``model`` field: its tokens/s next to the plain job's shows what per-request
adapters cost in a job (rows of different adapters share each step).

Both sides first run a warm-up job of twice their batch of requests of the same kind (compiling most
shape buckets), then the measured one. ``--trace-steps`` adds where each measured side's time went:
its compiles (count, seconds, each one's shapes), and per kind of engine step (prefill/mixed steps, decode loops) the
calls, forward passes, tokens and seconds, compiles taken out. ``--scale`` shrinks the job for a CPU (request count, prompt
and output lengths). With ``--bandwidth-gbs`` the report gives the weights-only roofline
(``job-batch-size`` rows per read of the weights); with ``--trace-steps`` too, each side's decode
against the bandwidth roofline at the batch sizes it reached: the bytes its decode passes had to
read (the weights once a pass, the embedding table aside, and each decoded token's valid KV: its
row's prompt and the tokens before it) over ``--bandwidth-gbs``, against its measured decode seconds.

    python benchmarks/batch_job.py --shape llama3-8b --dtype bfloat16 --bandwidth-gbs 4800     # H200
    python benchmarks/batch_job.py --shape smollm2 --scale 0.03 --dtype float32 --max-batch-size 8  # CPU
    python benchmarks/batch_job.py --shape llama3-8b --dtype bfloat16 --lora-adapters 4            # with LoRA
    python benchmarks/batch_job.py --shape tiny --dtype float32 --trace-steps --variants padded:64 packed:16  # schedules' counts, CPU
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from gpu_decode import SHAPES  # noqa: E402  (benchmarks/ is on sys.path when this script runs)

SYSTEM_TOKENS = 200
# A two-layer model for the job's scheduling on a CPU: with --trace-steps, its step, slot and pass
# counts are the large shapes' (the pool holds the same tokens), at a fraction of the time.
JOB_SHAPES = {**SHAPES, "tiny": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True)}


class StepTrace:
    """Times the engine's steps and the runner's compiles while installed (``--trace-steps``)."""

    def __init__(self) -> None:
        import jax

        from zgen.runtime.engine import Engine
        from zgen.runtime.runner import Runner

        self.compile_s, self.compiles, self.compiled = 0.0, 0, []
        self.steps: dict[str, list[float]] = {}
        self.slots = 0  # token slots of the mixed steps' matmuls: rows x chunk padded, or the packed stream
        self.device_s = 0.0  # from a compiled call's dispatch to its results being ready
        compiled, methods = Runner._compiled, {name: getattr(Engine, name) for name in ("_run_mixed", "_run_decode")}
        mixed, decode = Runner.mixed, Runner.decode

        def until_ready(call: Any) -> Any:
            def run(runner: Any, *args: Any, **kwargs: Any) -> Any:
                compile_s, start = self.compile_s, time.perf_counter()
                out = jax.block_until_ready(call(runner, *args, **kwargs))  # the step reads them next anyway
                self.device_s += time.perf_counter() - start - (self.compile_s - compile_s)
                return out
            return run

        def counted_mixed(runner: Any, kv: Any, batch: Any, **kwargs: Any) -> Any:
            self.slots += batch.tokens.size
            return mixed(runner, kv, batch, **kwargs)

        def timed_compile(runner: Any, key: Any, lower: Any) -> Any:
            if key in runner._executables:
                return runner._executables[key]
            start = time.perf_counter()
            out = compiled(runner, key, lower)
            self.compile_s += time.perf_counter() - start
            self.compiles += 1
            self.compiled.append(describe_compile(key))
            return out

        def timed_step(name: str) -> Any:
            def run(engine: Any, rows: list[Any], *args: Any, **kwargs: Any) -> Any:
                compile_s, passes, decoded, device_s = self.compile_s, engine.stats.forward_passes, engine.stats.decode_tokens, self.device_s
                start = time.perf_counter()
                out = methods[name](engine, rows, *args, **kwargs)
                totals = self.steps.setdefault(name.removeprefix("_run_"), [0, 0, 0, 0, 0.0, 0.0])
                totals[0] += 1
                totals[1] += engine.stats.forward_passes - passes
                totals[2] += sum(row.count for row in rows)
                totals[3] += engine.stats.decode_tokens - decoded
                totals[4] += time.perf_counter() - start - (self.compile_s - compile_s)
                totals[5] += self.device_s - device_s
                return out
            return run

        Runner._compiled = timed_compile  # type: ignore[method-assign]
        Runner.mixed = until_ready(counted_mixed)  # type: ignore[method-assign]
        Runner.decode = until_ready(decode)  # type: ignore[method-assign]
        for name in methods:
            setattr(Engine, name, timed_step(name))

    def take(self) -> dict[str, Any]:
        """What was timed since the last take."""
        steps = {
            kind: {"calls": c, "forward_passes": p, "fed_tokens": f, "decode_tokens": d, "seconds": t, "ms_per_pass": t / max(p, 1) * 1e3,
                   "device_s": dev, "host_ms_per_call": (t - dev) / max(c, 1) * 1e3}
            for kind, (c, p, f, d, t, dev) in self.steps.items()
        }
        if "mixed" in steps:
            steps["mixed"]["slots"] = self.slots
        out = {"compiles": self.compiles, "compile_s": self.compile_s, "compiled": self.compiled, "steps": steps}
        self.compile_s, self.compiles, self.compiled, self.steps, self.slots = 0.0, 0, [], {}, 0
        return out


DESCRIBED = (".tokens", ".read_rows", ".packing.rows", ".packing.owners", ".token", ".out_tokens")  # what tells compiles apart


def describe_compile(key: Any) -> str:
    """A compile's kind and the shapes it was fed, the cache's left out (one cache per job):
    ``mixed .tokens=[1, 4096] .read_rows=[16, 1] .packing.rows=[16, 256]``."""
    import jax

    if key[0] not in ("mixed", "decode"):
        return str(key[0])
    treedef, leaves = key[2]
    paths = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves)))[0]
    named = {jax.tree_util.keystr(path): list(shape) for (path, _), (shape, _) in zip(paths, leaves, strict=True)}
    shapes = (f"{name}={shape}" for name, shape in named.items() if name in DESCRIBED)
    return " ".join([key[0], *shapes])


def make_requests(n: int, scale: float, vocab: int, seed: int) -> list[dict[str, Any]]:
    """``n`` requests: prompts of 256–1,024 tokens and 128–512 new tokens (times ``scale``), half
    starting with the same 200-token system prompt (times ``scale``)."""
    rng = random.Random(seed)
    pick = lambda: rng.randrange(100, vocab - 100)  # noqa: E731 - clear of special ids
    system = [pick() for _ in range(max(1, round(SYSTEM_TOKENS * scale)))]
    requests = []
    for i in range(n):
        length = max(2, round(rng.randint(256, 1024) * scale))
        prompt = [pick() for _ in range(length)]
        if i % 2 == 0:
            prompt = system + prompt[len(system) :] if length > len(system) else system + prompt
        requests.append({"id": f"r{i}", "prompt": prompt, "max_tokens": max(1, round(rng.randint(128, 512) * scale))})
    return requests


def write_jsonl(requests: list[dict[str, Any]], path: Path, adapters: int = 0) -> Path:
    """The requests as a batch file; with ``adapters`` LoRA modules, request i names ``lora{i mod
    (adapters + 1)}`` (the base model for the last share)."""
    with open(path, "w", encoding="utf-8") as out:
        for i, r in enumerate(requests):
            pick = i % (adapters + 1)
            model = f"lora{pick}" if pick < adapters else "random"
            body = {"model": model, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0}
            out.write(json.dumps({"custom_id": r["id"], "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return path


def parse_variant(text: str) -> dict[str, Any]:
    """A job schedule, ``KIND:R`` or ``KIND:R:N``: refill groups of R rows, prefill steps ``padded``
    (``[rows, chunk]``), ``packed`` (one stream, a power of two wide or N tokens) with the decoding
    rows sitting them out, or ``mixed`` (packed, the decoding rows riding along)."""
    kind, _, rest = text.partition(":")
    refill, _, budget = rest.partition(":")
    if kind not in ("padded", "packed", "mixed") or not refill.isdigit() or (budget and (kind == "padded" or not budget.isdigit())):
        raise argparse.ArgumentTypeError(f"a variant is padded:R, packed:R[:N] or mixed:R[:N] (R refill rows, N step tokens), got {text!r}")
    return {
        "refill_rows": int(refill), "step_tokens": int(budget) if budget else None,
        "packed_steps": kind != "padded", "prefill_apart": kind != "mixed",
    }


def batch_job(
    model: Any, requests: list[dict[str, Any]], directory: Path, name: str, args: argparse.Namespace, adapters: int = 0,
    variant: dict[str, Any] | None = None,
) -> tuple[float, Any]:
    """Seconds and the summary of the job (with ``adapters`` random LoRA modules registered; ``variant``
    a schedule of ``--variants``, else the flags' one)."""
    from zgen.batch import run
    from zgen.cache.factory import paged_kv, prefix_cache
    from zgen.lora import random_adapter

    options = [paged_kv(max_memory_mb=args.kv_memory_mb)]
    options += [] if args.no_prefix_cache else [prefix_cache(capacity_blocks=args.prefix_blocks)]
    modules = {f"lora{k}": random_adapter(model.config, args.lora_rank, seed=k) for k in range(adapters)}
    start = time.perf_counter()
    summary = run(
        model, write_jsonl(requests, directory / f"{name}.jsonl", adapters), directory / f"{name}.out.jsonl", *options,
        max_batch_size=args.job_batch_size, prefill_chunk=args.prefill_chunk,
        **(variant or {"refill_rows": args.refill_rows, "step_tokens": args.step_tokens}),
        progress=False,
        model_name="random", lora_modules=modules,
    )
    assert summary.failed == 0, summary
    return time.perf_counter() - start, summary


def completions(path: Path) -> dict[str, int]:
    """Each request's completion tokens in a job's output file."""
    with open(path, encoding="utf-8") as lines:
        records = [json.loads(line) for line in lines]
    return {r["custom_id"]: r["response"]["body"]["usage"]["completion_tokens"] for r in records}


def decode_kv_reads(requests: list[dict[str, Any]], made: dict[str, int]) -> int:
    """KV token reads of every decoded token (the first token of a request comes from its prefill):
    the ``i``-th decoded token of a row reads its prompt and the ``i`` tokens before it."""
    reads = 0
    for r in requests:
        decoded = max(made[r["id"]] - 1, 0)
        reads += decoded * len(r["prompt"]) + decoded * (decoded + 1) // 2
    return reads


def decode_roofline(steps: dict[str, Any], kv_reads: int, weight_bytes: int, kv_bytes_per_token: int, bandwidth_gbs: float) -> dict[str, Any]:
    """A side's decode passes against the time their bytes take at ``bandwidth_gbs``."""
    decode = steps["steps"]["decode"]
    needed = decode["forward_passes"] * weight_bytes + kv_reads * kv_bytes_per_token
    roofline_s = needed / (bandwidth_gbs * 1e9)
    return {"bytes_read_gb": needed / 1e9, "roofline_s": roofline_s, "decode_s": decode["seconds"], "fraction_of_roofline": roofline_s / decode["seconds"]}


def job_report(seconds: float, summary: Any) -> dict[str, Any]:
    """Tokens/s and the latency percentiles the job's summary read from the engine's metrics."""
    return {
        "seconds": seconds, "output_tokens": summary.completion_tokens, "output_tokens_per_s": summary.completion_tokens / seconds,
        "time_to_first_token_s": summary.to_json()["time_to_first_token_s"],
        "inter_token_latency_s": summary.to_json()["inter_token_latency_s"],
    }


def fixed_chunks(model: Any, requests: list[dict[str, Any]], args: argparse.Namespace) -> tuple[float, int]:
    from zgen import Generator, Request, SamplingConfig

    generator = Generator(model, max_batch_size=args.max_batch_size, prefill_chunk=args.prefill_chunk)
    start = time.perf_counter()
    made: dict[str, int] = {}
    for i in range(0, len(requests), args.max_batch_size):
        chunk = requests[i : i + args.max_batch_size]
        results = generator.batch_generate(
            [Request(r["prompt"], SamplingConfig(temperature=0.0, max_new_tokens=r["max_tokens"])) for r in chunk]
        )
        made.update({r["id"]: len(result.token_ids) for r, result in zip(chunk, results, strict=True)})
    return time.perf_counter() - start, made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(JOB_SHAPES), default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--scale", type=float, default=1.0, help="Shrinks the request count and every length (CPU runs).")
    parser.add_argument("--max-batch-size", type=int, default=64, help="The fixed chunks' rows.")
    parser.add_argument("--job-batch-size", type=int, default=None, help="The batch job's most rows (default: twice --max-batch-size).")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--prefix-blocks", type=int, default=4096)
    parser.add_argument("--refill-rows", type=int, default=None, help="The batch job's refill group (default: the job's, an eighth of the batch with packed steps).")
    parser.add_argument("--step-tokens", type=int, default=None, help="The batch job's prefill steps packed into streams of exactly this many tokens (default: streams a power of two wide).")
    parser.add_argument("--variants", nargs="*", default=[], help="Run the job once per schedule, in this order (the first is the report's batch_job): padded:R, packed:R[:N] or mixed:R[:N] (see parse_variant).")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--kv-memory-mb", type=float, default=None, help="The batch job's page pool (default: the fixed chunks' dense cache).")
    parser.add_argument("--bandwidth-gbs", type=float, default=0.0, help="Memory bandwidth for the weights-only roofline (H200 ~4800, H100 ~3350).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-adapters", type=int, default=0, help="Also run the job with this many random LoRA modules, requests spread over them and the base model.")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--trace-steps", action="store_true", help="Also report each side's compiles and engine steps.")
    args = parser.parse_args()

    import jax

    from zgen import ModelConfig
    from zgen.cache.slots import SlotKVManager
    from zgen.model import random_model
    from zgen.shapes import next_pow2

    config = ModelConfig.from_hf({**JOB_SHAPES[args.shape], "model_type": "llama", "rms_norm_eps": 1e-5})
    model = random_model(config, dtype=args.dtype)
    args.job_batch_size = args.job_batch_size or 2 * args.max_batch_size
    n = max(2, round(args.requests * args.scale))
    requests = make_requests(n, args.scale, config.vocab_size, args.seed)
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * model.dtype.itemsize  # K and V, every layer
    if args.kv_memory_mb is None:  # the dense cache of a chunk: every row's capacity
        longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
        min_capacity = inspect.signature(SlotKVManager).parameters["min_capacity"].default
        capacity = min(config.max_position_embeddings, next_pow2(longest, min_capacity))
        args.kv_memory_mb = args.max_batch_size * capacity * kv_bytes_per_token / 2**20
    warmup = make_requests(2 * max(args.job_batch_size, args.max_batch_size), args.scale, config.vocab_size, args.seed + 1)
    variants = {text: parse_variant(text) for text in args.variants} or {"flags": None}
    trace = StepTrace() if args.trace_steps else None
    traced: dict[str, Any] = {}
    jobs: dict[str, tuple[float, Any, dict[str, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for k, variant in enumerate(variants.values()):
            batch_job(model, warmup, directory, f"warmup-{k}", args, variant=variant)
        fixed_chunks(model, warmup[: 2 * args.max_batch_size], args)
        if args.lora_adapters:
            batch_job(model, warmup, directory, "warmup-lora", args, args.lora_adapters)
        if trace is not None:
            traced["warmups"] = trace.take()
        chunk_s, chunk_made = fixed_chunks(model, requests, args)
        if trace is not None:
            traced["fixed_chunks"] = trace.take()
        chunk_tokens = sum(chunk_made.values())
        print(json.dumps({"fixed_chunks_s": chunk_s, "output_tokens_per_s": chunk_tokens / chunk_s}), flush=True)  # partial results survive a time limit
        for k, (name, variant) in enumerate(variants.items()):
            job_s, job = batch_job(model, requests, directory, f"job-{k}", args, variant=variant)
            jobs[name] = (job_s, job, completions(directory / f"job-{k}.out.jsonl"))
            if trace is not None:
                traced[f"batch_job {name}"] = trace.take()
            print(json.dumps({"variant": name, **job_report(job_s, job), "speedup": job.completion_tokens / job_s / (chunk_tokens / chunk_s)}), flush=True)
        lora = batch_job(model, requests, directory, "job-lora", args, args.lora_adapters) if args.lora_adapters else None
    weight_bytes = sum(p.size * p.dtype.itemsize for p in model.params.values())
    first_s, first, job_made = next(iter(jobs.values()))
    report: dict[str, Any] = {
        "device": str(jax.devices()[0].device_kind),
        "shape": args.shape,
        "dtype": args.dtype,
        "requests": n,
        "prompt_tokens": sum(len(r["prompt"]) for r in requests),
        "max_batch_size": args.max_batch_size,
        "job_batch_size": args.job_batch_size,
        "prefix_cache": not args.no_prefix_cache,
        "kv_memory_mb": args.kv_memory_mb,
        "refill_rows": args.refill_rows or max(1, args.job_batch_size // 2),
        "step_tokens": args.step_tokens,
        "batch_job": job_report(first_s, first),
        "fixed_chunks": {"seconds": chunk_s, "output_tokens": chunk_tokens, "output_tokens_per_s": chunk_tokens / chunk_s},
        "speedup": (first.completion_tokens / first_s) / (chunk_tokens / chunk_s),
    }
    if args.variants:
        report["variants"] = {
            name: {**job_report(job_s, job), "speedup": (job.completion_tokens / job_s) / (chunk_tokens / chunk_s)}
            for name, (job_s, job, _) in jobs.items()
        }
    if traced:
        report["trace"] = traced
    if lora is not None:
        report["batch_job_lora"] = {"adapters": args.lora_adapters, "rank": args.lora_rank, **job_report(*lora)}
        report["lora_vs_plain_job"] = report["batch_job_lora"]["output_tokens_per_s"] / report["batch_job"]["output_tokens_per_s"]
    if args.bandwidth_gbs:
        roofline = args.job_batch_size * args.bandwidth_gbs * 1e9 / weight_bytes
        report["weights_roofline_tokens_per_s"] = roofline
        report["batch_job_fraction_of_roofline"] = report["batch_job"]["output_tokens_per_s"] / roofline
        if traced:  # decode against the bytes it had to read, at the batch sizes each side reached
            embed = model.params["embed"]
            read_a_pass = weight_bytes - (0 if config.tie_word_embeddings else embed.size * embed.dtype.itemsize)
            sides = [(f"batch_job {name}", made) for name, (_, _, made) in jobs.items()] + [("fixed_chunks", chunk_made)]
            report["decode_roofline"] = {
                side: decode_roofline(traced[side], decode_kv_reads(requests, made), read_a_pass, kv_bytes_per_token, args.bandwidth_gbs)
                for side, made in sides
            }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
