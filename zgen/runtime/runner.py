"""A model's compiled steps: ahead-of-time executables per shape bucket (the CUDA-graph analogue).

Each distinct shape (batch width, tokens per row, reads, KV state layout, sampling flags) is lowered
and compiled once, then called directly: no retracing, no Python per token. The KV state (and the
decode loop's carry) is donated, so XLA updates the cache in place. On GPU and TPU, executables are
also kept in JAX's persistent compilation cache, so a second process skips compiling. All engines of
one model share its :class:`Runner` (:func:`runner_for`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from zgen.cache.base import KVState
from zgen.graph.decoder import hidden_state_graph
from zgen.lora.bank import LoraBank
from zgen.lora.graph import inject_lora
from zgen.model import Model, attached
from zgen.runtime.grammar import GrammarDrafts, GrammarLoop
from zgen.runtime.sampling import SamplingFlags, SamplingParams
from zgen.runtime.speculation import ResumableSpeculator, SpeculativeLoop, Speculator, loop_key, speculative_loop
from zgen.runtime.step import (
    DecodeLoop, MixedBatch, MixedOutput, ModelSpec, Packing, Pooling, decode_loop, draw_reads, forward, hidden_states, mixed_step,
    pool_hidden,
)

S = TypeVar("S", bound=KVState)


def enable_persistent_compilation_cache() -> None:
    """Reuse compiled executables across processes (CLI runs, benchmarks) on GPU and TPU, unless the
    user chose a cache. Not on CPU: serializing XLA:CPU executables of the size a decoder step makes
    crashed the process (a segfault or abort inside XLA, jax 0.10.2) after many compilations in one
    long process; setting ``jax_compilation_cache_dir`` yourself still enables it there."""
    if jax.config.jax_compilation_cache_dir or jax.default_backend() == "cpu":  # pyright: ignore[reportAttributeAccessIssue]
        return
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zgen" / "xla"
    jax.config.update("jax_compilation_cache_dir", os.environ.get("ZGEN_XLA_CACHE_DIR", str(default)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class Runner:
    """Compiled :func:`~zgen.runtime.step.forward`, :func:`~zgen.runtime.step.mixed_step`,
    :func:`~zgen.runtime.step.decode_loop` and the speculative loop of one model, cached by shape."""

    def __init__(self, model: Model) -> None:
        enable_persistent_compilation_cache()
        self.model = model
        lora_graph = inject_lora(model.graph)
        self.spec = ModelSpec(model.graph, model.config.sliding_window, lora_graph, model.mesh)
        self._executables: dict[Hashable, Any] = {}
        self._device = _device_of(model.params)  # None: split over devices
        self._draft_params_of: dict[int, tuple[Speculator, Any]] = {}
        self.compile_seconds = 0.0  # spent lowering and compiling so far (not part of a call's run time)
        # Loops' output columns never narrow, for every engine of the model (a batch job after a warm-up,
        # several Generators), and start wide enough for 64 draws (a speculative pass's timing draws,
        # a sync interval's steps and short answers share one loop): each width is a compiled loop
        # (seconds for an 8B model), while a loop's draws are bounded by a traced step count.
        self._loop_columns = 64
        self._hidden_graph = hidden_state_graph(model.graph)
        self._hidden_lora_graph = hidden_state_graph(lora_graph)

    def loop_columns(self, steps: int) -> int:
        """The draws a loop of ``steps`` draws makes room for: the most any loop of the model had (a decode
        loop's output columns; a speculative loop's, less what its last pass may keep past them)."""
        self._loop_columns = max(self._loop_columns, steps)
        return self._loop_columns

    def run_seconds(self, started: float, compile_seconds: float) -> float:
        """Seconds since ``started`` (a ``time.perf_counter()``) less the compiling done since then
        (``compile_seconds`` was :attr:`compile_seconds` at the start)."""
        return time.perf_counter() - started - (self.compile_seconds - compile_seconds)

    @property
    def params(self) -> Any:
        return self.model.params

    def _params(self, adapters: LoraBank | None) -> Any:
        """The model's parameters, with a step's LoRA bank (:func:`zgen.lora.bank.stack_mixes`) beside them."""
        return self.params if adapters is None else {**self.params, **adapters.arrays}

    def forward(
        self, kv: S, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], read_rows: Int[Array, "B R"],
        adapter_slots: Int[Array, " B"] | None = None, packing: Packing | None = None, *, adapters: LoraBank | None = None,
    ) -> tuple[Float[Array, "B R V"], S]:
        """Feed ``tokens`` at ``positions`` (-1: padding), writing the cache; raw logits at ``read_rows``
        (with ``adapter_slots``, each row's LoRA from the bank ``adapters``; with ``packing``, one packed
        stream: :class:`~zgen.runtime.step.Packing`)."""
        key = ("forward", _shape_key(kv), tokens.shape, read_rows.shape, _shape_key(packing), None if adapters is None else adapters.shapes)
        args = (self._params(adapters), kv, tokens, positions, read_rows, adapter_slots, packing)
        return self._compiled(key, lambda: jax.jit(self._forward, donate_argnums=(1,)).lower(*args))(*args)

    def mixed(
        self, kv: S, batch: MixedBatch, *, flags: SamplingFlags, logits: bool = False, filtered: bool = False,
        draws: bool = True, adapters: LoraBank | None = None,
    ) -> tuple[MixedOutput, S]:
        key = ("mixed", _shape_key(kv), _shape_key(batch), flags, logits, filtered, draws, None if adapters is None else adapters.shapes)
        args = (self._params(adapters), kv, batch)

        def lower() -> Any:
            fn = jax.jit(self._mixed, donate_argnums=(1,), static_argnames=("flags", "logits", "filtered", "draws"))
            return fn.lower(*args, flags=flags, logits=logits, filtered=filtered, draws=draws)

        return self._compiled(key, lower)(*args)

    def draw(
        self, out: Float[Array, "B R V"], batch: MixedBatch, token_mask: Int[Array, "B W"] | None, *,
        flags: SamplingFlags, logits: bool = False, filtered: bool = False,
    ) -> MixedOutput:
        """The draws of a mixed step whose forward ran apart (:meth:`forward`), within a token mask."""
        key = ("draw", _shape_key((out, batch, token_mask)), flags, logits, filtered)
        args = (out, batch, token_mask)

        def lower() -> Any:
            fn = jax.jit(draw_reads, static_argnames=("flags", "logits", "filtered"))
            return fn.lower(*args, flags=flags, logits=logits, filtered=filtered)

        return self._compiled(key, lower)(*args)

    def decode(
        self, kv: S, loop: DecodeLoop, sampling: SamplingParams, *, flags: SamplingFlags,
        adapters: LoraBank | None = None, grammar: GrammarLoop | None = None,
    ) -> tuple[DecodeLoop, S]:
        """The decode loop (:func:`~zgen.runtime.step.decode_loop`); ``grammar`` is compiled in (one
        executable per engine that constrains its loops)."""
        key = ("decode", _shape_key(kv), _shape_key(loop), flags, None if adapters is None else adapters.shapes, grammar)
        args = (self._params(adapters), kv, loop, sampling)

        def lower() -> Any:
            fn = jax.jit(self._decode, donate_argnums=(1, 2), static_argnames=("flags", "grammar"))
            return fn.lower(*args, flags=flags, grammar=grammar)

        return self._compiled(key, lower)(*args)

    def speculate(
        self, kv: S, loop: SpeculativeLoop, sampling: SamplingParams, speculator: Speculator, *, flags: SamplingFlags,
        grammar: GrammarDrafts | None = None, carried: Any = None,
    ) -> tuple[SpeculativeLoop, S, Any]:
        """The speculative loop (:func:`~zgen.runtime.speculation.speculative_loop`), compiled once per
        shape, sampling flags and speculator key; ``grammar`` is compiled in, like the decode loop's.
        A :class:`~zgen.runtime.speculation.ResumableSpeculator` goes on from ``carried`` (the state
        the last loop over the same rows returned; ``None``: it starts over) and returns its state."""
        draft_params = self._draft_params(speculator)
        resumable = isinstance(speculator, ResumableSpeculator)
        fresh = carried is None
        if resumable and fresh:  # a state of the loop's shapes for `start` to replace: one executable either way
            carried = self._start_placeholder(speculator, loop)
        key = ("speculate", _shape_key(kv), _shape_key(loop), _shape_key(draft_params), flags, loop_key(speculator), grammar)
        args = (self.params, kv, loop, sampling, draft_params, carried, np.bool_(fresh))

        def run(
            params: Any, kv: S, loop: SpeculativeLoop, sampling: SamplingParams, draft: Any, carried: Any, fresh: Any
        ) -> tuple[SpeculativeLoop, S, Any]:
            out, state, final = speculative_loop(
                self.spec, params, kv, loop, sampling, speculator, draft, flags=flags, grammar=grammar,
                carried=carried if resumable else None, fresh=fresh,
            )
            return out, state, final  # type: ignore[return-value]

        return self._compiled(key, lambda: jax.jit(run, donate_argnums=(1, 2, 5)).lower(*args))(*args)

    def _draft_params(self, speculator: Speculator) -> Any:
        """The speculator's arrays on this runner's device, looked up once per speculator: a model
        replica on another device (a batch job's data-parallel replica) drafts with its own copy; a
        model split over a mesh (tensor parallelism) with a copy on each of its devices, except for
        arrays already spread over that mesh (an early exit of the split model itself)."""
        known = self._draft_params_of.get(id(speculator))
        if known is not None and known[0] is speculator:
            return known[1]
        params = speculator.device_params()
        mesh = self.spec.mesh
        if mesh is not None:
            replicated = NamedSharding(mesh, PartitionSpec())
            on_mesh = set(mesh.devices.flat)
            params = jax.tree_util.tree_map(
                lambda leaf: leaf if isinstance(leaf, jax.Array) and leaf.devices() == on_mesh else jax.device_put(leaf, replicated), params
            )
        elif self._device is not None and _device_of(params) not in (None, self._device):
            params = jax.device_put(params, self._device)
        self._draft_params_of[id(speculator)] = (speculator, params)  # keeps the speculator, so its id stays its own
        return params

    def _start_placeholder(self, speculator: Speculator, loop: SpeculativeLoop) -> Any:
        """Zeros shaped like ``speculator``'s state at the start of a loop like ``loop``, made by one
        compiled call (made leaf by leaf, a 27-layer draft's K/V took a GPU 43 ms a loop)."""

        def lower() -> Any:
            shapes = jax.eval_shape(speculator.start, speculator.device_params(), loop.history, loop.length)
            return jax.jit(lambda: jax.tree_util.tree_map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shapes)).lower()

        return self._compiled(("start", loop_key(speculator), loop.history.shape, loop.length.shape), lower)()

    def embed(
        self, kv: KVState, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], lengths: Int[Array, " B"], *,
        pooling: Pooling, normalize: bool, adapter_slots: Int[Array, " B"] | None = None, adapters: LoraBank | None = None,
    ) -> Float[Array, "B H"]:
        """Pooled last hidden states of ``tokens`` (see :mod:`zgen.runtime.embedding`); ``kv`` is scratch."""
        key = ("embed", _shape_key(kv), tokens.shape, pooling, normalize, None if adapters is None else adapters.shapes)
        args = (self._params(adapters), kv, tokens, positions, lengths, adapter_slots)

        def lower() -> Any:
            fn = jax.jit(self._embed, static_argnames=("pooling", "normalize"))  # the scratch KV is not returned
            return fn.lower(*args, pooling=pooling, normalize=normalize)

        return self._compiled(key, lower)(*args)

    def analysis(self) -> dict[str, dict[str, Any]]:
        """XLA's cost and memory analysis of every executable compiled so far."""
        report: dict[str, dict[str, Any]] = {}
        for key, compiled in self._executables.items():
            cost = compiled.cost_analysis()
            if isinstance(cost, list):  # older jax returns one dict per computation
                cost = cost[0] if cost else {}
            memory = compiled.memory_analysis()
            report[str(key)] = {
                "flops": float(cost.get("flops", 0.0)) if cost else 0.0,
                "bytes_accessed": float(cost.get("bytes accessed", 0.0)) if cost else 0.0,
                "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
                "output_bytes": getattr(memory, "output_size_in_bytes", None),
                "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
            }
        return report

    # -- traced ---------------------------------------------------------------------------------

    def _forward(
        self, params: Any, kv: S, tokens: Array, positions: Array, read_rows: Array, adapter_slots: Array | None,
        packing: Packing | None,
    ) -> tuple[Array, S]:
        return forward(self.spec, params, kv, tokens, positions, read_rows, adapter_slots, packing)

    def _mixed(
        self, params: Any, kv: S, batch: MixedBatch, *, flags: SamplingFlags, logits: bool, filtered: bool, draws: bool
    ) -> tuple[MixedOutput, S]:
        return mixed_step(self.spec, params, kv, batch, flags=flags, logits=logits, filtered=filtered, draws=draws)

    def _decode(
        self, params: Any, kv: S, loop: DecodeLoop, sampling: SamplingParams, *, flags: SamplingFlags,
        grammar: GrammarLoop | None,
    ) -> tuple[DecodeLoop, S]:
        return decode_loop(self.spec, params, kv, loop, sampling, flags=flags, grammar=grammar)

    def _embed(
        self, params: Any, kv: KVState, tokens: Array, positions: Array, lengths: Array, adapter_slots: Array | None, *,
        pooling: Pooling, normalize: bool,
    ) -> Array:
        graph = self._hidden_graph if adapter_slots is None else self._hidden_lora_graph
        hidden, _ = hidden_states(graph, self.spec.sliding_window, params, kv, tokens, positions, adapter_slots, self.spec.mesh)
        return pool_hidden(hidden, lengths, pooling, normalize)

    def _compiled(self, key: Hashable, lower: Callable[[], Any]) -> Any:
        compiled = self._executables.get(key)
        if compiled is None:
            started = time.perf_counter()
            compiled = lower().compile()
            self.compile_seconds += time.perf_counter() - started
            self._executables[key] = compiled
        return compiled


def runner_for(model: Model) -> Runner:
    """The model's runner, shared by every engine and front end of it."""
    return attached(model, "runner", lambda: Runner(model))


def _shape_key(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves))


def _device_of(tree: Any) -> Any:
    """The one device (a ``jax.Device``, which jax's stubs do not declare as a type) every array of
    ``tree`` sits on; None for none, several, or arrays split over devices."""
    devices: set[Any] = set()
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            devices |= leaf.devices()
    return next(iter(devices)) if len(devices) == 1 else None
