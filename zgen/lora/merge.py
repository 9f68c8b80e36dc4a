"""Merging an adapter into a model's weights (and taking it out again), fused weights included."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from zgen.config import ModelConfig
from zgen.lora.adapter import FUSED, LoraAdapter, check_adapter, fused_factors


def merged_weights(
    params: Mapping[str, jax.Array], config: ModelConfig, adapter: LoraAdapter, scale: float
) -> dict[str, jax.Array]:
    """The fused weights ``adapter`` touches with ``scale * scaling * B A`` added (computed in float32;
    a negative ``scale`` takes a merged adapter out again, exactly up to rounding)."""
    check_adapter(adapter, config)
    updated: dict[str, jax.Array] = {}
    for layer in range(config.num_layers):
        for fused in FUSED:
            factors = fused_factors([(adapter, scale)], config, layer, fused)
            if factors is None:
                continue
            a, b = factors
            name = f"layers.{layer}.{fused}"
            weight = params[name]
            delta = jnp.asarray(np.matmul(b, a, dtype=np.float32))
            updated[name] = (weight.astype(jnp.float32) + delta).astype(weight.dtype)
    return updated
