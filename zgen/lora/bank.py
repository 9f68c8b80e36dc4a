"""The adapter bank of one step: every distinct adapter mix of its rows stacked per fused weight, so
rows gather their own pair by slot (:mod:`zgen.lora.graph`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from zgen.config import ModelConfig
from zgen.lora.adapter import FUSED, AdapterMix, fused_factors, projection_shape
from zgen.lora.graph import bank_names
from zgen.shapes import next_pow2

# Ranks and slot counts are rounded up (zero padding changes nothing) so few shapes get compiled.
_MIN_RANK, _MIN_SLOTS = 8, 2


@dataclass(frozen=True, eq=False)
class LoraBank:
    """A step's adapter banks by parameter name, and their shapes (what picks the compiled program)."""

    arrays: dict[str, jax.Array]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]


def stack_mixes(mixes: Sequence[AdapterMix], config: ModelConfig, dtype: jnp.dtype) -> LoraBank:
    """Banks ``[slots, R, in]`` / ``[slots, out, R]`` per adapted fused weight; slot 0 is zeros (rows
    without adapters), slot ``k + 1`` holds ``mixes[k]``."""
    slots = next_pow2(len(mixes) + 1, _MIN_SLOTS)
    bank: dict[str, jax.Array] = {}
    for layer in range(config.num_layers):
        for fused, parts in FUSED.items():
            factors = [fused_factors(mix, config, layer, fused) for mix in mixes]
            present = [(k, f) for k, f in enumerate(factors) if f is not None]
            if not present:
                continue
            rank = next_pow2(max(a.shape[0] for _, (a, _) in present), _MIN_RANK)
            into = projection_shape(config, parts[0])[1]
            out = sum(projection_shape(config, p)[0] for p in parts)
            a_bank = np.zeros((slots, rank, into), np.float32)
            b_bank = np.zeros((slots, out, rank), np.float32)
            for k, (a, b) in present:
                a_bank[k + 1, : a.shape[0]] = a
                b_bank[k + 1, :, : b.shape[1]] = b
            a_name, b_name = bank_names(f"layers.{layer}.{fused}")
            bank[a_name], bank[b_name] = jnp.asarray(a_bank, dtype), jnp.asarray(b_bank, dtype)
    return LoraBank(bank, tuple((name, tuple(value.shape)) for name, value in sorted(bank.items())))
