"""Speculative decoding with an n-gram (prompt-lookup) drafter: same output, fewer forward passes.

Repetitive text (code edits, lists, quoting the prompt) is where prompt lookup pays.
"""

from __future__ import annotations

from dataclasses import dataclass

from zgen import Context, Model, Sampler, load_model, stop
from zgen.contexts import NgramDrafter

PROMPT = "Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\nRepeat: apple, banana,"


@dataclass
class SpeculativeResult:
    text: str
    plain_passes: int
    drafted_passes: int


def main(model: Model | None = None) -> SpeculativeResult:
    model = model or load_model("smollm2")
    limit = stop.max_len(24) | stop.ends_with_any(model.eos_token_ids)

    plain = Context(model)
    plain.fill(PROMPT)
    engine = plain.engine
    before = engine.stats.forward_passes
    expected = plain.generate_result(Sampler.greedy(), limit)
    plain_passes = engine.stats.forward_passes - before

    drafted = Context(model)
    drafted.fill(PROMPT)
    before = engine.stats.forward_passes
    result = drafted.generate_with_drafter(NgramDrafter(max_draft=8), Sampler.greedy(), limit)
    drafted_passes = engine.stats.forward_passes - before
    assert result.token_ids == expected.token_ids, "speculative decoding must not change greedy output"
    print(f"{result.text!r}\nplain: {plain_passes} forward passes, with the n-gram drafter: {drafted_passes}")
    return SpeculativeResult(result.text, plain_passes, drafted_passes)


if __name__ == "__main__":
    main()
