"""Speculative decoding under a JSON-schema grammar: plain constrained decoding vs each speculator.

Every row asks for a record of one schema (long property names, which the grammar forces; every
value bounded, so a record always ends) after a prompt that shows such a record, so prompt lookup has something to draft. For every batch size and
speculator: tokens/s of the whole constrained generation (wall time of ``batch_generate``, median of
``--runs`` rounds that time every side in turn, after warm-ups that compile), the speedup over plain constrained decoding of the same
requests, the acceptance figures, whether every output validates, and (greedy) whether the tokens
equal plain constrained decoding's. Batches of more than 8 constrained rows step the engine per token
(GRAMMAR_LOOP_ROWS) and do not speculate.

With random weights (the default: SmolLM2's shape with a real byte-level vocabulary, see
``grammar.py``) only the forced tokens (the keys and punctuation) are predictable, so prompt lookup is
accepted there and nowhere else; ``--model smollm2`` gives real acceptance (the model copies the
record).

    python benchmarks/speculative_grammar.py                                  # random SmolLM2 shape
    python benchmarks/speculative_grammar.py --model smollm2 --batch 1 8
    python benchmarks/speculative_grammar.py --speculators prompt-lookup early-exit:8 --temperature 0.8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grammar import tokenizer  # noqa: E402 - a real byte-level vocabulary for random weights
from speculative import interleaved, load, median, speculator, speedup  # noqa: E402 - the speculative benchmark's helpers

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
        "shipping_address_line": {"type": "string", "maxLength": 40},
        "preferred_delivery_window": {"enum": ["morning", "afternoon", "evening"]},
        "gift_wrapping_requested": {"type": "boolean"},
        "ordered_items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"product_code": {"type": "string", "maxLength": 12}, "quantity_ordered": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["product_code", "quantity_ordered"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
    },
    "required": ["customer_identifier", "shipping_address_line", "preferred_delivery_window", "gift_wrapping_requested", "ordered_items"],
    "additionalProperties": False,
}
EXAMPLE = {
    "customer_identifier": 48213, "shipping_address_line": "12 Harbour Road, Leith", "preferred_delivery_window": "morning",
    "gift_wrapping_requested": False,
    "ordered_items": [{"product_code": "TEA-0042", "quantity_ordered": 2}, {"product_code": "MUG-0007", "quantity_ordered": 1}],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="built-in name, .gguf or HF directory (default: random SmolLM2 shape)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=160, help="the most tokens a record may take")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--speculators", nargs="+", default=["prompt-lookup", "early-exit:8"])
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")
    args = parser.parse_args()

    import jax
    import jsonschema

    from zgen import Generator, Grammar, Request, SamplingConfig

    model = load(args)
    if args.model is None:
        model = dataclasses.replace(model, tokenizer=tokenizer(None)[0])
    grammar = Grammar.json_schema(SCHEMA, compact=True)
    record = json.dumps(EXAMPLE, separators=(",", ":"), sort_keys=True)  # the grammar orders keys so too
    question = f"Here is an order record:\n{record}\nWrite the same record again as JSON:\n"
    speculators = {spec: speculator(spec, model, args) for spec in args.speculators}

    def valid(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    rows: list[dict[str, Any]] = []
    example = ""
    for batch in args.batch:
        requests = [
            Request(question, SamplingConfig(temperature=args.temperature, seed=i, max_new_tokens=args.new_tokens, grammar=grammar))
            for i in range(batch)
        ]
        drafting = {name: Generator(model, max_batch_size=batch, speculative=spec) for name, spec in speculators.items()}
        timed = interleaved({"plain": Generator(model, max_batch_size=batch), **drafting}, requests, args.runs)
        base, base_s = timed["plain"]["results"], timed["plain"]["seconds"]
        tokens, example = sum(len(r.token_ids) for r in base), base[0].text
        rows.append(dict(batch=batch, speculator="plain", tokens_per_s=tokens / median(base_s), speedup=1.0, same=True,
                         valid=all(valid(r.text) for r in base)))
        for name in speculators:
            seconds, results = timed[name]["seconds"], timed[name]["results"]
            stats = [r.speculative for r in results if r.speculative is not None]
            drafted, accepted, passes = (sum(getattr(s, f) for s in stats) for f in ("draft_tokens", "accepted_tokens", "steps"))
            generated = sum(len(r.token_ids) for r in results)  # sampled sides may stop at other lengths
            rows.append(dict(
                batch=batch, speculator=name, tokens_per_s=generated / median(seconds),
                speedup=speedup(base_s, seconds)[0] * generated / tokens,
                same=[r.token_ids for r in results] == [r.token_ids for r in base] if args.temperature == 0 else None,
                valid=all(valid(r.text) for r in results), draft_tokens=drafted, accepted_tokens=accepted,
                acceptance_rate=accepted / drafted if drafted else 0.0, mean_accepted_per_step=accepted / passes if passes else 0.0,
            ))
    report = dict(device=str(jax.devices()[0]), model=args.model or "random smollm2 shape", dtype=args.dtype,
                  temperature=args.temperature, example=example[:160], rows=rows)
    if not args.json:
        print(f"{report['device']}  {report['model']}  {args.dtype}  temperature {args.temperature}")
        print(f"{'batch':>5} {'speculator':<16} {'tok/s':>9} {'speedup':>8} {'accept':>7} {'acc/pass':>8} valid same")
        for row in rows:
            print(f"{row['batch']:>5} {row['speculator']:<16} {row['tokens_per_s']:>9.1f} {row['speedup']:>7.2f}x "
                  f"{row.get('acceptance_rate', 0.0):>7.2f} {row.get('mean_accepted_per_step', 0.0):>8.2f} {row['valid']!s:>5} {row['same']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
