"""Tensor parallelism: a model's weights split over a mesh of local devices by logical-axis rules.

Every weight has logical axes (:data:`LOGICAL_AXES`, by the last part of its name); :data:`RULES` map
them to the mesh's ``"tp"`` axis (attention heads and MLP columns) or to nothing (replicated: the
embedding, norms, the output head). The fused ``qkv`` and ``gate_up`` matrices are first laid out
shard-major (:func:`shard_major`: each device's block holds its own query, key and value heads, its
own gate and up columns; the graph built with ``shards=N`` reads them so), so each device computes its
heads and columns alone and the output projections end in one all-reduce per block. KV heads are split
with the query heads (N must divide both, :func:`check_tensor_parallel`), so a GQA group never spans
two devices.

The compiled steps stay ordinary ``jax.jit`` programs: XLA's SPMD partitioner splits the projections
and the MLP from the weights' shardings. Attention is the exception, because the Pallas kernels are
custom calls the partitioner cannot split: each layer's KV write and attention run in ``jax.shard_map``
over the ``"tp"`` axis (:mod:`zgen.cache.sharded`), so every device runs the same kernel as one device
would -- flash or paged attention, any KV format -- on its own query heads and KV heads, and the KV
cache lives split by KV heads. Greedy outputs equal one device's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zgen.config import ModelConfig
from zgen.errors import ConfigError

TP_AXIS = "tp"

#: Logical axes of each weight, by the last part of its name (others: replicated).
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "qkv": ("heads", "embed"),
    "qkv_bias": ("heads",),
    "o": ("embed", "heads"),
    "gate_up": ("mlp", "embed"),
    "down": ("embed", "mlp"),
}

#: Logical axis -> mesh axis (None: not split).
RULES: dict[str, str | None] = {"heads": TP_AXIS, "mlp": TP_AXIS, "embed": None}


def check_tensor_parallel(config: ModelConfig, n: int) -> None:
    """A :class:`ConfigError` unless ``n`` devices can split this model's heads and MLP columns."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"tensor_parallel must be an integer >= 1, got {n!r}")
    sizes = {
        "attention heads": config.num_heads,
        "KV heads": config.num_kv_heads,
        "MLP columns": config.intermediate_size,
    }
    bad = [f"{name} ({size})" for name, size in sizes.items() if size % n]
    if bad:
        raise ConfigError(
            f"tensor_parallel={n} must divide the model's {', '.join(bad)}; choose a divisor of "
            f"{np.gcd.reduce(list(sizes.values()))}"
        )
    devices = jax.local_devices()
    if n > len(devices):
        raise ConfigError(
            f"tensor_parallel={n} needs as many local devices; this process sees {len(devices)} "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )


def tensor_parallel_mesh(n: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A one-axis mesh (``"tp"``) over ``devices`` (default: the first ``n`` local devices)."""
    chosen = list(jax.local_devices()[:n] if devices is None else devices)
    if len(chosen) != n:
        raise ConfigError(f"a mesh of {n} devices was given {len(chosen)}")
    return Mesh(np.array(chosen), (TP_AXIS,))


def partition_spec(name: str) -> PartitionSpec:
    """Where weight ``name`` is split, from its logical axes and :data:`RULES`."""
    axes = LOGICAL_AXES.get(name.rsplit(".", 1)[-1])
    return PartitionSpec() if axes is None else PartitionSpec(*(RULES[a] for a in axes))


def shard_major(name: str, value: Any, config: ModelConfig, n: int) -> Any:
    """Weight ``name`` with its fused rows reordered for ``n`` shards: ``qkv`` (and its bias) from
    ``[q | k | v]`` to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, ``gate_up`` from ``[gate | up]`` to
    ``[gate_0 up_0 | gate_1 up_1 | ...]``; other weights as they are."""
    kind = name.rsplit(".", 1)[-1]
    if kind in ("qkv", "qkv_bias"):
        parts = [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2
    elif kind == "gate_up":
        parts = [config.intermediate_size] * 2
    else:
        return value
    starts = np.cumsum([0, *parts[:-1]])
    order = np.concatenate([start + np.arange(s * size // n, (s + 1) * size // n) for s in range(n) for start, size in zip(starts, parts)])
    return value[order]


def shard_params(
    params: Mapping[str, Any], config: ModelConfig, n: int, devices: Sequence[Any] | None = None
) -> dict[str, jax.Array]:
    """``params`` laid out by :func:`shard_major` and placed on a mesh of ``n`` devices (``devices``,
    default the first ``n``), each split by :func:`partition_spec` (for a graph built with ``shards=n``)."""
    check_tensor_parallel(config, n)
    mesh = tensor_parallel_mesh(n, devices)
    return {
        name: jax.device_put(shard_major(name, value, config, n), NamedSharding(mesh, partition_spec(name)))
        for name, value in params.items()
    }
