"""Speculative decoding on the device: draft, verify in one forward pass, accept, roll back.

A :class:`Speculator` (prompt lookup, a draft model, ... : :mod:`zgen.speculative`) proposes up to
``k`` tokens after each row's pending token. :func:`speculative_loop` runs, as one
``lax.while_loop`` with fixed shapes (``k`` is the static maximum draft length):

1. **draft** — the speculator's traced ``propose`` (a draft model's forward passes run inside it);
2. **verify** — ONE forward pass of the target over ``[pending, d_1 .. d_k]`` at positions
   ``p .. p+k``, logits read at all ``k + 1`` of them (:func:`verify`);
3. **accept** — the longest prefix of the draft the target agrees with, plus one token of the target's
   own (the correction, or the bonus token after a fully accepted draft): 1 to ``k + 1`` tokens per
   pass;
4. **roll back** — nothing to do on the device: every cache kind zgen speculates on is positional (a
   key at position ``j`` is visible only to queries at ``p >= j``, and K/V are quantized per token),
   so the K/V of rejected drafts are invisible and are overwritten by the next pass. After the loop
   the engine cuts every sequence to what it kept with the cache's exact ``truncate``. The lossy
   ``compressed`` cache pools chunks as tokens arrive, so writing rejected drafts would change what it
   keeps: it refuses speculation (:class:`~zgen.errors.ConfigError`).

**Trees.** A speculator may propose a token tree instead (:class:`Proposal` with ``parents`` and
``depth``, ``N`` nodes; a :class:`TreeSpeculator`: EAGLE-2 trees, :mod:`zgen.speculative.tree`). The
pass then runs the target once over ``[pending, node_1 .. node_N]``, each node at position
``p + depth`` and attending to the context and its own ancestors only; the nodes' K/V go to scratch
slots ``p + 1 .. p + N`` (reserved like a chain's drafts, :func:`draft_room`), and after acceptance
the accepted path's K/V are written at ``p + 1 .. p + a`` through the cache's own ``write``
(:mod:`zgen.runtime.tree`), so the cache holds what feeding only the kept tokens stores and the rest
is rolled back like rejected drafts. Acceptance walks down from the root (:func:`verify_tree`); the
adaptive length bounds the depth, and the figures count the depth drafted (``drafted``) against the
path accepted. A chain is the tree whose parents are ``i - 1`` and takes none of this work. Rows
under a grammar are not given tree speculators (the engine decodes them plainly).

A speculator that is also an :class:`Observer` sees, after each verification, the target's own draw at
every checked position, the ones past a rejection included (Jacobi decoding takes its next guesses
from them); it only changes what is drafted, never what is accepted. One that is a
:class:`FeatureObserver` (EAGLE) gets the target's features (hidden states) at every position each
forward pass writes (after a tree pass: the pending token's and the accepted path's, at the positions
they hold once the path is committed). Plain decode steps leave them out (a stretch in fallback is the
plain decode loop's and costs what it costs, so :class:`LoopTimes` measures passes against it
truly): before a pass drafts, the loop reads those it lacks before each row's pending token, at loop
start a whole window, from the cache without writing it (:func:`observe_missing_features`).

Acceptance rules, per row:

* a *deterministic* draft (``Proposal.probs is None``; prompt lookup) or a greedy row: a drafted token
  is accepted iff it equals the target's own draw at that position — the runtime's sampler with the
  row's key and draw index, so the output is token for token what plain decoding gives (greedy or
  sampled). For a point-mass draft this is speculative rejection sampling: the draw equals ``d`` with
  probability ``p(d)``, and otherwise is a draw from ``p`` without ``d``, the residual distribution;
* a *sampled* draft with its distribution ``q`` (a draft model at temperature > 0): speculative
  rejection sampling (Leviathan et al. 2023; Chen et al. 2023) — accept ``d_i`` with probability
  ``min(1, p(d_i) / q(d_i))``; at the first rejection draw from ``norm(max(p - q, 0))``; after a fully
  accepted draft draw the bonus token from ``p``. The output distribution is the target's;
* a tree: from the pending token down, follow the child equal to the target's own draw at the node
  reached (greedy rows, and deterministic trees: the multi-draft rule for point-mass drafts, which
  gives plain decoding's tokens); a sampled tree (``probs``: the distribution each node was drawn
  from, siblings independent draws) at a sampled row takes the recursive rejection rule over the
  children in order (SpecInfer; Chen et al.): accept child ``c`` with ``min(1, p(c) / q(c))``, else
  ``p <- norm(max(p - q, 0))`` and try the next; with none accepted, draw from what is left of ``p``.

Randomness is counter-based like the sampler's, keyed by (row key, draw index): a request gives the
same tokens alone or batched. The draft draws with the row's own noise (a draft that equals the
target reproduces plain sampling token for token); the acceptance coins and the residual draws use
the row key folded with salts of their own. No noise decides two things: a pass decides at draw
indices up to its first rejection, and the next pass starts after them.

Adaptive length (:class:`DraftControl`): grow the draft after a fully accepted one, shrink it after a
rejection (drafts that cost nothing, lookups, always take the pass's whole width), and fall back to
plain decoding (no draft) while, over the last ``WINDOW`` drafting passes, the passes yielded no more
tokens than plain steps in the same time would, or (drafts that cost) the acceptance rate is below
``FALLBACK_RATE``. A pass's cost is measured by the engine (:class:`LoopTimes`: the speculative loop's
time per pass over the plain decode loop's per step at the same batch width; an adaptive speculator's
first draws at a width are plain, to time that step, and its first loop returns after ``WINDOW``
passes, to time them); until then it is one target step plus, per drafted token or tree level, the
draft's share of the target's weight bytes (:func:`draft_cost`: an early exit after 27 of 30 layers has
to accept about 90 % of its drafts to pay). A row probes again after ``PROBE_AFTER`` plain steps
(one pass; if its tokens pay for it, drafting resumes), twice as many after each fall or
failed probe in a row, up to ``MAX_PROBE_AFTER``; a full window that pays resets the wait. Every row
in fallback probes in the pass of the first one whose wait is over (:func:`probes`). A row with
nothing drafted (in fallback, or prompt lookup found nothing) gets its plain token from the
verification pass. A pass is a plain step (one position a row, not width + 1) when no row drafted
anything (a ``lax.cond`` after the draft, for chains) and, with an adaptive speculator, when the rows'
expected acceptances do not pay for the batch's pass (:func:`pass_pays`; rows in fallback or without a
draft ride every pass; where finished rows are not replaced, the rows with the most tokens left must
pay for it): drafts that cost are then not drafted at all, and the drafting rows that do not pay
their share of the pass fall back. When every row left is in fallback, the loop takes plain
decode steps instead (one position a row, no draft: an inner loop, entered by a ``lax.cond``), until a
row probes: a batch in fallback costs about what plain decoding costs, without leaving the loop (each
return to the host and new loop cost a GPU more than a decode step of a small model). The plain step
draws with the same (row key, position) noise as the plain decode loop, so the tokens are the same
either way. A new request starts where the speculator's last loop on the engine left its rows (the
fewest falls and failed probes in a row among them): a speculator that does not pay on this
workload starts each request in fallback, with the wait those misses give. A decode step whose rows
all stay in fallback through its draws is the plain decode loop itself, not a speculative loop
(whose stretch of plain steps costs a GPU its own arguments and predicates: 1.9 to 2.5 ms, 3 to 5
plain steps, a 128-token SmolLM2 generation at batch 1 on an H100).

Rows under a grammar (:class:`~zgen.runtime.grammar.GrammarDrafts`) draft as if unconstrained; two host
callbacks per pass keep them exact. After drafting, the first gives each row's token mask at every
verified position, computed along its draft; the target's logits are masked there before the draws and
the acceptance test, so the target distribution every rule above samples is the masked one plain
constrained decoding draws from, and a drafted token the grammar refuses is rejected where it stands
(its masked probability is 0). After acceptance, the second advances each grammar by the tokens its
row keeps, and cuts the row at the token that completes its grammar.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jaxtyping import Array, Bool, Float, Int, UInt32

from zgen.cache.base import KVState
from zgen.model import Model
from zgen.runtime.grammar import GrammarDrafts, allowed_tokens
from zgen.runtime.results import SpeculativeStats
from zgen.runtime.sampling import SamplingFlags, SamplingParams, filter_logits, sample
from zgen.runtime.step import DecodeLoop, ModelSpec, Params, decode_loop, draw, forward, forward_features, read_features
from zgen.runtime.tree import ancestors, commit_path, forward_tree, forward_tree_features, tree_attention_mask

__all__ = [
    "DraftControl", "DraftInput", "LoopTimes", "loop_key", "ResumableSpeculator", "draft_cost", "pass_pays", "probes", "FeatureObserver", "observe_missing_features", "Observer", "Proposal", "SpeculativeLoop", "SpeculativeStats", "Speculator", "speculative_loop",
    "target_draws", "verify",
    "TreeSpeculator", "draft_room", "draws_at", "verify_tree",
]

#: Most tokens one pass may draft (a draft longer than this only costs verification work).
MAX_DRAFT_TOKENS = 32
#: Drafting passes the acceptance rate is measured over.
WINDOW = 8
#: Below this acceptance rate (over a full window) a row decodes plainly for a while.
FALLBACK_RATE = 0.4
#: Plain decode steps before a row in fallback drafts again (one token: a probe) ...
PROBE_AFTER = 16
#: ... doubled after each failed probe in a row, up to this many.
MAX_PROBE_AFTER = 256
#: Loop iterations :class:`LoopTimes` averages over (older ones weigh half as much each time).
RECENT_ITERATIONS = 256
#: Plain draws an engine decodes first to time its plain step, before an adaptive speculator's first
#: pass at a batch width.
TIMING_DRAWS = 8

# Salts that give the acceptance coins and the residual draws noise of their own.
SALT_ACCEPT, SALT_RESIDUAL = 0xACCE97, 0x4E51D


@dataclass(frozen=True)
class DraftInput:
    """What a speculator sees inside the loop (trace-time container)."""

    history: Int[Array, "B L"]  # every token of each row so far; the pending one at length - 1
    length: Int[Array, " B"]
    num_tokens: Int[Array, " B"]  # tokens to draft per row (0: none), <= the speculator's num_tokens
    active: Bool[Array, " B"]
    keys: UInt32[Array, "B 2"]  # the rows' sampling keys
    sampling: SamplingParams
    flags: SamplingFlags


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Proposal:
    """Drafted tokens ``[B, k]`` (``count`` valid per row) and, for sampled drafts, the distribution
    each was drawn from (``None``: deterministic drafts, accepted by exact match).

    A *tree* of ``N`` nodes (``N`` static) sets ``parents`` (each node's parent node, ``-1``: the
    pending token; parents come before their children) and ``depth`` (1 for the pending token's
    children); ``count`` nodes are valid (a prefix). A chain leaves both ``None``: it is the tree whose
    parents are ``i - 1``, verified without any tree work."""

    tokens: Int[Array, "B K"]
    count: Int[Array, " B"]
    probs: Float[Array, "B K V"] | None
    parents: Int[Array, "B K"] | None = None
    depth: Int[Array, "B K"] | None = None


@runtime_checkable
class Speculator(Protocol):
    """One protocol for every speculator; the engine runs it inside :func:`speculative_loop`.

    ``start``, ``propose`` and ``advance`` are traced (pure, fixed shapes); the state they thread is
    any pytree (a draft model's KV cache, say). ``cache_key`` names everything the traced functions
    depend on besides their arguments' shapes and the speculator's class (one compiled loop serves
    every speculator of a class with the same key, :func:`loop_key`); ``device_params`` are their
    traced arguments (a draft model's weights).
    """

    @property
    def num_tokens(self) -> int:
        """The most tokens one pass drafts (the loop's static draft width)."""
        ...

    @property
    def adaptive(self) -> bool:
        """Whether the draft length adapts to the acceptance rate (see the module docstring)."""
        ...

    def cache_key(self) -> Hashable: ...

    def check_target(self, model: Model) -> None:
        """Raise a typed error if this speculator cannot draft for ``model`` (another vocabulary)."""
        ...

    def device_params(self) -> Any:
        """The arrays ``start`` and ``propose`` get as ``params`` (a draft's weights; ``()`` for none),
        fixed for the speculator's life: a model's runner reads them once (and copies them to its
        device if they sit on another)."""
        ...

    def start(self, params: Any, history: Int[Array, "B L"], length: Int[Array, " B"]) -> Any:
        """The state before the first pass (rows hold ``history[:length]``, the last token pending)."""
        ...

    def propose(self, params: Any, state: Any, draft: DraftInput) -> tuple[Proposal, Any]: ...

    def advance(self, state: Any, kept: Int[Array, " B"]) -> Any:
        """After a pass: each row's first ``kept`` positions are final (the next pending token is at ``kept``)."""
        ...


@runtime_checkable
class ResumableSpeculator(Speculator, Protocol):
    """A speculator whose state stays valid after its loop returns: the next loop over the same
    sequences goes on from it (a draft model's cache, whose rows catch up on the tokens decoded since)
    instead of ``start``-ing over, which prefills a draft model's cache over the whole context."""

    def resume(self, state: Any, history: Int[Array, "B L"], length: Int[Array, " B"]) -> Any:
        """``state`` as the last loop left it, for rows that now hold ``history[:length]`` (the same
        tokens as then up to the shorter of the two lengths, then those decoded since)."""
        ...


@runtime_checkable
class TreeSpeculator(Speculator, Protocol):
    """A speculator that may propose trees (:class:`Proposal` with ``parents``): ``num_tokens`` is then
    their greatest depth, and ``tree_size`` (``None``: it drafts chains) their static node count."""

    @property
    def tree_size(self) -> int | None: ...


def loop_key(speculator: Speculator) -> Hashable:
    """What the compiled loops and loop timings of ``speculator`` are kept under: its class and its
    ``cache_key`` (a subclass that drafts otherwise gets loops of its own, whatever its key says)."""
    return (type(speculator), speculator.cache_key())


def draft_room(speculator: Speculator) -> int:
    """Positions past a row's pending token one pass may write: a chain's length, a tree's nodes."""
    size = speculator.tree_size if isinstance(speculator, TreeSpeculator) else None
    return speculator.num_tokens if size is None else max(size, speculator.num_tokens)


@runtime_checkable
class Observer(Protocol):
    """A speculator that also learns from each verification pass (Jacobi decoding: the target's
    draws after a rejected draft are the next pass's guesses). Optional: the loop calls ``observe``
    only on speculators that have it."""

    def observe(self, state: Any, draft: DraftInput, proposal: Proposal, count: Int[Array, " B"], draws: Int[Array, "B T"]) -> Any:
        """After a pass that checked ``count`` drafts per row: ``draws[:, j]`` is the target's own token
        at position ``length + j`` given the pending token and drafts ``1 .. j`` (valid for ``j <= count``)."""
        ...


@runtime_checkable
class FeatureObserver(Protocol):
    """A speculator that drafts from the target's features (EAGLE): every forward pass of the loop
    also returns the residual stream after ``feature_layers`` and hands it over. Optional, like
    :class:`Observer`."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The decoder layers whose outputs it reads (concatenated, in this order)."""
        ...

    @property
    def feature_window(self) -> int:
        """How many tokens before each row's pending one it drafts from."""
        ...

    def observed(self, state: Any) -> Int[Array, " B"]:
        """Each row's first position whose features it lacks (it holds those its window needs below)."""
        ...

    def observe_features(self, state: Any, features: Float[Array, "B T F"], positions: Int[Array, "B T"]) -> Any:
        """After a forward pass: ``features[:, j]`` belong to the token at ``positions[:, j]`` (-1: none)."""
        ...


#: The fewest positions a read of missing features covers; reads double from it up to the window.
FEATURE_CHUNK = 32


def observe_missing_features(
    model: ModelSpec,
    params: Params,
    kv: KVState,
    speculator: FeatureObserver,
    state: Any,
    history: Int[Array, "B L"],
    length: Int[Array, " B"],
    active: Bool[Array, " B"],
) -> Any:
    """``state`` given the target's features of each active row's tokens that it lacks before the
    pending one (``length - 1``), within its window: one forward pass over the last
    :data:`FEATURE_CHUNK` times a power of two tokens (or the window), the fewest that hold them, so
    a short prompt or stretch of plain steps costs a CPU what its tokens do; the tokens' K/V are in
    ``kv``, which is read, not written."""
    p = length - 1
    window = speculator.feature_window
    first = jnp.maximum(speculator.observed(state), p - window)
    missing = jnp.max(jnp.where(active, p - first, 0))
    sizes, size = [], min(FEATURE_CHUNK, window)
    while size < window:
        sizes.append(size)
        size *= 2
    sizes.append(window)

    def read(size: int) -> Callable[[Any], Any]:
        def observe(state: Any) -> Any:
            at = p[:, None] - size + jnp.arange(size)[None, :]
            positions = jnp.where(active[:, None] & (at >= 0), at, -1)
            tokens = jnp.take_along_axis(history, jnp.maximum(at, 0), axis=1)
            features = read_features(model, params, kv, tokens, positions, speculator.feature_layers)
            return speculator.observe_features(state, features, positions)

        return observe

    branch = jnp.where(missing <= 0, 0, 1 + jnp.searchsorted(jnp.asarray(sizes), missing))
    return jax.lax.switch(branch, [lambda state: state, *(read(size) for size in sizes)], state)


# ---------------------------------------------------------------------------------------------------
# The adaptive draft length
# ---------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftControl:
    """Per-row draft length and acceptance window (kept per request between loop calls)."""

    length: Int[Array, " B"]  # tokens to draft next pass; 0 = plain decoding (fallback)
    drafted: Int[Array, "B W"]  # the last WINDOW drafting passes: tokens drafted ...
    accepted: Int[Array, "B W"]  # ... and accepted
    slot: Int[Array, " B"]  # where the next pass is recorded
    wait: Int[Array, " B"]  # plain steps left before probing again
    misses: Int[Array, " B"]  # falls and failed probes in a row (each doubles the wait)

    @staticmethod
    def initial(rows: int, num_tokens: int, misses: int = 0) -> dict[str, np.ndarray]:
        """Host arrays of a fresh control for ``rows`` rows (numpy, one entry per field). ``misses``:
        falls and failed probes in a row to start from (a request that starts where the speculator's
        last ones on the engine left off): in fallback, probing after the wait they give."""
        return {
            "length": np.full(rows, 0 if misses else num_tokens, np.int32),
            "drafted": np.zeros((rows, WINDOW), np.int32),
            "accepted": np.zeros((rows, WINDOW), np.int32),
            "slot": np.zeros(rows, np.int32),
            "wait": np.full(rows, probe_wait(np.int32(misses), np) if misses else 0, np.int32),
            "misses": np.full(rows, misses, np.int32),
        }


def probe_wait(misses: Any, xp: Any = jnp) -> Any:
    """The plain steps a row in fallback waits before it probes, after ``misses`` falls and failed
    probes in a row (``xp``: ``jnp`` traced, ``np`` on the host)."""
    return xp.minimum(PROBE_AFTER * 2 ** xp.clip(misses - 1, 0, 16), MAX_PROBE_AFTER)


class LoopTimes:
    """Seconds per iteration of an engine's plain decode loops and speculative loops, by batch width
    and speculator (compile time taken out; recent calls weigh most): what a pass costs in plain decode
    steps on this device, which no static model gives: a prompt-lookup pass of SmolLM2 (9 positions)
    took 2.5 plain steps on a 2-core CPU (XLA:CPU multiplies 2 to 16 rows at half its one-row rate),
    and prompt lookup's 1.01x at 0.52 accepted tokens a pass on an H200 puts it near 1.5 there.

    A loop call also costs a fixed time (dispatch, transfers, the host's wait), which a plain loop
    timed over 8 draws would count as an eighth of each step: the engine times a call that runs no
    iteration at each width (:meth:`record_call`), and :meth:`record_plain` and :meth:`record_loop`
    take it out. A call that compiled its loop ran it cold (kernels loaded, library plans made on first
    use): on an H200 the first passes of SmolLM2's prompt lookup took 16 ms each against 0.66 ms for a
    plain step, which held every row in fallback for good. So a cold speculative loop is not recorded,
    and a cold plain loop only until a warm one replaces it (:meth:`warm`). A branch of a compiled loop
    also runs cold the first time it is taken: on a 2-core CPU, SmolLM2's EAGLE loop that first went
    from passes to a stretch of plain steps took 0.5 s more than its 45 steps and one pass (a pass is
    3.3 plain steps there), which made the pass cost 16 steps. So a speculative loop is recorded only
    once an earlier loop at its key ran each kind of iteration it ran (passes, plain steps)."""

    def __init__(self) -> None:
        self._totals: dict[Hashable, tuple[float, int]] = {}
        self._calls: dict[int, float] = {}
        self._cold: set[Hashable] = set()  # keys whose only record is a cold loop's
        self._ran: dict[Hashable, set[str]] = {}  # the kinds of iteration each speculative loop has run

    def record_call(self, width: int, seconds: float) -> None:
        """A loop call at ``width`` rows that ran no iteration took ``seconds`` (the least seen is kept)."""
        self._calls[width] = min(seconds, self._calls.get(width, seconds))

    def call_seconds(self, width: int) -> float | None:
        """The fixed time of a loop call at ``width`` rows (``None``: not timed yet)."""
        return self._calls.get(width)

    def record_plain(self, width: int, seconds: float, iterations: int, *, warm: bool = True) -> None:
        """A plain decode loop of ``iterations`` steps at ``width`` rows took ``seconds`` (``warm``: its
        call compiled nothing; a cold loop's time stands only until a warm one's replaces it)."""
        key = ("plain", width)
        if iterations <= 0 or (not warm and key in self._totals):
            return
        if key in self._cold:
            del self._totals[key]
            self._cold.discard(key)
        if not warm:
            self._cold.add(key)
        self.record(key, max(seconds - self._calls.get(width, 0.0), 0.0), iterations)

    def warm(self, key: Hashable) -> bool:
        """Whether ``key``'s time comes from loops that ran warm."""
        return key in self._totals and key not in self._cold

    def record(self, key: Hashable, seconds: float, iterations: int) -> None:
        if iterations <= 0:
            return
        total, count = self._totals.get(key, (0.0, 0))
        if count >= RECENT_ITERATIONS:
            total, count = total / 2, count // 2
        self._totals[key] = (total + seconds, count + iterations)

    def per_iteration(self, key: Hashable) -> float | None:
        total, count = self._totals.get(key, (0.0, 0))
        return total / count if count else None

    def record_loop(
        self, width: int, speculator: Speculator, seconds: float, iterations: int, plain_steps: int, *, warm: bool = True
    ) -> None:
        """A speculative loop of ``iterations`` at ``width`` rows, ``plain_steps`` of them plain decode
        steps (every row in fallback), each taken at the plain decode loop's time: the rest is its passes'
        (not recorded while the plain step is not timed, nor from a cold loop: not ``warm``, or the
        first to run passes or plain steps at its key)."""
        key = ("speculative", width, loop_key(speculator))
        kinds = {kind for kind, count in (("passes", iterations - plain_steps), ("plain steps", plain_steps)) if count > 0}
        ran = self._ran.setdefault(key, set())
        first = not kinds <= ran
        ran |= kinds
        if not warm or first:
            return
        seconds -= self._calls.get(width, 0.0)
        if plain_steps:
            plain = self.per_iteration(("plain", width))
            if plain is None:
                return
            seconds -= plain * plain_steps
        self.record(key, max(seconds, 0.0), iterations - plain_steps)

    def pass_cost(self, width: int, speculator: Speculator) -> float:
        """A pass of ``speculator``'s loop at ``width`` rows in plain decode steps at that width (at
        least 1: a pass does a plain step's work); 0.0 until both have been timed."""
        plain = self.per_iteration(("plain", width))
        spec = self.per_iteration(("speculative", width, loop_key(speculator)))
        return 0.0 if plain is None or spec is None else max(spec / plain, 1.0)


def draft_cost(draft_params: Any, params: Params) -> float:
    """What one drafted token (or tree level) costs in target decode steps: the bytes of weights a
    draft step reads over the target's (decode is bound by them); 0 for drafts without weights."""

    def size(tree: Any) -> int:
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))

    return size(draft_params) / max(size(params), 1)


def update_control(
    control: DraftControl,
    drafted: Int[Array, " B"],
    accepted: Int[Array, " B"],
    active: Bool[Array, " B"],
    max_tokens: int,
    cost: float = 0.0,
    pass_cost: Float[Array, ""] | float = 0.0,
    falls: Bool[Array, " B"] | None = None,
) -> DraftControl:
    """Grow after a fully accepted draft, shrink after a rejection; fall back to plain decoding when a
    full window's passes yielded no more tokens (accepted + one each) than they cost, or (drafts that
    cost, ``cost > 0``) its acceptance rate is below :data:`FALLBACK_RATE`. A pass costs ``pass_cost``
    plain decode steps where the engine measured it (:class:`LoopTimes`), else one step + ``cost`` per
    drafted token. After the wait the row drafts again, with every other row in fallback (a probe,
    ``wait == -1``, see :func:`probes`): if its tokens pay for
    its pass, drafting resumes on a fresh window, else the row falls back again at once. Each
    fall or failed probe in a row doubles the wait (from :data:`PROBE_AFTER` up to
    :data:`MAX_PROBE_AFTER`); a full window that pays starts it over. ``falls``: rows that fall back
    regardless (drafting rows of a pass not taken, see :func:`pass_pays`)."""
    drafting = active & (drafted > 0)
    probing = drafting & (control.wait < 0)
    measured = pass_cost > 0
    full = accepted >= drafted
    probe_pays = 1 + accepted > jnp.where(measured, pass_cost, 1 + cost * drafted)
    length = jnp.where(drafting, jnp.clip(jnp.where(full, control.length + 1, control.length - 1), 1, max_tokens), control.length)
    rows = jnp.arange(drafted.shape[0])
    write = jnp.where(drafting & ~probing, control.slot, WINDOW)  # WINDOW: dropped
    window_d = control.drafted.at[rows, write].set(drafted, mode="drop")
    window_a = control.accepted.at[rows, write].set(accepted, mode="drop")
    slot = jnp.where(drafting & ~probing, (control.slot + 1) % WINDOW, control.slot)
    passes = jnp.sum(window_d > 0, axis=1)
    window_drafted, window_accepted = jnp.sum(window_d, axis=1), jnp.sum(window_a, axis=1)
    rate = window_accepted / jnp.maximum(window_drafted, 1)
    # A measured cost is judged on half a window: the passes' cost is known, only their yield is not.
    judged = drafting & ~probing & (passes >= jnp.where(measured, WINDOW // 2, WINDOW))
    missed = probing & ~probe_pays
    # The window's passes yielded passes + accepted tokens; plain decoding gives one a step.
    spent = jnp.where(measured, pass_cost * passes, passes + cost * window_drafted)
    pays = passes + window_accepted > spent
    fall = (judged & (~pays | (rate < (FALLBACK_RATE if cost > 0 else 0.0)))) | missed
    if falls is not None:
        fall |= falls
    resume = probing & probe_pays
    plain = active & ~drafting & (control.length == 0)
    misses = jnp.where(fall, control.misses + 1, jnp.where(judged, 0, control.misses))
    wait = jnp.where(fall, probe_wait(misses), jnp.where(plain, control.wait - 1, jnp.where(resume, 0, control.wait)))
    probe = probes(plain, wait)
    clear = (fall | resume)[:, None]
    return DraftControl(
        length=jnp.where(fall, 0, jnp.where(probe, 1, length)),
        drafted=jnp.where(clear, 0, window_d),
        accepted=jnp.where(clear, 0, window_a),
        slot=jnp.where(fall | resume, 0, slot),
        wait=jnp.where(probe, -1, wait),
        misses=misses,
    )


def probes(resting: Bool[Array, " B"], wait: Int[Array, " B"]) -> Bool[Array, " B"]:
    """The rows in fallback (``resting``) that probe now: all of them, once one's wait is over. A probe
    costs the whole batch its pass's extra work, so rows that probe together pay for one pass between
    them, and a batch in fallback probes about as often as one row does."""
    return resting & jnp.any(resting & (wait <= 0))


def pass_pays(
    control: DraftControl,
    count: Int[Array, " B"],
    active: Bool[Array, " B"],
    pass_cost: Float[Array, ""] | float,
    last: Bool[Array, " B"] | None = None,
) -> tuple[Bool[Array, ""], Bool[Array, " B"]]:
    """Whether a pass over the batch yields more tokens than plain steps would in its time: a token a
    row, plus what each drafting row is expected to accept (its window's mean a pass, at most its
    draft; a row with fewer than two passes in its window, its whole draft), against ``pass_cost``
    plain steps of the batch (not measured yet: it pays). Rows in fallback and rows that drafted
    nothing ride every pass, so a batch can lose where each drafting row alone would pay.

    ``last``: where no row that finishes is replaced, the loop lasts as long as its last row, so the
    tokens of a row that will finish first gain nothing: the pass must then pay for the rows with the
    most tokens left (``last``), the least of their expected acceptances against ``pass_cost - 1``
    (on an H200 at batch 8, passes that paid by the sum over rows left the loop 5 iterations shorter
    for 35 passes of about 1.7 plain steps each).

    Also returns the drafting rows that fall back where the pass does not pay, to probe again later
    on a fresh window, since a pass not taken updates no window (they would be held back for good):
    those expected to accept less than their own share of the pass's extra cost, or every drafting
    row where the rows in ``last`` decide."""
    passes = jnp.sum(control.drafted > 0, axis=1)
    mean = jnp.sum(control.accepted, axis=1) / jnp.maximum(passes, 1)
    expected = jnp.where(passes >= 2, jnp.minimum(mean, count), count)
    drafting = active & (count > 0)
    measured = jnp.asarray(pass_cost) > 0
    if last is not None:
        least = jnp.min(jnp.where(last, jnp.where(drafting, expected, 0.0), jnp.inf))
        return ~measured | (1 + least > pass_cost), drafting & measured
    rows = jnp.sum(active)
    gain = jnp.sum(jnp.where(drafting, expected, 0.0))
    return ~measured | (rows + gain > pass_cost * rows), drafting & measured & (expected <= pass_cost - 1)


# ---------------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------------


def salted_keys(keys: UInt32[Array, "B 2"], salt: int) -> UInt32[Array, "B 2"]:
    """Raw threefry key data of ``fold_in(key, salt)`` per row: a stream of noise of its own."""
    typed = jax.random.wrap_key_data(keys, impl="threefry2x32")
    return jax.random.key_data(jax.vmap(jax.random.fold_in, (0, None))(typed, salt))


def _noise(keys: UInt32[Array, "B 2"], index: Int[Array, "B N"], draw: Any) -> Array:
    """``draw(fold_in(key_b, index[b, n]))`` for every row and index."""
    typed = jax.random.wrap_key_data(keys, impl="threefry2x32")
    per_index = jax.vmap(lambda key, i: draw(jax.random.fold_in(key, i)), (None, 0))
    return jax.vmap(per_index)(typed, index.astype(jnp.uint32))


def target_draws(
    logits: Float[Array, "B T V"], position: Int[Array, " B"], sampling: SamplingParams, keys: UInt32[Array, "B 2"], flags: SamplingFlags
) -> Int[Array, "B T"]:
    """The target's own token at each of positions ``position + 1 .. position + T`` (logits read at
    ``position .. position + T - 1``): the runtime's sampler with the row's key and draw index."""
    return draws_at(logits, position[:, None] + jnp.arange(logits.shape[1])[None, :], sampling, keys, flags)


def draws_at(
    logits: Float[Array, "B T V"], draw_index: Int[Array, "B T"], sampling: SamplingParams, keys: UInt32[Array, "B 2"], flags: SamplingFlags
) -> Int[Array, "B T"]:
    """The runtime's sampler at every read, each with the row's key and its draw index (the position
    of the token whose logits it reads)."""
    b, t, v = logits.shape
    rep_sampling = jax.tree_util.tree_map(lambda x: jnp.repeat(x, t, axis=0), sampling)
    return sample(logits.reshape(b * t, v), rep_sampling, None, jnp.repeat(keys, t, axis=0), draw_index.reshape(-1), flags).reshape(b, t)


def verify(
    logits: Float[Array, "B T V"],
    proposal: Proposal,
    count: Int[Array, " B"],
    position: Int[Array, " B"],
    sampling: SamplingParams,
    keys: UInt32[Array, "B 2"],
    flags: SamplingFlags,
    allowed: Bool[Array, "B T V"] | None = None,
) -> tuple[Int[Array, "B T"], Float[Array, "B T"], Int[Array, " B"]]:
    """Accept a prefix of each row's draft against the target's logits at ``position .. position+k``.

    ``count``: drafted tokens per row to check (<= k). ``allowed``: the tokens a grammar allows at each
    position (the target distribution is the masked one). Returns the tokens the pass produces (the
    accepted drafts, then the target's correction or bonus token; ``accepted + 1`` valid per row),
    their log-probabilities under the raw target logits, and how many drafts each row accepted.
    """
    b, t, v = logits.shape
    k = t - 1
    drafts = proposal.tokens
    masked = logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)
    flat = masked.reshape(b * t, v)
    repeat = lambda x: jnp.repeat(x, t, axis=0)  # noqa: E731 - one row per read
    rep_sampling = jax.tree_util.tree_map(repeat, sampling)
    draw_index = position[:, None] + jnp.arange(t)[None, :]
    own = target_draws(masked, position, sampling, keys, flags)
    ok = drafts == own[:, :k]
    sampled_draft = proposal.probs is not None and not flags.all_greedy
    target_probs = None
    if sampled_draft:
        assert proposal.probs is not None
        target_probs = jax.nn.softmax(filter_logits(flat, rep_sampling, None, flags), axis=-1).reshape(b, t, v)
        p_draft = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
        q_draft = jnp.take_along_axis(proposal.probs, drafts[..., None], axis=-1)[..., 0]
        coins = _noise(salted_keys(keys, SALT_ACCEPT), draw_index[:, :k], jax.random.uniform)
        greedy_row = (sampling.temperature <= 0)[:, None]
        ok = jnp.where(greedy_row, ok, coins * q_draft < p_draft)
    ok &= jnp.arange(k)[None, :] < count[:, None]
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    last = jnp.take_along_axis(own, accepted[:, None], axis=1)[:, 0]
    if sampled_draft:
        assert proposal.probs is not None and target_probs is not None
        at = jnp.clip(accepted, 0, k - 1)[:, None, None]
        residual = jnp.maximum(
            jnp.take_along_axis(target_probs, at, axis=1)[:, 0] - jnp.take_along_axis(proposal.probs, at, axis=1)[:, 0], 0.0
        )
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        residual = jnp.where(mass > 0, residual, jnp.take_along_axis(target_probs, at, axis=1)[:, 0])
        gumbel = _noise(salted_keys(keys, SALT_RESIDUAL), (position + accepted)[:, None], lambda key: jax.random.gumbel(key, (v,)))
        corrected = jnp.argmax(jnp.log(residual) + gumbel[:, 0], axis=-1).astype(jnp.int32)
        rejected = (accepted < count) & (sampling.temperature > 0)
        last = jnp.where(rejected, corrected, last)
    j = jnp.arange(t)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(j < accepted[:, None], padded, jnp.where(j == accepted[:, None], last[:, None], 0)).astype(jnp.int32)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), tokens[..., None], axis=-1)[..., 0]
    return tokens, logprobs, accepted


def verify_tree(
    logits: Float[Array, "B M V"],
    proposal: Proposal,
    valid: Bool[Array, "B N"],
    position: Int[Array, " B"],
    max_depth: int,
    sampling: SamplingParams,
    keys: UInt32[Array, "B 2"],
    flags: SamplingFlags,
) -> tuple[Int[Array, "B T"], Float[Array, "B T"], Int[Array, " B"], Int[Array, "B D"]]:
    """Accept a path down each row's tree (``proposal.parents``) against the target's logits at its
    ``M = N + 1`` entries (entry 0: the pending token at ``position``; entry ``i + 1``: node ``i``, read
    at ``position + depth``). ``valid``: the nodes to consider (closed under ancestors).

    From the root, at each entry: a greedy row, or any row of a deterministic tree (``probs is None``),
    follows the child equal to the target's own draw there (the multi-draft rule for point-mass drafts:
    the output is plain decoding's, token for token); a sampled row of a sampled tree tries the children
    in order, accepting child ``c`` with probability ``min(1, p(c) / q_c(c))`` and otherwise going on
    with ``p <- norm(max(p - q_c, 0))`` (recursive rejection sampling: exact when siblings are
    independent draws of ``q``); when none is accepted it draws from what is left of ``p``.

    Returns the tokens the pass produces (``T = max_depth + 1``: the accepted path, then the target's
    correction or bonus token; ``accepted + 1`` valid per row), their log-probabilities under the raw
    target logits, how many nodes each row accepted, and the entries of the accepted path (the first
    ``accepted`` of ``D = max_depth`` valid).
    """
    assert proposal.parents is not None and proposal.depth is not None, "verify_tree takes a tree proposal"
    b, m, v = logits.shape
    tokens = proposal.tokens
    parent = proposal.parents + 1  # the entry of each node's parent
    draw_index = position[:, None] + jnp.concatenate([jnp.zeros((b, 1), jnp.int32), proposal.depth], axis=1)
    own = draws_at(logits, draw_index, sampling, keys, flags)
    rows = jnp.arange(b)
    cur = jnp.zeros(b, jnp.int32)  # the entry the path has reached
    alive = jnp.ones(b, bool)
    accepted = jnp.zeros(b, jnp.int32)
    path = []
    residual, tried = jnp.zeros((b, v), jnp.float32), jnp.zeros(b, bool)  # what is left of p where a row stopped
    draft_probs = None if flags.all_greedy else proposal.probs
    sampled_row = sampling.temperature > 0
    try_children: Callable[[Array, Array], tuple[Array, Array, Array]] | None = None
    if draft_probs is not None:
        repeat = lambda x: jnp.repeat(x, m, axis=0)  # noqa: E731 - one row per read
        flat = filter_logits(logits.reshape(b * m, v), jax.tree_util.tree_map(repeat, sampling), None, flags)
        target_probs = jax.nn.softmax(flat, axis=-1).reshape(b, m, v)
        coins = _node_noise(salted_keys(keys, SALT_ACCEPT), draw_index[:, 1:] - 1, jax.random.uniform)  # read at the parent

        def rejection(children: Array, cur: Array) -> tuple[Array, Array, Array]:
            return _try_children(children, target_probs[rows, cur], tokens, draft_probs, coins)

        try_children = rejection
    for _ in range(max_depth):
        children = valid & (parent == cur[:, None]) & alive[:, None]
        match = children & (tokens == own[rows, cur][:, None])
        found, child = jnp.any(match, axis=1), jnp.argmax(match, axis=1).astype(jnp.int32)
        if try_children is not None:
            left, decided, chosen = try_children(children, cur)
            found, child = jnp.where(sampled_row, decided, found), jnp.where(sampled_row, chosen, child)
            stops = alive & ~found
            residual = jnp.where(stops[:, None], left, residual)
            tried = jnp.where(stops & sampled_row, jnp.any(children, axis=1), tried)
        path.append(jnp.where(found, child + 1, 0))
        cur = jnp.where(found, child + 1, cur)
        accepted += found.astype(jnp.int32)
        alive &= found
    last = own[rows, cur]
    if draft_probs is not None:
        gumbel = _noise(salted_keys(keys, SALT_RESIDUAL), (position + accepted)[:, None], lambda key: jax.random.gumbel(key, (v,)))
        corrected = jnp.argmax(jnp.log(residual) + gumbel[:, 0], axis=-1).astype(jnp.int32)
        last = jnp.where(tried, corrected, last)
    entries = jnp.stack(path, axis=1) if path else jnp.zeros((b, 0), jnp.int32)
    j = jnp.arange(max_depth + 1)[None, :]
    path_tokens = jnp.take_along_axis(tokens, jnp.maximum(entries - 1, 0), axis=1)
    padded = jnp.concatenate([path_tokens, jnp.zeros((b, 1), tokens.dtype)], axis=1)
    produced = jnp.where(j < accepted[:, None], padded, jnp.where(j == accepted[:, None], last[:, None], 0)).astype(jnp.int32)
    read = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), entries], axis=1)  # token j is read at the j-th entry of the path
    log_probs = jax.nn.log_softmax(jnp.take_along_axis(logits, read[..., None], axis=1).astype(jnp.float32), axis=-1)
    logprobs = jnp.take_along_axis(log_probs, produced[..., None], axis=-1)[..., 0]
    return produced, logprobs, accepted, entries


def _try_children(
    children: Bool[Array, "B N"], target: Float[Array, "B V"], tokens: Int[Array, "B N"], probs: Float[Array, "B N V"], coins: Float[Array, "B N"]
) -> tuple[Float[Array, "B V"], Bool[Array, " B"], Int[Array, " B"]]:
    """Recursive rejection sampling over each row's ``children`` in order: accept node ``i`` with
    probability ``min(1, p(t_i) / q_i(t_i))``, else ``p <- norm(max(p - q_i, 0))``. Returns what is left
    of ``p``, whether a child was accepted, and which."""
    rows = jnp.arange(tokens.shape[0])
    q_token = jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]

    def step(carry: tuple[Array, Array, Array], node: tuple[Array, ...]) -> tuple[tuple[Array, Array, Array], None]:
        left, decided, chosen = carry
        trying, token, q, q_tok, coin, i = node
        trying &= ~decided
        take = trying & (coin * q_tok < left[rows, token])
        rest = jnp.maximum(left - q, 0.0)
        mass = jnp.sum(rest, axis=-1, keepdims=True)
        rest = jnp.where(mass > 0, rest / jnp.where(mass > 0, mass, 1.0), left)  # p == q: nothing left to correct
        left = jnp.where((trying & ~take)[:, None], rest, left)
        return (left, decided | take, jnp.where(take, i, chosen)), None

    by_node = (children.T, tokens.T, jnp.moveaxis(probs, 1, 0), q_token.T, coins.T, jnp.arange(tokens.shape[1], dtype=jnp.int32))
    start = (target, jnp.zeros(rows.shape, bool), jnp.zeros(rows.shape, jnp.int32))
    (left, decided, chosen), _ = jax.lax.scan(step, start, by_node)
    return left, decided, chosen


def _node_noise(keys: UInt32[Array, "B 2"], index: Int[Array, "B N"], draw: Any) -> Array:
    """``draw(fold_in(fold_in(key_b, index[b, n]), n))``: noise of its own for every node, siblings
    (which share an index) included."""
    typed = jax.random.wrap_key_data(keys, impl="threefry2x32")
    nodes = jnp.arange(index.shape[1], dtype=jnp.uint32)
    per_node = jax.vmap(lambda key, i, node: draw(jax.random.fold_in(jax.random.fold_in(key, i), node)), (None, 0, 0))
    return jax.vmap(per_node, (0, 0, None))(typed, index.astype(jnp.uint32), nodes)


# ---------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpeculativeLoop:
    """The carry of :func:`speculative_loop` besides the KV and the speculator's state."""

    history: Int[Array, "B L"]  # each row's tokens (the pending one at length - 1)
    length: Int[Array, " B"]
    limit: Int[Array, " B"]  # positions below it may be written (the room the row reserved)
    budget: Int[Array, " B"]  # tokens the row may still produce in this loop
    emitted: Int[Array, " B"]
    done: Bool[Array, " B"]  # rows outside the loop start done
    stop_ids: Int[Array, "B K"]  # a produced id among these ends the row (-1 = unused)
    keys: UInt32[Array, "B 2"]
    out_tokens: Int[Array, "B N"]  # the tokens produced, in order (emitted valid per row)
    out_logprobs: Float[Array, "B N"]
    drafted: Int[Array, " B"]
    accepted: Int[Array, " B"]
    verified: Int[Array, " B"]  # passes that checked a draft
    control: DraftControl
    pass_cost: Float[Array, ""]  # a pass in plain decode steps, as measured (0: not yet, see LoopTimes)
    step: Int[Array, ""]
    plain_steps: Int[Array, ""]  # iterations that were plain decode steps (every row in fallback)
    max_steps: Int[Array, ""]
    max_passes: Int[Array, ""]  # iterations that verify drafts (not plain steps) the loop may take
    exit_on_finish: Bool[Array, ""]
    done_at_start: Int[Array, ""]


def speculative_loop(
    model: ModelSpec,
    params: Params,
    kv: KVState,
    loop: SpeculativeLoop,
    sampling: SamplingParams,
    speculator: Speculator,
    draft_params: Any,
    *,
    flags: SamplingFlags,
    grammar: GrammarDrafts | None = None,
    carried: Any = None,
    fresh: Bool[Array, ""] | None = None,
) -> tuple[SpeculativeLoop, KVState, Any]:
    """Draft, verify, accept ... on the device until every row is done (see the module docstring);
    ``grammar``: the host side of the constrained rows. A :class:`ResumableSpeculator` takes the state
    its last loop over the same rows returned (``carried``, unless ``fresh``: then a state of the same
    shapes that ``start`` replaces) and returns its final state; other speculators return ``None``."""
    k = speculator.num_tokens
    cost = draft_cost(draft_params, params)

    def target_forward(kv: KVState, state: Any, tokens: Array, positions: Array, reads: Array) -> tuple[Array, KVState, Any]:
        """The target's logits at ``reads`` (a feature observer also gets the features of every position)."""
        if not isinstance(speculator, FeatureObserver):
            logits, kv = forward(model, params, kv, tokens, positions, reads)
            return logits, kv, state
        logits, features, kv = forward_features(model, params, kv, tokens, positions, reads, speculator.feature_layers)
        return logits, kv, speculator.observe_features(state, features, positions)

    def cond(carry: tuple[SpeculativeLoop, KVState, Any]) -> Array:
        s = carry[0]
        done = jnp.sum(s.done, dtype=jnp.int32)
        passes = s.step - s.plain_steps
        return (s.step < s.max_steps) & (passes < s.max_passes) & (done < s.done.shape[0]) & ~(s.exit_on_finish & (done > s.done_at_start))

    def resting(s: SpeculativeLoop) -> Array:
        return jnp.all(s.done | (s.control.length == 0))

    def body(carry: tuple[SpeculativeLoop, KVState, Any]) -> tuple[SpeculativeLoop, KVState, Any]:
        if not speculator.adaptive or cost > 0:  # drafts that cost choose their branch in the pass (one a pass)
            return iteration(carry, k)
        return jax.lax.cond(resting(carry[0]), rest, lambda c: iteration(c, k), carry)

    def rest(carry: tuple[SpeculativeLoop, KVState, Any]) -> tuple[SpeculativeLoop, KVState, Any]:
        """Every row left in fallback: plain decode steps, one position a row, until a row probes (one
        branch taken per stretch of them, not per step). Speculators that see each step's draws
        (observers) and grammar rows take them one at a time; the others' stretch is the plain decode
        loop (a feature observer's features of it are read when it drafts again)."""
        if grammar is None and not isinstance(speculator, Observer):
            return plain_stretch(carry)
        step = (lambda c: iteration(c, 0)) if grammar is not None else plain_step
        return jax.lax.while_loop(lambda c: cond(c) & resting(c[0]), step, carry)

    def plain_stretch(carry: tuple[SpeculativeLoop, KVState, Any]) -> tuple[SpeculativeLoop, KVState, Any]:
        """The fallback stretch as :func:`~zgen.runtime.step.decode_loop` runs it, up to the first row's
        probe: the same draws as :func:`plain_step`'s (same keys and positions), with the loop's
        bookkeeping (history, outputs, countdowns) done once for the stretch instead of every step:
        its steps are the plain loop's (on an H200, SmolLM2 in fallback, what is left of the loss
        against plain decoding is per loop call, see BENCHMARKS.md)."""
        s, kv, state = carry
        active = ~s.done
        p = s.length - 1
        rows = jnp.arange(p.shape[0])
        cap = s.out_tokens.shape[1]
        stretch = jnp.min(jnp.where(active, s.control.wait, cap))
        stretch = jnp.clip(jnp.minimum(stretch, s.max_steps - s.step), 1, cap)
        plain = DecodeLoop(
            token=s.history[rows, p], position=jnp.where(active, p, -1), done=s.done,
            last_step=s.budget - s.emitted - 1, stop_ids=s.stop_ids, keys=s.keys, penalties=None,
            out_tokens=jnp.full_like(s.out_tokens, -1), out_logprobs=jnp.zeros_like(s.out_logprobs),
            step=jnp.zeros((), jnp.int32), max_steps=stretch, exit_on_finish=s.exit_on_finish, done_at_start=s.done_at_start,
        )
        plain, kv = decode_loop(model, params, kv, plain, sampling, flags=flags)
        drawn = jnp.sum(plain.out_tokens >= 0, axis=1)  # each active row's draws, a prefix of its columns
        columns = jnp.arange(cap)[None, :]
        taken = columns < drawn[:, None]

        def placed(buffer: Array, start: Array, values: Array) -> Array:
            """``buffer`` with each row's draws written from column ``start`` on (the rest dropped)."""
            at = jnp.where(taken, start[:, None] + columns, buffer.shape[1])
            return buffer.at[rows[:, None], at].set(values, mode="drop")

        wait = jnp.where(active, s.control.wait - plain.step, s.control.wait)
        probe = probes(active & ~plain.done, wait)
        control = replace(s.control, length=jnp.where(probe, 1, s.control.length), wait=jnp.where(probe, -1, wait))
        s = replace(
            s,
            history=placed(s.history, s.length, plain.out_tokens),
            length=s.length + drawn,
            emitted=s.emitted + drawn,
            done=plain.done,
            out_tokens=placed(s.out_tokens, s.emitted, plain.out_tokens),
            out_logprobs=placed(s.out_logprobs, s.emitted, plain.out_logprobs),
            control=control,
            step=s.step + plain.step,
            plain_steps=s.plain_steps + plain.step,
        )
        return s, kv, speculator.advance(state, s.length - 1)

    def plain_step(carry: tuple[SpeculativeLoop, KVState, Any]) -> tuple[SpeculativeLoop, KVState, Any]:
        """What ``iteration(carry, 0)`` does when every row is in fallback and none is under a grammar,
        without the machinery of a drafting pass (verification, acceptance windows): on a small model
        each of its kernels costs about as much as the work, and these steps should cost what the plain
        decode loop's do."""
        s, kv, state = carry
        active = ~s.done
        p = s.length - 1
        pending = jnp.take_along_axis(s.history, p[:, None], axis=1)
        logits, kv, state = target_forward(kv, state, pending, jnp.where(active, p, -1)[:, None], jnp.zeros_like(pending))
        token, logprob = draw(logits[:, 0], sampling, None, s.keys, p, flags)
        if isinstance(speculator, Observer):  # it learns from plain draws too (Jacobi's n-gram pool)
            none = jnp.zeros_like(p)
            draft = DraftInput(s.history, s.length, none, active, s.keys, sampling, flags)
            state = speculator.observe(state, draft, Proposal(jnp.zeros((p.shape[0], 0), jnp.int32), none, None), none, token[:, None])
        keep = jnp.where(active, jnp.minimum(1, s.budget - s.emitted), 0)
        emitted = s.emitted + keep
        ends = active & ((jnp.any(token[:, None] == s.stop_ids, axis=1) & (keep > 0)) | (emitted >= s.budget))
        # Rows in fallback count down to their probe (update_control's work for rows that drafted nothing).
        wait = jnp.where(active, s.control.wait - 1, s.control.wait)
        probe = probes(active, wait)
        control = replace(s.control, length=jnp.where(probe, 1, s.control.length), wait=jnp.where(probe, -1, wait))
        rows = jnp.arange(p.shape[0])
        slot = jnp.where(keep > 0, s.emitted, s.out_tokens.shape[1])  # past the end: dropped
        s = replace(
            s,
            history=s.history.at[rows, jnp.where(keep > 0, s.length, s.history.shape[1])].set(token, mode="drop"),
            length=s.length + keep,
            emitted=emitted,
            done=s.done | ends,
            out_tokens=s.out_tokens.at[rows, slot].set(token, mode="drop"),
            out_logprobs=s.out_logprobs.at[rows, slot].set(logprob, mode="drop"),
            control=control,
            step=s.step + 1,
            plain_steps=s.plain_steps + 1,
        )
        return s, kv, speculator.advance(state, s.length - 1)

    def iteration(carry: tuple[SpeculativeLoop, KVState, Any], width: int) -> tuple[SpeculativeLoop, KVState, Any]:
        """A pass verifying ``width`` drafted positions past each row's pending token (0: a plain step)."""
        s, kv, state = carry
        active = ~s.done
        p = s.length - 1
        room = jnp.minimum(s.limit - 1 - p, s.budget - s.emitted - 1)
        # Free drafts (lookups) take the whole width a pass verifies anyway: only the fallback applies.
        length = s.control.length if cost > 0 else jnp.where(s.control.length > 0, k, 0)
        want = jnp.where(active, jnp.clip(jnp.minimum(length, room), 0, width), 0)

        draft = DraftInput(s.history, s.length, want, active, s.keys, sampling, flags)

        # A pass drafts and verifies for every row: a row with nothing drafted (in fallback, or prompt
        # lookup found nothing) gets the plain token from the pass; when no row drafted anything, the
        # pass is a plain step (one position a row, not width + 1).
        plain = Proposal(jnp.zeros((p.shape[0], 0), jnp.int32), jnp.zeros_like(p), None)
        if not width:
            return finish(s, kv, state, draft, plain, 0)

        def pays(count: Array) -> tuple[Array, Array]:
            """:func:`pass_pays` for this loop: where finished rows are not replaced (the loop does not
            leave when one finishes), the rows with the most tokens left decide."""
            left = jnp.where(active, s.budget - s.emitted, -1)
            refilled = pass_pays(s.control, count, active, s.pass_cost)
            last = pass_pays(s.control, count, active, s.pass_cost, active & (left == jnp.max(left)))
            return jnp.where(s.exit_on_finish, refilled[0], last[0]), jnp.where(s.exit_on_finish, refilled[1], last[1])

        def drafted_pass(state: Any) -> tuple[SpeculativeLoop, KVState, Any]:
            if isinstance(speculator, FeatureObserver):
                state = observe_missing_features(model, params, kv, speculator, state, s.history, s.length, active)
            proposal, state = speculator.propose(draft_params, state, draft)
            if proposal.parents is not None or cost > 0:
                # Drafts that cost are drafted as asked (where no row asks, an adaptive pass took the
                # plain branch): verified as they come, without a branch of their own (on a GPU each
                # branch and loop predicate is a round trip through the host).
                return finish(s, kv, state, draft, proposal, width)
            count = jnp.minimum(proposal.count, want)
            drafted, falls = jnp.any(count > 0), None
            if speculator.adaptive:  # free drafts, dropped where the batch's pass would not pay
                taken, short = pays(count)
                drafted, falls = drafted & taken, short & ~taken
            return jax.lax.cond(
                drafted, lambda st: finish(s, kv, st, draft, proposal, width), lambda st: finish(s, kv, st, draft, plain, 0, falls), state
            )

        if speculator.adaptive and cost > 0:
            # One branch a pass: every row in fallback (a stretch of plain steps), a pass that would not
            # pay or where no row drafts (a plain step), or the drafted pass.
            taken, short = pays(want)
            branch = jnp.where(resting(s), 0, jnp.where(taken & jnp.any(want > 0), 2, 1))
            branches = (
                lambda st: rest((s, kv, st)),
                lambda st: finish(s, kv, st, draft, plain, 0, short),
                drafted_pass,
            )
            return jax.lax.switch(branch, branches, state)
        return drafted_pass(state)

    def finish(
        s: SpeculativeLoop, kv: KVState, state: Any, draft: DraftInput, proposal: Proposal, width: int, falls: Array | None = None
    ) -> tuple[SpeculativeLoop, KVState, Any]:
        """Verify ``proposal`` (``width`` positions past each row's pending token; 0: a plain step),
        accept, and record what each row keeps; ``falls``: rows sent to the fallback (see :func:`pass_pays`)."""
        active, want = draft.active, draft.num_tokens
        p = s.length - 1
        pending = jnp.take_along_axis(s.history, p[:, None], axis=1)[:, 0]
        tree = proposal.parents is not None
        assert not (tree and grammar is not None), "the engine runs rows under a grammar without tree drafts"
        valid: Array | None = None
        if tree:  # nodes up to ``want`` deep whose scratch slots the row reserved; count: the depth drafted
            assert proposal.depth is not None
            nodes = jnp.arange(proposal.tokens.shape[1])[None, :]
            reserved = (nodes < proposal.count[:, None]) & (nodes < (s.limit - 1 - p)[:, None])
            kept = active[:, None] & reserved & (proposal.depth <= want[:, None])
            count, valid = jnp.max(jnp.where(kept, proposal.depth, 0), axis=1, initial=0), kept
        else:
            count = jnp.minimum(proposal.count, want)
        masks = None
        if grammar is not None:  # the constrained rows' masks along their drafts (host)
            shape = jax.ShapeDtypeStruct((count.shape[0], width + 1, grammar.words), jnp.int32)
            masks = io_callback(grammar.draft_masks, shape, proposal.tokens, count, active, ordered=True)

        def allowed(vocab: int, reads: int) -> Array | None:
            if masks is None:
                return None
            b = masks.shape[0]
            return allowed_tokens(masks[:, :reads].reshape(b * reads, -1), vocab).reshape(b, reads, vocab)

        def check(kv: KVState, state: Any) -> tuple[KVState, Any, Array, Array, Array]:
            tokens = jnp.concatenate([pending[:, None], proposal.tokens], axis=1)
            offsets = jnp.arange(width + 1)[None, :]
            positions = jnp.where(active[:, None] & (offsets <= count[:, None]), p[:, None] + offsets, -1)
            logits, kv, state = target_forward(kv, state, tokens, positions, jnp.broadcast_to(offsets, tokens.shape))
            mask = allowed(logits.shape[-1], width + 1)
            produced, logprobs, accepted = verify(logits, proposal, count, p, sampling, s.keys, flags, mask)
            if isinstance(speculator, Observer):  # the draws it sees are the grammar's too
                seen = logits if mask is None else jnp.where(mask, logits, -jnp.inf)
                state = speculator.observe(state, draft, proposal, count, target_draws(seen, p, sampling, s.keys, flags))
            return kv, state, produced, logprobs, accepted

        def check_tree(kv: KVState, state: Any) -> tuple[KVState, Any, Array, Array, Array]:
            assert proposal.parents is not None and proposal.depth is not None and valid is not None
            entries = proposal.tokens.shape[1] + 1
            tokens = jnp.concatenate([pending[:, None], proposal.tokens], axis=1)
            present = jnp.concatenate([active[:, None], valid], axis=1)
            depth = jnp.concatenate([jnp.zeros_like(p)[:, None], proposal.depth], axis=1)
            positions = jnp.where(present, p[:, None] + depth, -1)
            slots = jnp.where(present, p[:, None] + jnp.arange(entries)[None, :], -1)
            sees = ancestors(proposal.parents, k) & present[:, None, :]
            visible = tree_attention_mask(positions, p, slots, positions, sees, kv.capacity, model.sliding_window)
            reads = jnp.broadcast_to(jnp.arange(entries)[None, :], tokens.shape)
            features = None
            if isinstance(speculator, FeatureObserver):
                logits, features, kv, written = forward_tree_features(
                    model, params, kv, tokens, positions, slots, visible, reads, speculator.feature_layers
                )
            else:
                logits, kv, written = forward_tree(model, params, kv, tokens, positions, slots, visible, reads)
            produced, logprobs, accepted, path = verify_tree(logits, proposal, valid, p, k, sampling, s.keys, flags)
            offsets = jnp.arange(1, k + 1)[None, :]
            kv = commit_path(kv, written, path, jnp.where(offsets <= accepted[:, None], p[:, None] + offsets, -1))
            if isinstance(speculator, FeatureObserver) and features is not None:
                # The features of the pending token and the accepted path, at the positions they now hold.
                along = jnp.concatenate([jnp.zeros_like(path[:, :1]), path], axis=1)
                depth = jnp.arange(k + 1)[None, :]
                at = jnp.where(active[:, None] & (depth <= accepted[:, None]), p[:, None] + depth, -1)
                state = speculator.observe_features(state, jnp.take_along_axis(features, along[..., None], axis=1), at)
            return kv, state, produced, logprobs, accepted

        kv, state, produced, logprobs, accepted = (check_tree if tree else check)(kv, state)
        # Keep up to the first stop id and within the budget; inactive rows keep nothing.
        j = jnp.arange(width + 1)[None, :]
        made = jnp.where(j <= accepted[:, None], 1, 0)
        is_stop = jnp.any(produced[..., None] == s.stop_ids[:, None, :], axis=-1) & (made > 0)
        first_stop = jnp.min(jnp.where(is_stop, j, width + 1), axis=1)
        keep = jnp.minimum(jnp.minimum(accepted + 1, first_stop + 1), s.budget - s.emitted)
        keep = jnp.where(active, keep, 0).astype(jnp.int32)
        complete = jnp.zeros_like(active)
        if grammar is not None:  # the grammars take the kept tokens; a row ends where its grammar does
            shapes = (jax.ShapeDtypeStruct(keep.shape, jnp.int32), jax.ShapeDtypeStruct(keep.shape, jnp.bool_))
            taken, complete = io_callback(grammar.take, shapes, produced, keep, active, ordered=True)
            keep = jnp.minimum(keep, taken)
        rows = jnp.arange(p.shape[0])[:, None]
        slots = jnp.where(j < keep[:, None], s.emitted[:, None] + j, s.out_tokens.shape[1])
        places = jnp.where(j < keep[:, None], s.length[:, None] + j, s.history.shape[1])
        length = s.length + keep
        emitted = s.emitted + keep
        ends = active & ((first_stop < keep) | (emitted >= s.budget) | complete)
        state = speculator.advance(state, length - 1)
        s = replace(
            s,
            history=s.history.at[rows, places].set(produced, mode="drop"),
            length=length,
            emitted=emitted,
            done=s.done | ends,
            out_tokens=s.out_tokens.at[rows, slots].set(produced, mode="drop"),
            out_logprobs=s.out_logprobs.at[rows, slots].set(logprobs, mode="drop"),
            drafted=s.drafted + jnp.where(active, count, 0),
            accepted=s.accepted + jnp.where(active, jnp.minimum(accepted, keep), 0),
            verified=s.verified + (active & (count > 0)).astype(jnp.int32),
            control=update_control(s.control, count, accepted, active, k, cost, s.pass_cost, falls) if speculator.adaptive else s.control,
            step=s.step + 1,
            plain_steps=s.plain_steps + int(width == 0),
        )
        return s, kv, state

    if carried is None:
        state = speculator.start(draft_params, loop.history, loop.length)
    else:
        assert isinstance(speculator, ResumableSpeculator) and fresh is not None
        state = jax.lax.cond(
            fresh,
            lambda: speculator.start(draft_params, loop.history, loop.length),
            lambda: speculator.resume(carried, loop.history, loop.length),
        )
    loop, kv, state = jax.lax.while_loop(cond, body, (loop, kv, state))
    return loop, kv, (None if carried is None else state)
