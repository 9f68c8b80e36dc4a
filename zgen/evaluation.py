"""Perplexity of a model over a text, with the KV cache in the loop.

Method (the one ``docs/kv_quantization.md`` reports): the text's tokens are cut into
non-overlapping windows of ``window`` tokens; each window starts from an empty cache, no BOS is
added, and every token after the first in a window is scored. A window is fed through the cache in
chunks of ``chunk`` tokens, so attention to earlier chunks reads what the cache stored (quantized or
compressed, for lossy kinds); ``chunk=1`` is pure decode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zgen.cache.base import CacheBackend
from zgen.errors import InputError
from zgen.model import Model


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens_scored: int
    windows: int


def perplexity(
    model: Model,
    token_ids: Sequence[int],
    *,
    window: int,
    chunk: int,
    backend: CacheBackend[Any],
    batch_size: int = 8,
) -> PerplexityResult:
    if window < 2 or chunk < 1:
        raise InputError(f"window must be >= 2 and chunk >= 1, got window={window}, chunk={chunk}")
    windows = [list(token_ids[i : i + window]) for i in range(0, len(token_ids) - 1, window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise InputError(f"the text has {len(token_ids)} tokens; at least 2 are needed to score one")
    total_nll, scored = 0.0, 0
    for start in range(0, len(windows), batch_size):
        nll, count = _score_batch(model, windows[start : start + batch_size], chunk, backend)
        total_nll += nll
        scored += count
    mean = total_nll / scored
    return PerplexityResult(ppl=math.exp(mean), nll=mean, tokens_scored=scored, windows=len(windows))


def _score_batch(model: Model, windows: list[list[int]], chunk: int, backend: CacheBackend[Any]) -> tuple[float, int]:
    longest = max(len(w) for w in windows)
    width = len(windows)
    tokens = np.zeros((width, longest), np.int32)
    for row, ids in enumerate(windows):
        tokens[row, : len(ids)] = ids
    capacity = 128 * -(-(longest + chunk) // 128)
    state = backend.allocate(width, capacity)
    total, count = 0.0, 0
    try:
        for begin in range(0, longest - 1, chunk):
            end = min(begin + chunk, longest - 1)
            # Always a full chunk of `chunk` tokens (one compiled shape); positions past `end` are
            # padding whose logits are not scored.
            piece = np.zeros((width, chunk), np.int32)
            piece[:, : end - begin] = tokens[:, begin:end]
            positions = begin + np.arange(chunk, dtype=np.int32)
            rows = np.broadcast_to(np.arange(chunk, dtype=np.int32), (width, chunk))
            logits, state = model.plan.prefill(
                model.params, state, jnp.asarray(piece), jnp.asarray(np.broadcast_to(positions, (width, chunk))), jnp.asarray(rows)
            )
            logprobs = np.asarray(jax.nn.log_softmax(logits[:, : end - begin], axis=-1))
            for row, ids in enumerate(windows):
                for offset in range(end - begin):
                    target = begin + offset + 1
                    if target < len(ids):
                        total -= float(logprobs[row, offset, ids[target]])
                        count += 1
    finally:
        backend.release(state)
    return total, count
