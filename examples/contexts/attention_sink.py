"""Attention sink + sliding window: generate far past a fixed memory bound.

Every few tokens the context masks everything between the first ``sink`` tokens and the last
``window`` tokens and drops the pages that became fully masked, so the pages in use stay bounded while
positions keep counting up (StreamingLLM, without position shifting). When the model ends its text
(an EOS token), the prompt is filled again and generation goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

from zgen import Context, Model, Sampler, load_model, stop

PROMPT = "Here is a long list of fruits, one per line:\n"


@dataclass
class AttentionSinkResult:
    text: str  # what the model wrote (EOS and other special tokens left out)
    tokens: int
    max_pages: int  # the most pages the context held at any time
    bound_pages: int  # what sink + window (+ the pages being filled) may need


def main(model: Model | None = None, sink: int = 4, window: int = 64, total: int = 192, every: int = 16) -> AttentionSinkResult:
    model = model or load_model("smollm2")
    ctx = Context(model, seed=5)
    ctx.fill(PROMPT)
    page = ctx.cache.store.config.page_size
    bound = -(-sink // page) + -(-window // page) + -(-every // page) + 1
    chunk = stop.max_len(every) | stop.ends_with_any(model.eos_token_ids)
    max_pages, tokens, pieces = 0, 0, []
    while tokens < total:
        reply = ctx.generate_result(Sampler.top_k(0.7, 20), chunk)
        tokens += len(reply.token_ids)
        pieces.append(reply.text)
        if reply.finish_reason == "stop":  # the model ended its text: start another list
            ctx.fill("\n" + PROMPT)
            pieces.append("\n")
        cut = ctx.num_tokens - window
        if cut > sink:
            ctx.mask_token_range(sink, cut)
            ctx.drop_masked_kv_pages()
        max_pages = max(max_pages, ctx.pages_used)
    text = "".join(pieces)
    print(text)
    print(f"{tokens} tokens generated; at most {max_pages} pages held (bound {bound})")
    return AttentionSinkResult(text, tokens, max_pages, bound)


if __name__ == "__main__":
    main()
