"""TracingCacheProvider: a KV-state wrapper that records every write/attend while a step is traced.

Wrap any device state (:class:`~zgen.cache.base.KVState`) and pass the wrapper where the state would
go — :func:`zgen.runtime.step.forward` under ``jax.jit`` or ``jax.eval_shape``, or a
:class:`~zgen.runtime.runner.Runner`'s compiled steps. The
wrapper is a registered pytree whose only child is the wrapped state (so jit, donation and
``lax.while_loop`` carries see exactly the wrapped state's leaves) and whose static part is the
:class:`CacheTrace` log. Recording happens in Python, at trace time: one entry per ``write``/``attend``
the traced function performs (layer, shapes, dtypes, sliding window), so a compiled step's attention
dataflow can be printed with :meth:`CacheTrace.describe`. A cached executable runs without tracing and
records nothing; calls outside any trace are recorded too, marked ``traced=False``.

The log is compared by identity in the pytree's static part: states wrapped with the same log share
compiled executables, a new log means a new trace.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Literal, Self

import jax
from jax.core import Tracer
from jaxtyping import Array, Float, Int

from zgen.cache.base import KVState, LayerKV

Op = Literal["write", "attend"]


@dataclass(frozen=True)
class CacheEvent:
    """One recorded cache call."""

    index: int
    op: Op
    layer: int
    shape: tuple[int, ...]  # k (write) or q (attend)
    dtype: str
    v_shape: tuple[int, ...] | None  # write only
    positions_shape: tuple[int, ...]
    out_shape: tuple[int, ...] | None  # attend only
    sliding_window: int | None
    traced: bool  # False when called on concrete arrays, outside jit
    state: str  # the wrapped state's class name


class CacheTrace:
    """The log a :class:`TracingCacheProvider` appends to (thread-safe)."""

    def __init__(self) -> None:
        self._events: list[CacheEvent] = []
        self._lock = threading.Lock()

    @property
    def events(self) -> list[CacheEvent]:
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    def record(self, **fields: object) -> None:
        with self._lock:
            self._events.append(CacheEvent(index=len(self._events), **fields))  # pyright: ignore[reportArgumentType]

    def per_layer(self) -> dict[int, dict[str, int]]:
        """``{layer: {"write": n, "attend": m}}`` over the recorded events."""
        counts: dict[int, Counter[str]] = {}
        for event in self.events:
            counts.setdefault(event.layer, Counter())[event.op] += 1
        return {layer: {"write": c["write"], "attend": c["attend"]} for layer, c in sorted(counts.items())}

    def describe(self) -> str:
        """A table of the recorded calls, in order, then a per-layer summary."""
        header = ("#", "op", "layer", "k/q shape", "v shape", "positions", "out shape", "dtype", "window", "traced")
        rows: list[tuple[str, ...]] = [header]
        for e in self.events:
            rows.append(
                (
                    str(e.index),
                    e.op,
                    str(e.layer),
                    _shape(e.shape),
                    _shape(e.v_shape),
                    _shape(e.positions_shape),
                    _shape(e.out_shape),
                    e.dtype,
                    "-" if e.sliding_window is None else str(e.sliding_window),
                    "yes" if e.traced else "no",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        summary = self.per_layer()
        if summary:
            lines.append("")
            lines.append("per layer: " + ", ".join(f"{l}: {c['write']}w/{c['attend']}a" for l, c in summary.items()))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CacheTrace({len(self._events)} events)"


def _shape(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(str(d) for d in shape) + ")"


def _is_traced(*arrays: jax.Array) -> bool:
    return any(isinstance(a, Tracer) for a in arrays)


@jax.tree_util.register_pytree_node_class
class TracingCacheProvider:
    """A :class:`~zgen.cache.base.KVState` that delegates to ``inner`` and records calls in ``trace``."""

    def __init__(self, inner: KVState, trace: CacheTrace | None = None) -> None:
        self.inner = inner
        self.trace = trace if trace is not None else CacheTrace()

    # -- pytree ------------------------------------------------------------------------------------

    def tree_flatten(self) -> tuple[tuple[KVState], CacheTrace]:
        return (self.inner,), self.trace

    @classmethod
    def tree_unflatten(cls, trace: CacheTrace, children: tuple[KVState]) -> TracingCacheProvider:
        return cls(children[0], trace)

    # -- KVState -----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    def write(
        self,
        layer: int,
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
    ) -> Self:
        self.trace.record(
            op="write",
            layer=layer,
            shape=tuple(k.shape),
            dtype=str(k.dtype),
            v_shape=tuple(v.shape),
            positions_shape=tuple(positions.shape),
            out_shape=None,
            sliding_window=None,
            traced=_is_traced(k, v, positions),
            state=type(self.inner).__name__,
        )
        return type(self)(self.inner.write(layer, k, v, positions), self.trace)

    def attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        positions: Int[Array, "B T"],
        *,
        sliding_window: int | None,
    ) -> Float[Array, "B T H D"]:
        out = self.inner.attend(layer, q, positions, sliding_window=sliding_window)
        self.trace.record(
            op="attend",
            layer=layer,
            shape=tuple(q.shape),
            dtype=str(q.dtype),
            v_shape=None,
            positions_shape=tuple(positions.shape),
            out_shape=tuple(out.shape),
            sliding_window=sliding_window,
            traced=_is_traced(q, positions),
            state=type(self.inner).__name__,
        )
        return out

    def layer_view(self, layer: int) -> LayerKV:
        return self.inner.layer_view(layer)

    def unwrap(self) -> KVState:
        """The wrapped state (e.g. a step's returned state, to hand back to its manager)."""
        return self.inner

    def describe(self) -> str:
        return self.trace.describe()

    def __repr__(self) -> str:
        return f"TracingCacheProvider({type(self.inner).__name__}, {self.trace!r})"


TracingKVState = TracingCacheProvider

__all__ = ["CacheEvent", "CacheTrace", "TracingCacheProvider", "TracingKVState"]
