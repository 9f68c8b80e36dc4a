"""Beam search written on contexts: read each beam's next-token distribution, fork the best extensions.

With ``width=1`` it is greedy decoding, which the example checks against ``Context.generate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zgen import Context, Model, Sampler, load_model, stop
from zgen.contexts import gather


@dataclass
class Beam:
    ctx: Context
    logprob: float
    tokens: list[int]


def beam_search(model: Model, prompt: str, width: int, steps: int) -> list[Beam]:
    root = Context(model)
    root.fill(prompt)
    beams = [Beam(root, 0.0, [])]
    for _ in range(steps):
        dists = gather(*(b.ctx.decode_step_dist_async() for b in beams))
        candidates = [
            (beam.logprob + math.log(float(p)), beam, int(token))
            for beam, dist in zip(beams, dists)
            for token, p in zip(dist.ids[:width], dist.probs[:width])
        ]
        candidates.sort(key=lambda c: c[0], reverse=True)
        survivors = []
        for logprob, beam, token in candidates[:width]:
            child = beam.ctx.fork()
            child.fill_tokens([token])
            survivors.append(Beam(child, logprob, [*beam.tokens, token]))
        for beam in beams:
            beam.ctx.release()
        beams = survivors
    return beams


def main(model: Model | None = None, width: int = 3, steps: int = 8) -> list[Beam]:
    model = model or load_model("smollm2")
    prompt = "The most important invention of the 20th century was"
    beams = beam_search(model, prompt, width, steps)
    for beam in beams:
        print(f"{beam.logprob:7.3f}  {model.tokenizer.decode(beam.tokens)!r}")
    greedy = Context(model)
    greedy.fill(prompt)
    expected = greedy.generate_result(Sampler.greedy(), stop.max_len(steps)).token_ids
    assert beam_search(model, prompt, 1, steps)[0].tokens == expected, "width 1 must be greedy"
    return beams


if __name__ == "__main__":
    main()
