"""Which LoRA bank slot each row of a step uses, and the banks of recent steps kept for reuse."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zgen.config import ModelConfig
from zgen.lora.adapter import LoraAdapter
from zgen.lora.bank import LoraBank, stack_mixes

Mix = tuple[tuple[LoraAdapter, float], ...]


class AdapterBanks:
    """Banks by the set of adapter mixes in a step; rows with the same mix share a slot. The last
    ``kept`` banks are kept, so a steady batch builds its bank once."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, kept: int = 4) -> None:
        self.config, self.dtype, self.kept = config, dtype, kept
        # Keyed by the adapters' ids; the entry holds the adapters, so no id is reused while it lives.
        self._banks: dict[tuple[object, ...], tuple[list[Mix], LoraBank]] = {}

    def for_rows(self, mixes: Sequence[Mix], index: Sequence[int], width: int) -> tuple[jax.Array | None, LoraBank | None]:
        """Each row's slot (row ``n`` of ``mixes`` sits at batch row ``index[n]``; 0 = no adapter) and
        the step's bank; (None, None) when no row has an adapter."""
        keys = [tuple((id(a), scale) for a, scale in mix) for mix in mixes]
        distinct = sorted({k for k in keys if k})
        if not distinct:
            return None, None
        bank_key = tuple(distinct)
        if bank_key not in self._banks:
            if len(self._banks) >= self.kept:
                self._banks.pop(next(iter(self._banks)))
            chosen = [next(mix for mix, k in zip(mixes, keys, strict=True) if k == key) for key in distinct]
            self._banks[bank_key] = (chosen, stack_mixes(chosen, self.config, self.dtype))
        slots = np.zeros(width, np.int32)
        for key, i in zip(keys, index, strict=True):
            slots[i] = distinct.index(key) + 1 if key else 0
        return jax.device_put(slots), self._banks[bank_key][1]
