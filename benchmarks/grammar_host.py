"""Why llguidance's mask work costs more inside the decode loop than in a tight loop on the host.

The same work — ``--batch`` rows of ``grammar.py``'s JSON schema, each taking the next token of its
own valid JSON text (:func:`consume_all`), then their next-token masks (:func:`fill_masks`): one
decode-loop turn of the host worker — timed under conditions that differ in one thing each (median
ms per turn, ``--calls`` turns, fresh matchers for each condition):

* ``hot`` — back to back, the way ``grammar.py``'s ``mask_ms`` replays them;
* ``after_idle`` — each after the host slept ``--idle-ms`` (about a device step): llguidance's
  threads park and the cores may clock down in between;
* ``after_streaming`` — each after reading a buffer larger than the last-level cache (as a forward
  pass on the CPU does), so llguidance's tables start cold;
* ``callback_ordered`` / ``callback_unordered`` — inside an ``io_callback`` of a jitted
  ``while_loop``, right after device work (a matmul of the LM head's size), as the decode loop's
  callbacks run; ``*_no_device_work`` the same without the matmul;
* ``worker_thread`` — from another Python thread (where the decode loop's worker computes them);
* ``hot_threads_N`` — back to back, llguidance's own work only (no end-token bits), with an executor
  of N threads (the default has 80 % of the CPUs, at most 32).

    python benchmarks/grammar_host.py                   # batch 32
    python benchmarks/grammar_host.py --batch 1 --idle-ms 0.8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from grammar import SCHEMA, tokenizer


def valid_text(row: int, tokens: int) -> str:
    """A JSON text valid under ``SCHEMA`` of well over ``tokens`` tokens, different for each row."""
    items = [
        {"id": row * 7919 + n, "name": f"item {n} of row {row}", "score": n + row / 8, "tags": ["a", "b", "c"][: n % 4]}
        for n in range(tokens)
    ]
    return json.dumps(items, separators=(",", ":"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--idle-ms", type=float, default=5.0)
    parser.add_argument("--tokenizer", help="a tokenizer.json with a byte-level vocabulary of 49,152 tokens")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import llguidance
    import numpy as np
    from jax.experimental import io_callback
    from llguidance.numpy import fill_next_token_bitmask_par

    from zgen import Grammar, ModelConfig
    from zgen.model import random_model
    from zgen.runtime.grammar import GrammarMatcher, consume_all, fill_masks, mask_words

    vocab, vocab_source = tokenizer(args.tokenizer)
    config = ModelConfig.from_hf(dict(
        model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, eos_token_id=2,
    ))
    model = dataclasses.replace(random_model(config, dtype="float32"), tokenizer=vocab)
    grammar = Grammar.json_schema(SCHEMA, compact=True)
    texts = [vocab.encode(valid_text(i, args.calls)) for i in range(args.batch)]
    masks = np.full((args.batch, mask_words(config.vocab_size)), -1, np.int32)
    durations: list[float] = []
    rows: list[tuple[GrammarMatcher, int]] = []
    turn = 0

    def fresh() -> None:
        nonlocal rows, turn
        rows, turn = [(GrammarMatcher(grammar, model, model.eos_token_ids), i) for i in range(args.batch)], 0

    def step(*_: Any) -> np.ndarray:
        nonlocal turn
        start = time.perf_counter()
        assert not consume_all([(m, texts[i][turn], i) for m, i in rows])
        fill_masks(rows, masks)
        durations.append(time.perf_counter() - start)
        turn += 1
        return masks

    def timed(before: Callable[[], Any] = lambda: None) -> float:
        fresh()
        durations.clear()
        for _ in range(args.calls):
            before()
            step()
        return statistics.median(durations) * 1e3

    report: dict[str, Any] = {"device": jax.devices()[0].device_kind, "cpus": os.cpu_count(), "batch": args.batch,
                              "tokenizer": vocab_source}
    report["hot"] = timed()
    report["after_idle"] = timed(lambda: time.sleep(args.idle_ms / 1e3))
    buffer = np.ones(64 * 2**20, np.float32)  # 256 MiB: past any last-level cache
    report["after_streaming"] = timed(buffer.sum)

    head = jnp.full((576, config.vocab_size), 0.01, jnp.bfloat16)
    for ordered in (True, False):
        for device_work in (True, False):
            def body(carry: tuple[jax.Array, jax.Array], device_work: bool = device_work, ordered: bool = ordered) -> Any:
                count, x = carry
                if device_work:
                    x = jnp.tanh(x @ head)[:, :576]
                shape = jax.ShapeDtypeStruct(masks.shape, jnp.int32)
                mask = io_callback(step, shape, x[0, 0], ordered=ordered)
                return count + 1, x + mask[:, :576].astype(x.dtype) * 0

            run = jax.jit(lambda x, body=body: jax.lax.while_loop(lambda c: c[0] < args.calls, body, (0, x)))
            x = jnp.ones((args.batch, 576), jnp.bfloat16)
            fresh()
            jax.block_until_ready(run(x))
            fresh()
            durations.clear()
            jax.block_until_ready(run(x))
            name = f"callback_{'ordered' if ordered else 'unordered'}{'' if device_work else '_no_device_work'}"
            report[name] = statistics.median(durations) * 1e3

    worker = threading.Thread(target=lambda: report.__setitem__("worker_thread", timed()))
    worker.start()
    worker.join()

    threads = 1
    while threads <= min(32, os.cpu_count() or 1):
        executor = llguidance.LLExecutor(threads)
        fresh()
        spent = []
        for n in range(args.calls):
            pairs = [(m._matcher, i) for m, i in rows]
            start = time.perf_counter()
            executor.consume_token_par([(m, texts[i][n]) for m, i in pairs])
            fill_next_token_bitmask_par(executor, pairs, masks)
            spent.append(time.perf_counter() - start)
        report[f"hot_threads_{threads}"] = statistics.median(spent) * 1e3
        threads *= 2
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
