"""Parallel generation with forks: one shared opening, several endings decoded in the same batches."""

from __future__ import annotations

from dataclasses import dataclass

from zgen import Model, load_model
from zgen.engine import Sampler, stop

OPENING = "Write one sentence about the ocean from the point of view of"
VOICES = (" a sailor:", " a whale:", " a lighthouse keeper:")


@dataclass
class ParallelForksResult:
    texts: list[str]
    shared_pages: int  # pages of the opening shared by the forks (copy-on-write)
    forward_passes: int  # model forward passes for all endings together


def main(model: Model | None = None) -> ParallelForksResult:
    model = model or load_model("smollm2")
    engine = model.engine
    root = engine.create_context()
    root.fill(OPENING)
    root.flush()
    forks = [root.fork() for _ in VOICES]
    for fork, voice in zip(forks, VOICES):
        fork.fill(voice)
    before = engine.stats.forward_passes
    limit = stop.max_len(24) | stop.ends_with_any(model.eos_token_ids)
    texts = engine.gather(*(f.generate_async(Sampler.greedy(), limit) for f in forks))
    passes = engine.stats.forward_passes - before
    for voice, text in zip(VOICES, texts):
        print(f"{voice.strip()}{text}")
    print(f"{len(forks)} endings in {passes} forward passes; {root.pages_shared} opening pages shared")
    return ParallelForksResult(texts, root.pages_shared, passes)


if __name__ == "__main__":
    main()
