"""The one step: a forward pass over any KV state, one draw function, and the two ways of running it.

Every token zgen produces goes through these pure functions (compiled by :mod:`zgen.runtime.runner`):

* :func:`forward` — the model graph over a batch of token rows ``[B, T]`` at absolute positions
  (``-1`` = padding, written nowhere), reading and writing the KV state; logits at chosen rows.
* :func:`draw` — one token per row from logits (penalties, temperature, filters, Gumbel noise keyed
  by ``(row key, draw index)``) and its log-probability under the unmodified distribution.
* :func:`mixed_step` — one forward of a padded batch in which every row feeds a prefill chunk or a
  decode token, then a draw at every row's requested positions: prefill and decode in one batch.
* :func:`decode_loop` — feed each row's token, draw the next, feed it back ... as one
  ``lax.while_loop`` on the device, until every row stopped, a row finished while another request
  waits for its slot, or the loop has run its steps: N tokens for one host round trip. Rows under a
  grammar draw within a token mask computed on the host while the device runs the forward pass
  before that draw (handed over inside the loop: :class:`~zgen.runtime.grammar.GrammarLoop`).

The draw index of a sample is the position of the token whose logits it reads, so a row samples the
same tokens alone or batched, through either step, and whichever front end asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar, cast, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, UInt32

from zgen.cache.base import KVState, WriteAndAttendKVState
from zgen.cache.paged_state import PagedKVState
from zgen.cache.sharded import attend_per_shard, write_and_attend_per_shard
from zgen.graph.core import ForwardContext, Graph
from zgen.graph.decoder import LOGIT_ROWS, POSITIONS, TOKENS, feature_graph
from zgen.graph.fusion import fuse_norms
from zgen.lora.graph import ADAPTER_SLOTS
from zgen.pallas.common import platform
from zgen.pallas.norm_linear import add_rms_norm_linear, kernel_takes
from zgen.pallas.quantized_matmul import quantized_matmul
from zgen.pallas.rms_norm import add_rms_norm
from zgen.quantized_weights import QuantizedWeight
from zgen.runtime.grammar import GrammarLoop, allowed_tokens
from zgen.runtime.sampling import PenaltyState, SamplingFlags, SamplingParams, filter_logits, sample, update_penalty_state
from zgen.rope import rotary
from zgen.shapes import next_pow2

Params = Mapping[str, jax.Array]
S = TypeVar("S", bound=KVState)


class KernelContext(ForwardContext):
    """A context that runs the graph's fusable work (residual add + RMS norm, and with the projection
    reading the norm for a decode step's few rows) and the products of weights quantized with
    ``matmul="kernel"`` through zgen's kernels, where the platform has them; a model split over a
    ``mesh`` keeps XLA's forms, which the partitioner can split."""

    mesh: Mesh | None = None

    def quantized_linear(self, x: Float[Array, "*rows inp"], weight: QuantizedWeight) -> Float[Array, "*rows out"]:
        if self.mesh is None and weight.matmul == "kernel" and platform() == "gpu":
            return quantized_matmul(x, weight)
        return super().quantized_linear(x, weight)

    def add_rms_norm(
        self, x: Float[Array, "B T E"], delta: Float[Array, "B T E"], weight: Float[Array, " E"], eps: float
    ) -> tuple[Float[Array, "B T E"], Float[Array, "B T E"]]:
        if self.mesh is not None:
            return super().add_rms_norm(x, delta, weight, eps)
        return add_rms_norm(x, delta, weight, eps)

    def add_rms_norm_linear(
        self,
        x: Float[Array, "B T E"],
        delta: Float[Array, "B T E"] | None,
        norm_weight: Float[Array, " E"],
        eps: float,
        weight: jax.Array | QuantizedWeight,
    ) -> tuple[Float[Array, "B T E"] | None, Float[Array, "B T out"]]:
        if self.mesh is None and isinstance(weight, jax.Array) and kernel_takes(x, weight):
            return add_rms_norm_linear(x, delta, norm_weight, eps, weight)
        return super().add_rms_norm_linear(x, delta, norm_weight, eps, weight)


class _CacheContext(KernelContext, Generic[S]):
    """Threads the KV state through the attention nodes while the graph is traced; with a ``mesh``
    (a model split by heads) each layer's write and attention run per device (:mod:`zgen.cache.sharded`)."""

    def __init__(self, state: S, sliding_window: int | None, mesh: Mesh | None = None) -> None:
        self.state: S = state
        self.sliding_window = sliding_window
        self.mesh = mesh

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        inv_freq: Float[Array, " half"],
    ) -> Float[Array, "B T H D"]:
        if self.mesh is None and isinstance(self.state, WriteAndAttendKVState):
            out, state = self.state.write_and_attend(
                layer, q, k, v, positions, inv_freq=inv_freq, sliding_window=self.sliding_window
            )
            self.state = cast(S, state)
            return out
        q, k = rotary(q, positions, inv_freq), rotary(k, positions, inv_freq)
        if self.mesh is not None:
            out, self.state = write_and_attend_per_shard(self.state, self.mesh, layer, q, k, v, positions, sliding_window=self.sliding_window)
            return out
        self.state = cast(S, self.state.write(layer, k, v, positions))
        return self.state.attend(layer, q, positions, sliding_window=self.sliding_window)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Packing:
    """A step whose rows' tokens are packed into one stream ``[1, N]`` (no padding between rows): the
    matmuls run over the rows' real tokens only, and attention, which is per row, sees them laid out
    again as ``[L, W]``: the step's rows (``owners`` None), or, on a paged cache, pieces of at most
    ``W`` tokens of them, piece ``l`` belonging to row ``owners[l]`` and reading that row's pages, so one
    decoding token beside 512-token prompt chunks takes a short piece, not a row padded to 512
    (every piece's K/V is written before any piece attends). ``rows[l, w]``: the stream index of the
    layout's slot (-1: none); ``order[n]``: the ``l * W + w`` place of stream token ``n`` (padding at
    the stream's end: any place)."""

    rows: Int[Array, "L W"]
    order: Int[Array, " N"]
    owners: Int[Array, " L"] | None = None

    @staticmethod
    def of(
        tokens: np.ndarray, positions: np.ndarray, read_rows: np.ndarray, counts: Sequence[int], width: int | None = None,
        piece: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Packing]:
        """A padded step (``tokens``/``positions`` ``[B, T]``, row ``b`` holding ``counts[b]`` tokens,
        ``read_rows`` indices into T) packed on the host: the stream's tokens, positions and read
        indices, and the packing. The stream is ``width`` tokens long, or padded to a power of two (a
        compiled shape) no shorter than an eighth of the padded step. With ``piece``, attention's layout
        is pieces of at most that many tokens where that at least halves the rows' padded layout."""
        b, t = tokens.shape
        # At least an eighth of the padded layout: the short streams of a job's last admissions would
        # each be a compiled shape of their own, saving little.
        n = max(next_pow2(sum(counts), 16), next_pow2(b * t // 8, 16)) if width is None else width
        assert sum(counts) <= n, (sum(counts), n)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
        stream_tokens, stream_positions = np.zeros((1, n), np.int32), np.full((1, n), -1, np.int32)
        for i, count in enumerate(counts):
            stream_tokens[0, starts[i] : starts[i] + count] = tokens[i, :count]
            stream_positions[0, starts[i] : starts[i] + count] = positions[i, :count]
        read_rows = read_rows + starts[:, None]
        w = t if piece is None else min(piece, t)
        pieces = [(i, k) for i, count in enumerate(counts) for k in range(0, count, w)]
        # Room for the most pieces a stream this long can hold (each row ends in at most one short
        # piece): the layout, and so the compiled shape, follows from the step's shape alone.
        layout = next_pow2(n // w + b)
        split = piece is not None and b * t >= 2 * layout * w
        if not split:
            w, pieces, layout = t, [(i, 0) for i in range(b)], b  # one row of the layout a row of the step
        rows, order, owners = np.full((layout, w), -1, np.int32), np.zeros(n, np.int32), np.zeros(layout, np.int32)
        for l, (i, k) in enumerate(pieces):
            size = min(w, counts[i] - k)
            rows[l, :size] = np.arange(starts[i] + k, starts[i] + k + size)
            order[starts[i] + k : starts[i] + k + size] = l * w + np.arange(size)
            owners[l] = i
        packing = Packing(cast(Array, rows), cast(Array, order), cast(Array, owners) if split else None)
        return stream_tokens, stream_positions, read_rows.astype(np.int32), packing  # numpy: sent by the compiled call

    def unpack(self, x: Float[Array, "1 N ..."]) -> Float[Array, "L W ..."]:
        return x[0][jnp.maximum(self.rows, 0)]

    def pack(self, x: Float[Array, "L W ..."]) -> Float[Array, "1 N ..."]:
        return x.reshape(-1, *x.shape[2:])[self.order][None]


class _PackedContext(KernelContext):
    """Attention of a packed step (:class:`Packing`): each layer's q/k/v go back to their rows (or
    pieces: each reads its row's pages) for the cache's write and attention, and the output back into
    the stream."""

    def __init__(self, inner: _CacheContext[Any], packing: Packing) -> None:
        self.inner = inner
        self.packing = packing
        self.mesh = inner.mesh

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "1 N H D"],
        k: Float[Array, "1 N KVH D"],
        v: Float[Array, "1 N KVH D"],
        positions: Int[Array, "1 N"],
        inv_freq: Float[Array, " half"],
    ) -> Float[Array, "1 N H D"]:
        p = self.packing
        rows = jnp.where(p.rows >= 0, p.unpack(positions), -1)
        state = self.inner.state
        if p.owners is not None:
            assert isinstance(state, PagedKVState), "a packing in pieces needs a paged cache"
            self.inner.state = replace(state, block_tables=state.block_tables[p.owners])
        out = self.inner.write_and_attend(layer, p.unpack(q), p.unpack(k), p.unpack(v), rows, inv_freq)
        if p.owners is not None:
            self.inner.state = replace(self.inner.state, block_tables=state.block_tables)
        return p.pack(out)


@dataclass(frozen=True)
class ModelSpec:
    """What a step needs of a model: its graph and sliding window (static), its parameters (traced).
    ``lora_graph`` is the graph with LoRA injected, run for steps where a row has an adapter."""

    graph: Graph
    sliding_window: int | None
    lora_graph: Graph | None = None
    mesh: Mesh | None = None  # the devices a split model's heads are spread over (zgen.sharding)


def forward(
    model: ModelSpec,
    params: Params,
    kv: S,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    read_rows: Int[Array, "B R"],
    adapter_slots: Int[Array, " B"] | None = None,
    packing: Packing | None = None,
) -> tuple[Float[Array, "B R V"], S]:
    """Run the model over ``tokens`` at ``positions``, writing their K/V; float32 logits at ``read_rows``
    (indices into T). With ``adapter_slots`` the graph is the LoRA-injected one (:mod:`zgen.lora.graph`)
    and ``params`` carry the adapter bank. With ``packing``, ``tokens`` and ``positions`` are one packed
    stream ``[1, N]`` and ``read_rows`` index it (no adapters then)."""
    feeds = {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: read_rows if packing is None else read_rows.reshape(1, -1)}
    graph = model.graph
    if adapter_slots is not None:
        assert model.lora_graph is not None, "adapter slots given to a model spec without a LoRA graph"
        assert packing is None, "a packed step runs no adapters"
        feeds[ADAPTER_SLOTS], graph = adapter_slots, model.lora_graph
    (logits,), kv = run_graph(graph, model.sliding_window, params, kv, feeds, mesh=model.mesh, packing=packing)
    return logits.reshape(*read_rows.shape, -1), kv


def hidden_states(
    graph: Graph,
    sliding_window: int | None,
    params: Params,
    kv: S,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    adapter_slots: Int[Array, " B"] | None = None,
    mesh: Mesh | None = None,
) -> tuple[Float[Array, "B T H"], S]:
    """Run a graph cut after the final norm (:func:`~zgen.graph.decoder.hidden_state_graph`) over
    ``tokens`` at ``positions`` (-1: padding), writing their K/V; the hidden states of every token.
    ``adapter_slots`` feed a LoRA-injected graph, as in :func:`forward`; ``mesh`` as :class:`ModelSpec`'s."""
    feeds = {TOKENS: tokens, POSITIONS: positions}
    if adapter_slots is not None:
        feeds[ADAPTER_SLOTS] = adapter_slots
    (hidden,), kv = run_graph(graph, sliding_window, params, kv, feeds, mesh=mesh)
    return hidden, kv


def forward_features(
    model: ModelSpec,
    params: Params,
    kv: S,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    read_rows: Int[Array, "B R"],
    layers: tuple[int, ...],
) -> tuple[Float[Array, "B R V"], Float[Array, "B T F"], S]:
    """:func:`forward` that also returns the residual stream after each of ``layers`` at every token,
    concatenated (``F = len(layers) * hidden``): the target features an EAGLE head drafts from."""
    outputs, kv = run_graph(
        feature_graph(model.graph, layers), model.sliding_window, params, kv, {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: read_rows},
        mesh=model.mesh,
    )
    return outputs[0], jnp.concatenate(outputs[1:], axis=-1), kv


def read_features(
    model: ModelSpec, params: Params, kv: KVState, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], layers: tuple[int, ...]
) -> Float[Array, "B T F"]:
    """The features (as :func:`forward_features`) of tokens whose K/V ``kv`` already holds at
    ``positions``: their queries attend to the cache, which is read, never written."""
    (_, *features), _ = run_graph(
        feature_graph(model.graph, layers), model.sliding_window, params, kv,
        {TOKENS: tokens, POSITIONS: positions, LOGIT_ROWS: jnp.zeros((tokens.shape[0], 1), jnp.int32)}, write=False,
        mesh=model.mesh,
    )
    return jnp.concatenate(features, axis=-1)


def run_graph(
    graph: Graph, sliding_window: int | None, params: Params, kv: S, feeds: Mapping[str, jax.Array], *, write: bool = True,
    mesh: Mesh | None = None, packing: Packing | None = None,
) -> tuple[tuple[jax.Array, ...], S]:
    """Any graph whose attention reads and (``write``) writes ``kv`` (a draft head's, say), fed by name;
    with ``mesh``, attention runs on each device's own heads; with ``packing``, the feeds are one packed
    stream (:class:`Packing`)."""
    ctx = _CacheContext(kv, sliding_window, mesh) if write else _ReadingContext(kv, sliding_window, mesh)
    outputs = fuse_norms(graph).run(params, feeds, ctx if packing is None else _PackedContext(ctx, packing))
    return outputs, ctx.state


class _ReadingContext(_CacheContext[S]):
    """Attends to the KV state without writing the fed tokens' K/V (the state holds them already)."""

    def write_and_attend(
        self,
        layer: int,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B T KVH D"],
        v: Float[Array, "B T KVH D"],
        positions: Int[Array, "B T"],
        inv_freq: Float[Array, " half"],
    ) -> Float[Array, "B T H D"]:
        q = rotary(q, positions, inv_freq)
        if self.mesh is not None:
            return attend_per_shard(self.state, self.mesh, layer, q, positions, sliding_window=self.sliding_window)
        return self.state.attend(layer, q, positions, sliding_window=self.sliding_window)


Pooling = Literal["mean", "last", "cls", "max"]
POOLINGS: tuple[str, ...] = get_args(Pooling)


def pool_hidden(
    hidden: Float[Array, "B T H"], lengths: Int[Array, " B"], pooling: Pooling, normalize: bool
) -> Float[Array, "B H"]:
    """Pool each row's first ``lengths[b]`` hidden states, in float32."""
    hidden = hidden.astype(jnp.float32)
    real = jnp.arange(hidden.shape[1])[None, :] < lengths[:, None]  # [B, T]
    if pooling == "mean":
        pooled = jnp.sum(jnp.where(real[..., None], hidden, 0.0), axis=1) / jnp.maximum(lengths, 1)[:, None]
    elif pooling == "max":
        pooled = jnp.max(jnp.where(real[..., None], hidden, -jnp.inf), axis=1)
    elif pooling == "last":
        pooled = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    else:
        pooled = hidden[:, 0]
    if normalize:
        pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled


def draw(
    logits: Float[Array, "N V"],
    sampling: SamplingParams,
    penalties: PenaltyState | None,
    keys: UInt32[Array, "N 2"],
    draw_index: Int[Array, " N"],
    flags: SamplingFlags,
    allowed: Bool[Array, "N V"] | None = None,
) -> tuple[Int[Array, " N"], Float[Array, " N"]]:
    """One token per row (among the ``allowed`` ones: a grammar's mask) and its log-probability under
    the raw (unpenalized, unfiltered, unmasked) logits."""
    tokens = sample(_masked(logits, allowed), sampling, penalties, keys, draw_index, flags)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), tokens[:, None], axis=1)
    return tokens, logprobs[:, 0]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MixedBatch:
    """One padded batch of prefill chunks and decode tokens, and where to draw."""

    tokens: Int[Array, "B T"]
    positions: Int[Array, "B T"]  # -1: padding
    read_rows: Int[Array, "B R"]  # indices into T whose logits are read
    draw_index: Int[Array, "B R"]  # the position each read draws with (its fold-in counter)
    keys: UInt32[Array, "B 2"]
    sampling: SamplingParams
    penalties: PenaltyState | None
    adapter_slots: Int[Array, " B"] | None = None  # each row's LoRA bank slot (0: none), when any row has one
    packing: Packing | None = None  # tokens/positions are one packed stream [1, N]; read_rows index it


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MixedOutput:
    tokens: Int[Array, "B R"]
    logprobs: Float[Array, "B R"]
    logits: Float[Array, "B R V"] | None  # raw float32 logits, when asked
    filtered: Float[Array, "B R V"] | None  # what the sampler draws from, when a host choice needs it


def mixed_step(
    model: ModelSpec, params: Params, kv: S, batch: MixedBatch, *, flags: SamplingFlags, logits: bool, filtered: bool,
    draws: bool = True,
) -> tuple[MixedOutput, S]:
    """One forward of ``batch``, then a draw at every read row (a row's reads share its penalties).
    Without ``draws`` (no read samples: a step that only reads logits) the tokens and log-probabilities
    are zeros, computed from nothing: a vocabulary-wide draw per read costs as much as a fifth of a
    long prompt's forward on a CPU."""
    out, kv = forward(model, params, kv, batch.tokens, batch.positions, batch.read_rows, batch.adapter_slots, batch.packing)
    if not draws:
        nothing = jnp.zeros(batch.read_rows.shape, jnp.int32)
        return MixedOutput(nothing, nothing.astype(jnp.float32), out if logits else None, None), kv
    return draw_reads(out, batch, None, flags=flags, logits=logits, filtered=filtered), kv


def draw_reads(
    out: Float[Array, "B R V"],
    batch: MixedBatch,
    token_mask: Int[Array, "B W"] | None,
    *,
    flags: SamplingFlags,
    logits: bool,
    filtered: bool,
) -> MixedOutput:
    """The draws of a mixed step from its logits; ``token_mask`` (packed bits per row, see
    :func:`~zgen.runtime.grammar.allowed_tokens`) limits every read of a row to the tokens it allows."""
    b, r, v = out.shape
    repeat = lambda x: jnp.repeat(x, r, axis=0)  # noqa: E731 - one row per read
    sampling = jax.tree_util.tree_map(repeat, batch.sampling)
    penalties = None if batch.penalties is None else jax.tree_util.tree_map(repeat, batch.penalties)
    flat = out.reshape(b * r, v)
    allowed = None if token_mask is None else repeat(allowed_tokens(token_mask, v))
    tokens, logprobs = draw(flat, sampling, penalties, repeat(batch.keys), batch.draw_index.reshape(-1), flags, allowed)
    kept = filter_logits(_masked(flat, allowed), sampling, penalties, flags).reshape(b, r, v) if filtered else None
    return MixedOutput(tokens.reshape(b, r), logprobs.reshape(b, r), out if logits else None, kept)


def _masked(logits: Float[Array, "N V"], allowed: Bool[Array, "N V"] | None) -> Float[Array, "N V"]:
    return logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeLoop:
    """The carry of :func:`decode_loop` besides the KV state (all rows' own counters)."""

    token: Int[Array, " B"]  # the token each row feeds next
    position: Int[Array, " B"]  # its position; -1 for rows outside the loop (they write nothing)
    done: Bool[Array, " B"]  # rows that draw no more (rows outside the loop start done)
    last_step: Int[Array, " B"]  # the iteration of each row's last allowed draw
    stop_ids: Int[Array, "B K"]  # a drawn id among these ends the row (-1 = unused)
    keys: UInt32[Array, "B 2"]
    penalties: PenaltyState | None
    out_tokens: Int[Array, "B N"]  # draws per row (-1 past the row's end or the last iteration)
    out_logprobs: Float[Array, "B N"]
    step: Int[Array, ""]
    max_steps: Int[Array, ""]  # leave after this many iterations (<= N)
    exit_on_finish: Bool[Array, ""]  # leave as soon as a row finishes (another request waits for a slot)
    done_at_start: Int[Array, ""]  # rows done when the loop began
    adapter_slots: Int[Array, " B"] | None = None  # each row's LoRA bank slot (0: none), when any row has one


def decode_loop(
    model: ModelSpec, params: Params, kv: S, loop: DecodeLoop, sampling: SamplingParams, *, flags: SamplingFlags,
    grammar: GrammarLoop | None = None,
) -> tuple[DecodeLoop, S]:
    """Feed, draw, feed back ... on the device (see the module docstring).

    A row that finished keeps feeding its last token at its next position: that writes into its own
    reserved room past what it keeps (rolled back after the loop), so the body needs no masking of
    the fed tokens; rows outside the loop sit at position -1, which writes nothing. With ``grammar``
    every draw is limited to the row's mask: the draw hands its tokens to the host
    (:meth:`~zgen.runtime.grammar.GrammarLoop.device_submit`, which does not wait), the next forward
    pass runs while the host computes the masks, and the draw after it waits for them
    (:meth:`~zgen.runtime.grammar.GrammarLoop.device_masks`). A row whose grammar completed with a draw is
    told so at the next wait: it keeps nothing of that iteration and ends."""

    def going(s: DecodeLoop) -> Array:
        done = jnp.sum(s.done, dtype=jnp.int32)
        return (s.step < s.max_steps) & (done < s.done.shape[0]) & ~(s.exit_on_finish & (done > s.done_at_start))

    def body(carry: tuple[DecodeLoop, S, Array]) -> tuple[DecodeLoop, S, Array]:
        s, kv, ticket = carry  # ticket: orders a grammar's hand-overs (the last draw's, then this one's)
        logits, kv = forward(
            model, params, kv, s.token[:, None], s.position[:, None], jnp.zeros_like(s.token)[:, None], s.adapter_slots
        )
        active, allowed = ~s.done, None
        if grammar is not None:
            mask, grammar_ended = grammar.device_masks(logits, ticket, s.token.shape[0])
            active, allowed = active & ~grammar_ended, allowed_tokens(mask, logits.shape[-1])
        new, logprob = draw(logits[:, 0], sampling, s.penalties, s.keys, s.position, flags, allowed)
        ends = jnp.any(new[:, None] == s.stop_ids, axis=1) | (s.step >= s.last_step)
        s = replace(
            s,
            token=jnp.where(active, new, s.token),
            position=jnp.where(active, s.position + 1, s.position),
            done=s.done | ends | ~active,
            penalties=None if s.penalties is None else update_penalty_state(s.penalties, new, active),
            out_tokens=s.out_tokens.at[:, s.step].set(jnp.where(active, new, -1)),
            out_logprobs=s.out_logprobs.at[:, s.step].set(logprob),
            step=s.step + 1,
        )
        if grammar is not None:  # masks only for the rows that draw again in this loop
            ticket = grammar.device_submit(new, active, ~s.done & going(s), s.step)
        return s, kv, ticket

    loop, kv, _ = jax.lax.while_loop(lambda carry: going(carry[0]), body, (loop, kv, GrammarLoop.first_ticket()))
    return loop, kv
