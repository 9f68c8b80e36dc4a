"""Key calibration for the coded KV formats (q4, q3): statistics of the model's own keys and queries.

It runs the model (one forward pass over calibration tokens), so it lives in the runtime; the cache
only receives the result, one :class:`~zgen.pallas.paged_attention.layouts.KeyCalibration` per layer.
:func:`key_calibration` computes it once per model and keeps it with the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from zgen.cache.tensor import causal_attention
from zgen.graph.core import ForwardContext
from zgen.graph.decoder import LOGIT_ROWS, POSITIONS, TOKENS
from zgen.model import Model, attached
from zgen.pallas.paged_attention.layouts import KeyCalibration
from zgen.rope import apply_rope

def key_calibration(model: Model) -> tuple[KeyCalibration, ...]:
    """:func:`calibrate_keys` with its defaults, computed once per model."""
    return attached(model, "key_calibration", lambda: calibrate_keys(model))


class _KeyStatistics(ForwardContext):
    """Causal attention of each calibration window over itself (no cache), summing per layer the
    pre-RoPE keys (and their squares) of positions > 0, the keys at position 0, and the energy of the
    queries in each RoPE pair, per kv head."""

    def __init__(self, sliding_window: int | None) -> None:
        self.sliding_window = sliding_window
        self.sums: list[dict[str, Array]] = []
        self.inv_freq: list[Array] = []

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        inv_freq: Float[Array, " half"],
    ) -> Float[Array, "B T H D"]:
        b, t, heads, d = q.shape
        kv_heads = k.shape[2]
        q = apply_rope(q, positions[:, :, None], inv_freq)
        first = (positions == 0)[:, :, None, None]
        k32 = k.astype(jnp.float32)
        q_energy = jnp.sum(jnp.square(q.astype(jnp.float32)).reshape(b, t, kv_heads, heads // kv_heads, d), axis=(0, 1, 3))
        self.sums.append(
            {
                "key": jnp.sum(jnp.where(first, 0.0, k32), axis=(0, 1)),
                "key_sq": jnp.sum(jnp.where(first, 0.0, k32 * k32), axis=(0, 1)),
                "count": jnp.sum(~first),
                "sink": jnp.sum(jnp.where(first, k32, 0.0), axis=(0, 1)),
                "sinks": jnp.sum(first),
                "q_pair_energy": q_energy[:, : d // 2] + q_energy[:, d // 2 :],
            }
        )
        self.inv_freq.append(inv_freq.astype(jnp.float32))
        return causal_attention(q, apply_rope(k, positions[:, :, None], inv_freq), v, positions, sliding_window=self.sliding_window)


def calibrate_keys(
    model: Model, token_ids: Sequence[int] | None = None, *, windows: int = 8, window: int = 512, seed: int = 0
) -> tuple[KeyCalibration, ...]:
    """Per-layer key statistics for the coded formats, from one forward pass over calibration tokens.

    ``token_ids`` default to ``windows x window`` uniformly random token ids (seeded): data-free, so no
    evaluation text can leak into the calibration; on SmolLM2 they give the same key means, sinks and
    query energies to within what matters (PPL within 0.3 % of a calibration on real English text).
    Each window is one sequence starting at position 0. Per kv head and channel ``c``:

    * ``center``: mean pre-RoPE key over positions > 0; ``sink``: mean key at position 0;
    * ``scale``: a Fisher-information proxy, one per RoPE pair (so it commutes with RoPE). KVQuant
      weights its k-means by the Fisher information of each key element, i.e. E[(dL/dk_c)^2]; the
      gradient of a logit with respect to a key is the query, so without calibration gradients we
      take the query energy of channel ``c``'s RoPE pair ``w_c`` (RoPE rotates within a pair, so the
      pair's energy does not depend on the distance).
      Minimising the ``w``-weighted squared error of keys quantized with one step per group, after
      scaling channel ``c`` by ``a_c``, gives ``a_c ~ w_c^(1/4) / sigma_c^(1/2)`` (``sigma_c``: the
      pair's RMS standard deviation; Lagrange on ``sum_c w_c / a_c^2`` at fixed ``sum_c a_c^2 sigma_c^2``).
      Normalised to a geometric mean of 1 per head.
    """
    config = model.config
    if token_ids is None:
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, config.vocab_size, (windows, window), dtype=np.int32)
    else:
        usable = max(1, min(windows, len(token_ids) // window)) * window
        ids = np.asarray(token_ids[:usable], np.int32)
        tokens = ids.reshape(-1, min(window, len(ids)))
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    rows = np.zeros((tokens.shape[0], 1), np.int32)

    @jax.jit
    def statistics(
        params: dict[str, Array], tokens: Array, positions: Array, rows: Array
    ) -> tuple[list[dict[str, Array]], list[Array]]:
        context = _KeyStatistics(model.config.sliding_window)
        model.graph.run(params, {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: rows}, context)
        return context.sums, context.inv_freq

    layers = []
    all_sums, inv_freqs = statistics(model.params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(rows))
    for sums, inv_freq in zip(all_sums, inv_freqs, strict=True):
        stats = {name: np.asarray(value, np.float64) for name, value in sums.items()}
        center = stats["key"] / stats["count"]
        variance = np.maximum(stats["key_sq"] / stats["count"] - center**2, 0.0)
        half = variance.shape[-1] // 2
        # One spread per RoPE pair, so that the scale commutes with RoPE (see KeyCalibration).
        sigma = np.sqrt(np.concatenate([(variance[..., :half] + variance[..., half:]) / 2] * 2, axis=-1))
        sigma = np.maximum(sigma, 1e-3 * sigma.max(axis=-1, keepdims=True) + 1e-12)
        energy = np.concatenate([stats["q_pair_energy"]] * 2, axis=-1)
        energy = np.maximum(energy, 1e-6 * energy.max(axis=-1, keepdims=True) + 1e-12)
        scale = energy**0.25 / np.sqrt(sigma)
        scale /= np.exp(np.mean(np.log(scale), axis=-1, keepdims=True))
        sink = stats["sink"] / max(float(stats["sinks"]), 1.0)
        layers.append(KeyCalibration(*(jnp.asarray(x, jnp.float32) for x in (center, sink, scale)), inv_freq=inv_freq))
    return tuple(layers)
