"""Compile a graph into an ExecutionPlan: ahead-of-time compiled XLA executables with fixed shapes.

This is the JAX analogue of CUDA-graph capture. Each distinct shape (batch, prompt bucket, cache
capacity) is lowered and compiled once; the cache state is donated so XLA updates it in place; the
whole decode loop is a single ``lax.while_loop`` whose carry holds the cache, positions, RNG,
finished flags and the output buffer, so N tokens cost one host round trip.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zgen.cache.base import KVState
from zgen.graph.core import ForwardContext, Graph
from zgen.graph.decoder import LOGIT_ROWS, POSITIONS, TOKENS
from zgen.graph.nodes import rotary
from zgen.sampling import PenaltyState, SamplingFlags, SamplingParams, sample, update_penalty_state

Params = Mapping[str, jax.Array]
S = TypeVar("S", bound=KVState)


def enable_persistent_compilation_cache() -> None:
    """Reuse compiled executables across processes (tests, CLI runs) unless the user chose a cache."""
    if jax.config.jax_compilation_cache_dir:  # pyright: ignore[reportAttributeAccessIssue]
        return
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zgen" / "xla"
    jax.config.update("jax_compilation_cache_dir", os.environ.get("ZGEN_XLA_CACHE_DIR", str(default)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class _CacheContext(ForwardContext, Generic[S]):
    """Threads the cache state through the attention nodes while the graph is traced."""

    def __init__(self, state: S, sliding_window: int | None) -> None:
        self.state = state
        self.sliding_window = sliding_window

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        inv_freq: Float[Array, " half"],
    ) -> Float[Array, "B T H D"]:
        self.state = cast(S, self.state.write(layer, rotary(k, positions, inv_freq), v, positions))
        return self.state.attend(layer, q, positions, sliding_window=self.sliding_window)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeState:
    """Everything the on-device decode loop carries besides the cache."""

    logits: Float[Array, "B V"]  # raw next-token logits (log-probs are taken from these)
    positions: Int[Array, " B"]  # position the next fed token will take
    step: Int[Array, ""]  # tokens generated so far
    finished: Bool[Array, " B"]
    tokens: Int[Array, "B N"]  # output buffer; rows that finished hold pad_id
    logprobs: Float[Array, "B N"]
    row_keys: jax.Array  # per-row PRNG keys
    penalties: PenaltyState | None  # None unless some row uses a penalty
    max_new_tokens: Int[Array, " B"]
    stop_ids: Int[Array, "B K"]  # -1 = unused slot


@dataclass
class ExecutionPlan:
    """Compiled prefill and decode-loop executables for one graph, cached by shape."""

    graph: Graph
    sliding_window: int | None
    pad_id: int = 0

    def __post_init__(self) -> None:
        enable_persistent_compilation_cache()
        self._executables: dict[Hashable, Any] = {}

    # -- traced functions ------------------------------------------------------------------------

    def forward(
        self,
        params: Params,
        state: S,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        logit_rows: Int[Array, "B R"],
    ) -> tuple[Float[Array, "B R V"], S]:
        ctx = _CacheContext(state, self.sliding_window)
        (logits,) = self.graph.run(params, {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: logit_rows}, ctx)
        return logits, ctx.state

    def _decode_body(
        self, params: Params, sampling: SamplingParams, flags: SamplingFlags
    ) -> Callable[[tuple[DecodeState, KVState]], tuple[DecodeState, KVState]]:
        def body(carry: tuple[DecodeState, KVState]) -> tuple[DecodeState, KVState]:
            s, cache = carry
            token = sample(s.logits, sampling, s.penalties, s.row_keys, s.step, flags)
            logprob = jnp.take_along_axis(jax.nn.log_softmax(s.logits, axis=-1), token[:, None], axis=1)[:, 0]
            active = ~s.finished
            token = jnp.where(active, token, self.pad_id)
            hit_stop = jnp.any(token[:, None] == s.stop_ids, axis=1) & active
            finished = s.finished | hit_stop | (s.step + 1 >= s.max_new_tokens)
            penalties = update_penalty_state(s.penalties, token, active) if s.penalties is not None else None
            logits, cache = self.forward(
                params, cache, token[:, None], s.positions[:, None], jnp.zeros_like(token)[:, None]
            )
            new = replace(
                s,
                logits=logits[:, 0],
                positions=s.positions + 1,
                step=s.step + 1,
                finished=finished,
                tokens=s.tokens.at[:, s.step].set(token),
                logprobs=s.logprobs.at[:, s.step].set(jnp.where(active, logprob, 0.0)),
                penalties=penalties,
            )
            return new, cache

        return body

    def _decode_loop(
        self,
        params: Params,
        cache: KVState,
        state: DecodeState,
        sampling: SamplingParams,
        stop_at: Int[Array, ""],
        flags: SamplingFlags,
    ) -> tuple[DecodeState, KVState]:
        def cond(carry: tuple[DecodeState, KVState]) -> jax.Array:
            s = carry[0]
            return (s.step < stop_at) & ~jnp.all(s.finished)

        return jax.lax.while_loop(cond, self._decode_body(params, sampling, flags), (state, cache))

    # -- compiled entry points -------------------------------------------------------------------

    def prefill(
        self,
        params: Params,
        cache: S,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        logit_rows: Int[Array, "B R"],
    ) -> tuple[Float[Array, "B R V"], S]:
        """Run the prompt (padded to a bucket) through the model, writing the cache in place."""
        key = ("prefill", _shape_key(cache), tokens.shape, logit_rows.shape)
        compiled = self._compiled(key, lambda: jax.jit(self.forward, donate_argnums=(1,)).lower(
            params, cache, tokens, positions, logit_rows
        ))
        return compiled(params, cache, tokens, positions, logit_rows)

    def decode(
        self,
        params: Params,
        cache: S,
        state: DecodeState,
        sampling: SamplingParams,
        stop_at: int,
        flags: SamplingFlags,
    ) -> tuple[DecodeState, S]:
        """Generate until every row finished or ``stop_at`` tokens exist, without leaving the device."""
        key = ("decode", _shape_key(cache), state.tokens.shape, state.stop_ids.shape, flags)
        stop = jnp.asarray(stop_at, jnp.int32)

        def lower() -> Any:
            fn = jax.jit(self._decode_loop, donate_argnums=(1, 2), static_argnums=(5,))
            return fn.lower(params, cache, state, sampling, stop, flags)

        return self._compiled(key, lower)(params, cache, state, sampling, stop)

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

    def _compiled(self, key: Hashable, lower: Callable[[], Any]) -> Any:
        compiled = self._executables.get(key)
        if compiled is None:
            compiled = lower().compile()
            self._executables[key] = compiled
        return compiled


def _shape_key(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (treedef, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves))
