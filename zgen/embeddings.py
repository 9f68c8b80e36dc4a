"""Text embeddings from a loaded model: a front end of :mod:`zgen.runtime.embedding`.

``zgen.embed(model, texts)`` rather than a ``Model.embed`` method: a model is data in the model
description layer, which must not import the runtime that runs it (``lint-imports``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import cast

import numpy as np

from zgen.errors import InputError
from zgen.lora.adapter import AdapterChoice, adapter_pairs
from zgen.model import Model
from zgen.runtime.embedding import embed_ids
from zgen.runtime.runner import runner_for
from zgen.runtime.step import Pooling

Text = str | Sequence[int]  # text, or token ids used as they are


def embed(
    model: Model,
    texts: Text | Sequence[Text],
    *,
    pooling: Pooling = "mean",
    normalize: bool = True,
    batch_size: int = 32,
    adapter: AdapterChoice | None = None,
) -> np.ndarray:
    """Embeddings of one text (``[hidden]``) or of several (``[len(texts), hidden]``), float32: the
    last hidden states after the final norm pooled by ``pooling`` (``mean``, ``last``, ``cls``,
    ``max``) over each text's own tokens, scaled to unit length when ``normalize``. Texts are
    tokenized as prompts are (special tokens such as BOS included); ``batch_size`` texts run per step.
    The model's pushed LoRA adapters apply, and ``adapter`` on top of them."""
    single = isinstance(texts, str) or (isinstance(texts, Sequence) and bool(texts) and all(_is_id(t) for t in texts))
    items: list[Text] = [texts] if single else list(texts)  # type: ignore[list-item]
    if not items:
        raise InputError("no texts to embed")
    ids = [_ids(model, item, n) for n, item in enumerate(items)]
    adapters = (*model.adapters, *adapter_pairs(adapter))
    out = embed_ids(runner_for(model), ids, pooling=pooling, normalize=normalize, batch_size=batch_size, adapters=adapters)
    return out[0] if single else out


def parse_inputs(content: str, *, jsonl: bool, source: str) -> list[tuple[str, object]]:
    """(text, id) pairs from a file's content: a text per non-empty line, or for JSON lines an object
    with ``"text"`` (and an optional ``"id"``, kept for the output) or a bare JSON string per line."""
    items: list[tuple[str, object]] = []
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            items.append((line, None))
            continue
        try:
            value: object = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{source} line {number} is not JSON: {err.msg}") from None
        if isinstance(value, dict) and isinstance(value.get("text"), str):  # pyright: ignore[reportUnknownMemberType]
            items.append((cast(str, value["text"]), cast(dict[str, object], value).get("id")))
        elif isinstance(value, str):
            items.append((value, None))
        else:
            raise InputError(f'{source} line {number}: give an object with a "text" string, or a JSON string')
    if not items:
        raise InputError(f"{source} holds no texts")
    return items


def _is_id(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _ids(model: Model, item: object, n: int) -> list[int]:
    if isinstance(item, str):
        return model.tokenizer.encode(item)
    if isinstance(item, Sequence) and all(_is_id(t) for t in item):
        vocab = model.config.vocab_size
        ids = [int(t) for t in item]  # type: ignore[arg-type]
        if any(not 0 <= t < vocab for t in ids):
            raise InputError(f"text {n}: token ids must lie in [0, {vocab})")
        return ids
    raise InputError(f"text {n} is a {type(item).__name__}; give text or token ids")


__all__ = ["embed", "parse_inputs"]
