"""Tensor parallelism: a model's weights split over a mesh of local devices by logical-axis rules.

Every weight has logical axes (:data:`LOGICAL_AXES`, by the last part of its name); :data:`RULES` map
them to the mesh's ``"tp"`` axis (attention heads and MLP columns) or to nothing (replicated: the
embedding, norms, the output head). The compiled steps are ordinary ``jax.jit`` programs: XLA's SPMD
partitioner splits each matmul the way its weights are split and inserts the collectives, and the KV
cache it writes comes out split by KV heads. Outputs equal one device's (greedy tokens; logits up to
the order of the sums that the split reduction changes).

Where it stands: the fused ``qkv`` and ``gate_up`` matrices are split in row blocks, which do not
line up with heads or with the gate/up halves (shard 0 of ``qkv`` holds query heads, the last one keys
and values), so XLA moves activations between devices beyond the one all-reduce per block that a
per-shard layout would need; and attention kernels are not wrapped in ``shard_map``, so a sharded model
is meant for the XLA attention path.
"""

from __future__ import annotations

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


def tensor_parallel_mesh(n: int) -> Mesh:
    """A one-axis mesh (``"tp"``) over the first ``n`` local devices."""
    return Mesh(np.array(jax.local_devices()[:n]), (TP_AXIS,))


def partition_spec(name: str) -> PartitionSpec:
    """Where weight ``name`` is split, from its logical axes and :data:`RULES`."""
    axes = LOGICAL_AXES.get(name.rsplit(".", 1)[-1])
    return PartitionSpec() if axes is None else PartitionSpec(*(RULES[a] for a in axes))


def shard_params(params: dict[str, jax.Array] | dict[str, np.ndarray], config: ModelConfig, n: int) -> dict[str, jax.Array]:
    """``params`` placed on a mesh of ``n`` devices, each split by :func:`partition_spec`."""
    check_tensor_parallel(config, n)
    mesh = tensor_parallel_mesh(n)
    return {name: jax.device_put(value, NamedSharding(mesh, partition_spec(name))) for name, value in params.items()}
