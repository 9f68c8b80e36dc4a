"""Parallel generation with forks: one shared opening, several endings decoded in the same batches.

The forks share the opening's full pages with the root context (copy-on-write: a page is copied only
when a fork writes into it, which only the partly filled last page ever is), so the opening's K/V
are computed and stored once for every fork.
"""

from __future__ import annotations

from dataclasses import dataclass

from zgen import Context, Model, Sampler, load_model, stop
from zgen.contexts import gather

OPENING = (
    "You are a poet who writes single sentences, vivid and precise, about the sea: its colours at dawn, "
    "the sound of waves on stone, the salt in the wind. Write one sentence about the ocean from the point of view of"
)
VOICES = (" a sailor:", " a whale:", " a lighthouse keeper:")


@dataclass
class ParallelForksResult:
    texts: list[str]
    opening_pages: int  # full pages holding the opening's K/V
    shared_pages: int  # of those, pages the root shares with its forks (copy-on-write)
    pages_held: int  # distinct pages the root and its forks hold together
    pages_unshared: int  # what they would hold if every fork had its own copy of the opening
    forward_passes: int  # model forward passes for all endings together


def main(model: Model | None = None) -> ParallelForksResult:
    model = model or load_model("smollm2")
    root = Context(model)
    root.fill(OPENING)
    root.flush()
    opening_pages = root.kv_len // root.cache.store.config.page_size
    forks = [root.fork() for _ in VOICES]
    for fork, voice in zip(forks, VOICES):
        fork.fill(voice)
    engine = root.engine
    before = engine.stats.forward_passes
    limit = stop.max_len(24) | stop.ends_with_any(model.eos_token_ids)
    texts = gather(*(f.generate_async(Sampler.greedy(), limit) for f in forks))
    passes = engine.stats.forward_passes - before
    family = [root, *forks]
    held = len({block for ctx in family for block in ctx.cache.owned_blocks()})
    unshared = sum(ctx.pages_used for ctx in family)
    for voice, text in zip(VOICES, texts):
        print(f"{voice.strip()} {text.strip()}")
    print(
        f"{len(forks)} endings in {passes} forward passes; {root.pages_shared} of the opening's {opening_pages} full "
        f"pages are shared by the root and its {len(forks)} forks: {held} pages held, {unshared} if each had its own copy"
    )
    return ParallelForksResult(texts, opening_pages, root.pages_shared, held, unshared, passes)


if __name__ == "__main__":
    main()
