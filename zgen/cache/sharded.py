"""A layer's KV write and attention on each device's own heads (tensor parallelism).

A model split by :mod:`zgen.sharding` keeps on each device its own query heads and the KV heads they
read (GQA groups never straddle devices), and the KV state comes out split the same way. The
attention kernels (:mod:`zgen.pallas`) are custom calls XLA's partitioner cannot split: left to it,
every device would gather every head's K/V and run the whole kernel. So the write and the attention
of one layer run in ``jax.shard_map`` over the mesh's head axis: each device runs the same kernel one
device would, on its heads alone, and nothing crosses devices until the output projection's
all-reduce.

A state kind takes part by offering :class:`HeadSplit`'s three methods: ``select`` (a one-layer
state), ``merge`` (that layer put back) and ``head_specs`` (a ``PartitionSpec`` per leaf). The KV
managers build their buffers split the same way (:func:`state_split_by_heads`,
:func:`pages_split_by_heads`), so no device ever holds every head's K/V, not even before the first step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from zgen.cache.base import KVState
from zgen.errors import ConfigError
from zgen.sharding import TP_AXIS

# q, k, v [B, T, heads, D]: split by heads.
HEADS = PartitionSpec(None, None, TP_AXIS)


@runtime_checkable
class HeadSplit(KVState, Protocol):
    """A KV state whose layers can be cut out and split by KV heads."""

    def select(self, layer: int) -> Self:
        """A one-layer state holding ``layer``."""
        ...

    def merge(self, layer: int, one: Self) -> Self:
        """This state with ``layer`` taken from the one-layer state ``one``."""
        ...

    def head_specs(self, axis: str) -> Self:
        """This state's pytree with a ``PartitionSpec`` per leaf: where it holds KV heads, split over ``axis``."""
        ...


S = TypeVar("S", bound=KVState)
T = TypeVar("T")


def _head_split(state: KVState) -> HeadSplit:
    if not isinstance(state, HeadSplit):
        raise ConfigError(
            f"a {type(state).__name__} cannot be split by heads over devices; run this model on one device "
            "or use a dense or paged cache"
        )
    return state


def write_and_attend_per_shard(
    state: S,
    mesh: Mesh,
    layer: int,
    q: Float[Array, "B T H D"],
    k: Float[Array, "B T KVH D"],
    v: Float[Array, "B T KVH D"],
    positions: Int[Array, "B T"],
    *,
    sliding_window: int | None,
) -> tuple[Float[Array, "B T H D"], S]:
    """``state.write(layer, k, v, positions)`` then its ``attend`` with ``q``, each device on its own
    heads (``k`` already rotated, as ``write`` takes it); the attention output and the new state."""
    split = _head_split(state)
    one = split.select(layer)
    specs = one.head_specs(TP_AXIS)

    def local(one: HeadSplit, q: Array, k: Array, v: Array, positions: Array) -> tuple[Array, HeadSplit]:
        one = one.write(0, k, v, positions)
        return one.attend(0, q, positions, sliding_window=sliding_window), one

    # check_vma off: kernels (pallas_call) do not track which values vary across devices.
    run = jax.shard_map(local, mesh=mesh, in_specs=(specs, HEADS, HEADS, HEADS, PartitionSpec()), out_specs=(HEADS, specs), check_vma=False)
    out, one = run(one, q, k, v, positions)
    return out, split.merge(layer, one)  # type: ignore[return-value]  # the same kind as state


def attend_per_shard(
    state: KVState,
    mesh: Mesh,
    layer: int,
    q: Float[Array, "B T H D"],
    positions: Int[Array, "B T"],
    *,
    sliding_window: int | None,
) -> Float[Array, "B T H D"]:
    """``state.attend(layer, q, positions)`` (no write), each device on its own heads."""
    one = _head_split(state).select(layer)

    def local(one: HeadSplit, q: Array, positions: Array) -> Array:
        return one.attend(0, q, positions, sliding_window=sliding_window)

    run = jax.shard_map(local, mesh=mesh, in_specs=(one.head_specs(TP_AXIS), HEADS, PartitionSpec()), out_specs=HEADS, check_vma=False)
    return run(one, q, positions)


def _built_split(make: Callable[[], T], mesh: Mesh, specs: Callable[[Any], Any]) -> T:
    """What ``make`` builds, built in place on ``mesh`` with ``specs`` of its abstract value (a
    ``PartitionSpec`` per leaf): each device allocates its own part only."""
    shardings = jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs(jax.eval_shape(make)))
    return jax.jit(make, out_shardings=shardings)()


def state_split_by_heads(make: Callable[[], S], mesh: Mesh) -> S:
    """The KV state ``make`` builds (zeros), built split by KV heads over ``mesh``."""
    return _built_split(make, mesh, lambda state: _head_split(state).head_specs(TP_AXIS))


def pages_split_by_heads(make: Callable[[], T], mesh: Mesh) -> T:
    """Page pools ``make`` builds (every leaf leads with the KV heads), built split by heads over ``mesh``."""
    return _built_split(make, mesh, lambda pages: jax.tree_util.tree_map(lambda _: PartitionSpec(TP_AXIS), pages))
