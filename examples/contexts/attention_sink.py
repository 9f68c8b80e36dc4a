"""Attention sink + sliding window: generate far past a fixed memory bound.

Every few tokens the context masks everything between the first ``sink`` tokens and the last
``window`` tokens and drops the pages that became fully masked, so the pages in use stay bounded while
positions keep counting up (StreamingLLM, without position shifting).
"""

from __future__ import annotations

from dataclasses import dataclass

from zgen import Model, load_model
from zgen.engine import Sampler, stop


@dataclass
class AttentionSinkResult:
    text: str
    tokens: int
    max_pages: int  # the most pages the context held at any time
    bound_pages: int  # what sink + window (+ the pages being filled) may need


def main(model: Model | None = None, sink: int = 4, window: int = 64, total: int = 192, every: int = 16) -> AttentionSinkResult:
    model = model or load_model("smollm2")
    ctx = model.create_context(seed=5)
    ctx.fill("Here is a long list of fruits, one per line:\n")
    page = model.engine.store.config.page_size
    bound = -(-sink // page) + -(-window // page) + -(-every // page) + 1
    max_pages, generated = 0, []
    while len(generated) < total:
        generated += ctx.generate_result(Sampler.top_k(0.7, 20), stop.max_len(every)).token_ids
        cut = ctx.num_tokens - window
        if cut > sink:
            ctx.mask_token_range(sink, cut)
            ctx.drop_masked_kv_pages()
        max_pages = max(max_pages, ctx.pages_used)
    text = model.tokenizer.decode(generated)
    print(text[-300:])
    print(f"{len(generated)} tokens generated; at most {max_pages} pages held (bound {bound})")
    return AttentionSinkResult(text, len(generated), max_pages, bound)


if __name__ == "__main__":
    main()
