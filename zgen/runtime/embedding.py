"""Embeddings: the model's last hidden states (after the final norm) pooled per text.

Texts are fed as one padded batch per compiled shape (rows sorted by length so little is padding)
through the model's graph cut after the final norm, over a scratch dense KV state that is dropped
afterwards; pooling reads only each row's own tokens:

* ``mean`` — the average over the row's tokens; ``max`` — the elementwise maximum;
* ``last`` — the last token (what decoder-only embedding models use); ``cls`` — the first token.

``normalize`` scales each embedding to unit L2 norm.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zgen.cache.tensor import DenseKVState
from zgen.errors import ConfigError, InputError, PromptTooLongError
from zgen.lora.adapter import LoraAdapter, check_adapter
from zgen.lora.bank import stack_mixes
from zgen.runtime.runner import Runner
from zgen.runtime.step import POOLINGS, Pooling
from zgen.shapes import next_pow2

def embed_ids(
    runner: Runner,
    texts: Sequence[Sequence[int]],
    *,
    pooling: Pooling = "mean",
    normalize: bool = True,
    batch_size: int = 32,
    adapters: tuple[tuple[LoraAdapter, float], ...] = (),
) -> np.ndarray:
    """Embeddings ``[len(texts), hidden]`` (float32) of token-id sequences, ``batch_size`` rows per
    step, computed with ``adapters`` (LoRA, with scales) if any."""
    if pooling not in POOLINGS:
        raise ConfigError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    config = runner.model.config
    for n, ids in enumerate(texts):
        if not ids:
            raise InputError(f"text {n} has no tokens; every text needs at least one")
        if len(ids) > config.max_position_embeddings:
            raise PromptTooLongError(f"text {n} has {len(ids)} tokens, more than the model's context of {config.max_position_embeddings}")
    for adapter, _ in adapters:
        check_adapter(adapter, config)
    bank = stack_mixes([adapters], config, runner.model.dtype) if adapters else None
    out = np.zeros((len(texts), config.hidden_size), np.float32)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width, t = next_pow2(len(chunk)), next_pow2(max(len(texts[i]) for i in chunk), 16)
        tokens = np.zeros((width, t), np.int32)
        positions = np.full((width, t), -1, np.int32)
        lengths = np.zeros(width, np.int32)
        for row, i in enumerate(chunk):
            n = len(texts[i])
            tokens[row, :n], positions[row, :n], lengths[row] = texts[i], np.arange(n), n
        kv = DenseKVState.zeros(config.num_layers, width, t, config.num_kv_heads, config.head_dim, runner.model.dtype)
        slots = None if bank is None else jnp.ones(width, jnp.int32)  # every row: the bank's one mix
        pooled = runner.embed(
            kv, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(lengths), pooling=pooling, normalize=normalize,
            adapter_slots=slots, adapters=bank,
        )
        out[chunk] = np.asarray(jax.device_get(pooled))[: len(chunk)]
    return out
