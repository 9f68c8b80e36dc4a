"""A conformance suite for KV caches and storage formats: subclass :class:`CacheConformance`, name the
cache options, and hypothesis checks your cache against an exact reference.

::

    from zgen.cache.factory import kv_dtype, paged_kv
    from zgen.testing.cache_conformance import CacheConformance

    class MyFormatConformance(CacheConformance):
        options = (paged_kv(page_size=4), kv_dtype("my_format"))

    TestMyFormat = MyFormatConformance.TestCase  # pytest collects it

Sequences of tokens start (from the prefix cache when the options have one), grow in chunks of random
sizes, draft tokens and roll back to the accepted ones (as speculative decoding does), truncate, fork,
reset, commit their prefix and are released, over a pool small enough to run out. The K/V at position
``p`` are a fixed function of the tokens up to ``p`` (as a model's are), so one reference decides every
read, exactly:

* **history does not matter**: every live sequence reads bit for bit what a fresh cache of the same
  options reads after one write of the same tokens — whatever it went through (chunked writes, rolled
  back drafts, forks writing beside it, blocks reused from the prefix cache, pool pressure);
* **the format is what it says**: that fresh read equals the format's own round trip
  (``dequantize(quantize(x))``, computed without any cache) to float32 rounding. Coded formats (q4,
  q3) store keys through the model's calibration, which this suite sets to the identity; their
  round trip is checked by zgen's own paged-cache property test;
* **nothing leaks**: a refused allocation changes nothing; for paged kinds, reference counts equal the
  handles' tables plus the prefix cache, and every block is free once all sequences are released.

The compressed kind is out of scope: it pools old tokens, so a read is not a per-token round trip.
Requires ``hypothesis`` (``pip install "zgen[test]"``).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import event, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from zgen.cache.base import KVHandle, KVManager
from zgen.cache.factory import PAGED_KINDS, CacheOption, CacheOptions, make_kv, resolve
from zgen.cache.formats import kv_format
from zgen.cache.paged import PagedKVCache
from zgen.cache.paged_manager import PagedKVManager
from zgen.config import ModelConfig
from zgen.errors import ConfigError, PoolExhaustedError
from zgen.pallas.paged_attention.layouts import KeyCalibration, dequantize

Tokens = tuple[int, ...]


class Live:
    """A sequence under test: its handle and the tokens whose K/V it holds."""

    def __init__(self, handle: KVHandle, tokens: Tokens) -> None:
        self.handle, self.tokens = handle, tokens

    def __repr__(self) -> str:
        return f"Live({list(self.tokens)})"


class CacheConformance(RuleBasedStateMachine):
    """The rules and invariants of the module docstring; a subclass sets :attr:`options`.

    The sizes below are class attributes a subclass may change (a format that needs a larger head
    dimension, say); keep them small: each distinct write length compiles once.
    """

    options: ClassVar[Sequence[CacheOption]] = ()
    layers: ClassVar[int] = 2
    kv_heads: ClassVar[int] = 1
    head_dim: ClassVar[int] = 16
    max_len: ClassVar[int] = 12
    blocks: ClassVar[int] = 10  # paged kinds: the pool's size
    max_sequences: ClassVar[int] = 4
    alphabet: ClassVar[int] = 3  # token ids are drawn from range(alphabet): prefixes repeat often

    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.settings_ = self._options()
        self.manager = self._manager()
        self.live: list[Live] = []
        self.prompts: list[Tokens] = []  # recent prompts, whose prefixes later ones reuse
        self._fresh: dict[Tokens, list[tuple[np.ndarray, np.ndarray]]] = {}

    # -- construction ----------------------------------------------------------------------------

    def _options(self) -> CacheOptions:
        options = resolve(self.options)
        kind = options.resolved_kind
        if kind == "compressed":
            raise ConfigError("the compressed cache pools old tokens; the conformance suite checks per-token caches only")
        if kind in PAGED_KINDS:  # a pool of `blocks` blocks, so that allocations sometimes fail
            storage = options.kv_dtype or "fp32"
            per_token = kv_format(storage, self.head_dim).bytes_per_token_per_layer(self.kv_heads, self.head_dim, options.resolved_page_size)
            block_bytes = per_token * self.layers * options.resolved_page_size
            options = dataclasses.replace(options, max_memory_mb=(self.blocks + 0.5) * block_bytes / 2**20)
        return options

    def _manager(self) -> KVManager:
        config = ModelConfig(
            "llama", vocab_size=self.alphabet, hidden_size=self.kv_heads * self.head_dim, intermediate_size=8,
            num_layers=self.layers, num_heads=self.kv_heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_len,
        )
        calibration = tuple(KeyCalibration.identity(self.kv_heads, self.head_dim) for _ in range(self.layers))
        return make_kv(self.settings_, config, jnp.float32, max_rows=self.max_sequences, max_write=self.max_len, key_calibration=calibration)

    # -- the K/V of tokens -----------------------------------------------------------------------

    def kv_of(self, tokens: Tokens) -> tuple[np.ndarray, np.ndarray]:
        """K and V ``[layers, 1, len, kv_heads, head_dim]``: position p's depend on ``tokens[: p + 1]``."""
        shape = (self.layers, 1, len(tokens), self.kv_heads, self.head_dim)
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for p in range(len(tokens)):
            rng = np.random.default_rng([p + 1, *tokens[: p + 1]])
            k[:, 0, p], v[:, 0, p] = (3 * rng.standard_normal((2, self.layers, self.kv_heads, self.head_dim))).astype(np.float32)
        return k, v

    def _write(self, live: Live, tokens: Tokens) -> bool:
        """Append ``tokens`` in every layer; False (and nothing changed) when the cache has no room."""
        if not tokens:
            return True
        start = live.handle.seq_len
        k, v = self.kv_of(live.tokens + tokens)
        before = self._accounting()
        try:
            live.handle.update(0, jnp.asarray(k[0, :, start:]), jnp.asarray(v[0, :, start:]))
        except PoolExhaustedError:
            event("a write found the cache full")
            assert live.handle.seq_len == start and self._accounting() == before, "a refused write changed the cache"
            return False
        for layer in range(1, self.layers):
            live.handle.update(layer, jnp.asarray(k[layer, :, start:]), jnp.asarray(v[layer, :, start:]))
        live.tokens += tokens
        return True

    def _accounting(self) -> Any:
        if not isinstance(self.manager, PagedKVManager):
            return None
        radix = self.manager.radix
        return self.manager.pool.refcounts().tolist(), None if radix is None else radix.num_blocks

    # -- rules -----------------------------------------------------------------------------------

    @precondition(lambda self: len(self.live) < self.max_sequences)
    @rule(target=sequences, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8), base=st.integers(0, 3), repeat=st.booleans())
    def start(self, tokens: list[int], base: int, repeat: bool) -> Live:
        recent = self.prompts[-base] if 0 < base <= len(self.prompts) else ()
        prompt = recent if recent and repeat else (recent[: self.max_len // 2] + tuple(t % self.alphabet for t in tokens))
        prompt = prompt[: self.max_len]
        self.prompts = [*self.prompts[-3:], prompt]
        handle = self.manager.new_handle()
        try:
            reused = self.manager.match_prefix(handle, prompt)
        except PoolExhaustedError:
            handle.release()
            return self._dead()
        assert handle.seq_len == reused and (reused == 0 or reused < len(prompt)), "match_prefix must leave the last token to feed"
        event("started from the prefix cache" if reused else "started empty")
        live = Live(handle, prompt[:reused])
        self.live.append(live)
        self._write(live, prompt[reused:])
        return live

    def _dead(self) -> Live:
        """A sequence that never started (rules skip it)."""
        return Live(self.manager.new_handle(), ())

    @rule(live=sequences, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=5), pieces=st.integers(1, 3))
    def extend(self, live: Live, tokens: list[int], pieces: int) -> None:
        if live not in self.live or live.handle.seq_len + len(tokens) > self.max_len:
            return
        chunk = -(-len(tokens) // pieces)
        for i in range(0, len(tokens), chunk):
            if not self._write(live, tuple(t % self.alphabet for t in tokens[i : i + chunk])):
                return

    @rule(live=sequences, drafted=st.lists(st.integers(0, 2), min_size=1, max_size=5), accepted=st.integers(0, 5))
    def draft_and_roll_back(self, live: Live, drafted: list[int], accepted: int) -> None:
        """Speculative decoding's pattern: write k drafted tokens, keep the accepted ones."""
        if live not in self.live or live.handle.seq_len + len(drafted) > self.max_len:
            return
        keep = live.handle.seq_len + min(accepted, len(drafted))
        if self._write(live, tuple(t % self.alphabet for t in drafted)):
            live.handle.truncate(keep)
            live.tokens = live.tokens[:keep]
            event("rolled back a draft")

    @rule(live=sequences, fraction=st.floats(0.0, 1.0))
    def truncate(self, live: Live, fraction: float) -> None:
        if live in self.live:
            n = int(fraction * live.handle.seq_len)
            live.handle.truncate(n)
            live.tokens = live.tokens[:n]

    @precondition(lambda self: len(self.live) < self.max_sequences)
    @rule(target=sequences, live=sequences)
    def fork(self, live: Live) -> Live:
        if live not in self.live or not isinstance(live.handle, PagedKVCache):
            return self._dead()  # only paged handles share pages
        twin = Live(live.handle.fork(), live.tokens)
        self.live.append(twin)
        return twin

    @rule(live=sequences)
    def commit(self, live: Live) -> None:
        if live in self.live:
            self.manager.commit_prefix(live.handle, live.tokens)

    @rule(live=sequences)
    def reset(self, live: Live) -> None:
        if live in self.live:
            live.handle.reset()
            live.tokens = ()

    @rule(live=consumes(sequences))
    def release(self, live: Live) -> None:
        live.handle.release()
        if live in self.live:
            self.live.remove(live)

    # -- invariants ------------------------------------------------------------------------------

    def fresh_read(self, tokens: Tokens) -> list[tuple[np.ndarray, np.ndarray]]:
        """What a new cache of the same options reads, per layer, after one write of ``tokens``."""
        if tokens not in self._fresh:
            fresh = self._manager()
            handle = fresh.new_handle()
            k, v = self.kv_of(tokens)
            for layer in range(self.layers):
                handle.update(layer, jnp.asarray(k[layer]), jnp.asarray(v[layer]))
            reads = [handle.get(layer) for layer in range(self.layers)]
            self._fresh[tokens] = [(np.asarray(r.k, np.float32), np.asarray(r.v, np.float32)) for r in reads]
            handle.release()
            fresh.close()
            self._check_round_trip(k, v, self._fresh[tokens])
        return self._fresh[tokens]

    def _check_round_trip(self, k: np.ndarray, v: np.ndarray, reads: list[tuple[np.ndarray, np.ndarray]]) -> None:
        fmt = kv_format(self.settings_.kv_dtype or "fp32")
        if fmt.coded:
            return
        for layer, (read_k, read_v) in enumerate(reads):
            for x, read in ((k[layer], read_k), (v[layer], read_v)):
                expected = np.asarray(_round_trip(fmt.name, jnp.asarray(x)))
                np.testing.assert_allclose(read, expected, rtol=1e-6, atol=1e-6 * float(np.abs(x).max(initial=0.0)),
                                           err_msg=f"the cache does not store what kv dtype {fmt.name!r} says (layer {layer})")

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        for live in self.live:
            assert live.handle.seq_len == len(live.tokens), f"{live}: the cache holds {live.handle.seq_len} tokens"
            if not live.tokens:
                continue
            for layer, (k, v) in enumerate(self.fresh_read(live.tokens)):
                got = live.handle.get(layer)
                np.testing.assert_array_equal(np.asarray(got.k, np.float32), k, err_msg=f"{live}: layer {layer} K depends on history")
                np.testing.assert_array_equal(np.asarray(got.v, np.float32), v, err_msg=f"{live}: layer {layer} V depends on history")

    @invariant()
    def pool_counts_every_owner(self) -> None:
        if not isinstance(self.manager, PagedKVManager):
            return
        radix = self.manager.radix
        owners = [live.handle.owned_blocks() for live in self.live if isinstance(live.handle, PagedKVCache)]
        self.manager.pool.check_invariants(owners=owners + ([radix.blocks()] if radix is not None else []))

    def teardown(self) -> None:
        for live in self.live:
            live.handle.release()
        if isinstance(self.manager, PagedKVManager):
            if self.manager.radix is not None:
                self.manager.radix.clear()
            assert self.manager.pool.num_free == self.manager.pool.num_blocks, "blocks leaked after every sequence was released"
        self.manager.close()


@partial(jax.jit, static_argnums=0)
def _round_trip(name: str, x: jax.Array) -> jax.Array:
    """A format's definition applied to ``x`` without any cache: quantize each token, read it back."""
    return dequantize(kv_format(name).quantize(x), jnp.float32)
