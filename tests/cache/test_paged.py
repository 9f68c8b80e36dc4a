"""Unit tests of the paged KV cache family: BlockPool, the KV formats, PagedKVState, PagedKVCache,
RadixCache and PagedKVManager.

The end-to-end checks run a tiny random Llama through :func:`zgen.runtime.step.forward` (compiled,
the state donated as the runtime's runner does) with a paged state and a dense state and compare the
logits (prefill, prefill from an offset after a reused prefix, decode steps).
"""

from __future__ import annotations

import math

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.cache.base import KVState, StepRow
from zgen.cache.block_pool import BlockPool
from zgen.cache.formats import KV_DTYPES, bytes_per_token_per_layer, empty_pages, kv_format
from zgen.cache.page_store import PagedConfig, PageStore
from zgen.cache.paged import PagedKVCache
from zgen.cache.paged_manager import PagedKVManager
from zgen.cache.paged_state import PagedKVState
from zgen.cache.radix import RadixCache, block_hashes
from zgen.cache.tensor import DenseKVState, causal_attention
from zgen.config import ModelConfig
from zgen.errors import CacheError, ConfigError, PoolExhaustedError
from zgen.graph.decoder import build_decoder
from zgen.rope import rotary
from zgen.model import random_model
from zgen.pallas.paged_attention.layouts import KeyCalibration, hadamard, quantize
from zgen.runtime.calibration import calibrate_keys
from zgen.runtime.step import ModelSpec, _CacheContext, forward

# -- BlockPool ---------------------------------------------------------------------------------------


def test_pool_allocate_share_free_and_exhaustion_is_all_or_nothing() -> None:
    pool = BlockPool(6, page_size=4)
    a = pool.allocate(4)
    assert len(set(a)) == 4 and pool.num_free == 2
    with pytest.raises(PoolExhaustedError, match="needs 3 free blocks but has 2"):
        pool.allocate(3)
    assert pool.num_free == 2 and pool.num_used == 4  # nothing changed
    pool.share(a[:2])
    assert pool.refcount(a[0]) == 2
    assert pool.free(a) == a[2:]  # shared blocks keep one owner
    assert pool.free(a[:2]) == a[:2]
    assert pool.num_free == 6
    pool.check_invariants(owners=[])


def test_pool_double_free_changes_nothing() -> None:
    pool = BlockPool(4, page_size=2)
    a = pool.allocate(2)
    with pytest.raises(CacheError, match="double free"):
        pool.free([a[0], a[1], a[1]])
    assert pool.refcount(a[0]) == 1 and pool.refcount(a[1]) == 1
    with pytest.raises(CacheError, match="is free"):
        pool.share([3])
    with pytest.raises(CacheError, match="outside"):
        pool.free([9])


def test_pool_fragmentation_ratio() -> None:
    pool = BlockPool(4, page_size=4)
    assert pool.fragmentation_ratio == 0.0
    a = pool.allocate(2)
    pool.mark_filled(a[0], 4)
    pool.mark_filled(a[1], 1)
    assert pool.fragmentation_ratio == pytest.approx(1 - 5 / 8)


def test_pool_asks_its_reclaim_callback_for_the_shortfall_only_when_short() -> None:
    pool = BlockPool(4, page_size=2)
    held = pool.allocate(3)
    asked: list[int] = []

    def reclaim(n: int) -> int:
        asked.append(n)
        return len(pool.free(held[:n])) if n <= 2 else 0  # can free 2 of its blocks at most

    pool.reclaim = reclaim
    assert len(pool.allocate(1)) == 1 and asked == []  # not short: not asked
    with pytest.raises(PoolExhaustedError):
        pool.allocate(3)  # short by 3: the callback frees nothing, so the pool raises and changes nothing
    assert asked == [3] and pool.num_free == 0
    assert len(pool.allocate(2)) == 2  # short by 2: freed by the callback, then allocated
    assert asked == [3, 2] and pool.num_free == 0
    pool.check_invariants()


def test_pool_from_memory_budget_counts_real_bytes() -> None:
    def block_bytes(kv_dtype: str) -> int:
        return PagedConfig(num_layers=2, kv_heads=3, head_dim=64, page_size=16, kv_dtype=kv_dtype).bytes_per_token * 16

    per_block_bf16 = bytes_per_token_per_layer("bf16", 3, 64, 16) * 16 * 2
    assert block_bytes("bf16") == per_block_bf16
    bf16 = BlockPool.blocks_in_budget(1.0, block_bytes("bf16"), 16)
    assert bf16 == 2**20 // per_block_bf16
    q4 = BlockPool.blocks_in_budget(1.0, block_bytes("q4"), 16)
    assert q4 > 3 * bf16
    with pytest.raises(ConfigError, match="holds no block"):
        BlockPool.blocks_in_budget(0.001, block_bytes("fp32"), 16)
    store = PageStore.with_budget(PagedConfig(2, 3, 64, 16, "q4"), 1.0)
    assert store.pool.num_blocks == q4 and store.pool.page_size == 16


@pytest.mark.parametrize("budget", [2.0**31, 1e308, math.inf])
def test_a_budget_beyond_the_device_is_refused_before_allocating(budget: float) -> None:
    with pytest.raises(ConfigError, match="max_memory_mb"):
        PageStore.with_budget(PagedConfig(2, 2, 16, 1, "fp32"), budget)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_bytes_per_token_matches_the_store(kv_dtype: str) -> None:
    config = PagedConfig(num_layers=2, kv_heads=3, head_dim=64, page_size=8, kv_dtype=kv_dtype)
    store = PageStore(config, BlockPool(5, 8))
    per_token = bytes_per_token_per_layer(kv_dtype, 3, 64, 8)
    assert store.nbytes == per_token * 5 * 8 * 2
    assert config.bytes_per_token == per_token * 2


def test_memory_per_token_really_shrinks() -> None:
    sizes = {d: bytes_per_token_per_layer(d, 3, 64, 16) for d in KV_DTYPES}
    # SmolLM2 shape (3 kv heads x 64): K and V, per token per layer.
    assert sizes == {"fp32": 1536, "bf16": 768, "fp16": 768, "fp8": 408, "q4": 240, "q3": 192}
    assert sizes["q3"] < sizes["q4"] < sizes["fp8"] < sizes["bf16"]
    assert bytes_per_token_per_layer("q3", 8, 128, 16) / bytes_per_token_per_layer("bf16", 8, 128, 16) == 0.25
    assert [name for name in KV_DTYPES if kv_format(name).coded] == ["q4", "q3"]


def test_unknown_kv_dtype_and_bad_head_dim() -> None:
    with pytest.raises(ConfigError, match="unknown kv dtype"):
        PagedConfig(1, 1, 16, kv_dtype="int8")
    with pytest.raises(ConfigError, match="head_dim % 8"):
        empty_pages("q3", 1, 1, 4, 12)


# -- PagedKVState against the dense state -------------------------------------------------------------

B, KVH, H, D, PS = 2, 2, 4, 16, 4


def _rand(key: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(key).standard_normal(shape), jnp.float32)


@jax.jit
def _write(state: KVState, k: jax.Array, v: jax.Array, pos: jax.Array) -> KVState:
    return state.write(0, k, v, pos)


@partial(jax.jit, static_argnums=3)
def _attend(state: KVState, q: jax.Array, pos: jax.Array, window: int | None) -> jax.Array:
    return state.attend(0, q, pos, sliding_window=window)


@jax.jit
def _view(state: PagedKVState) -> tuple[jax.Array, jax.Array]:
    view = state.layer_view(0)
    return view.k, view.v


def _shuffled_state(kv_dtype: str, capacity: int, num_layers: int = 1, seed: int = 0) -> PagedKVState:
    """A paged state whose rows own scattered, non-contiguous pages (the pool has spare pages)."""
    pps = -(-capacity // PS)
    num_pages = B * pps + 3
    ids = np.random.default_rng(seed).permutation(num_pages)[: B * pps].reshape(B, pps)
    pages = [empty_pages(kv_dtype, KVH, num_pages, PS, D) for _ in range(2 * num_layers)]
    return PagedKVState(tuple(pages[:num_layers]), tuple(pages[num_layers:]), jnp.asarray(ids, jnp.int32), kv_dtype)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_state_prefill_offset_and_decode_match_dense(window: int | None) -> None:
    cap = 16
    paged: KVState = _shuffled_state("fp32", cap)
    dense: KVState = DenseKVState.zeros(1, B, cap, KVH, D, jnp.float32)
    # Prefill 6 tokens, then 5 more from offset 6 (a cached prefix), then 3 single-token decode steps.
    steps = [(0, 6), (6, 5), (11, 1), (12, 1), (13, 1)]
    for i, (start, n) in enumerate(steps):
        pos = jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (B, n))
        k, v, q = _rand(3 * i, B, n, KVH, D), _rand(3 * i + 1, B, n, KVH, D), _rand(3 * i + 2, B, n, H, D)
        paged, dense = _write(paged, k, v, pos), _write(dense, k, v, pos)
        out_p, out_d = _attend(paged, q, pos, window), _attend(dense, q, pos, window)
        np.testing.assert_allclose(out_p, out_d, rtol=1e-5, atol=1e-5)
    end = steps[-1][0] + 1
    assert isinstance(paged, PagedKVState) and isinstance(dense, DenseKVState)
    np.testing.assert_array_equal(_view(paged)[0][:, :end], dense.k[0][:, :end])


def test_paged_state_drops_out_of_range_writes() -> None:
    paged = _shuffled_state("fp32", 8)
    before = jax.tree_util.tree_leaves(paged)
    pos = jnp.asarray([[8, 9], [-1, 100]], jnp.int32)
    after = _write(paged, _rand(0, B, 2, KVH, D), _rand(1, B, 2, KVH, D), pos)
    for x, y in zip(before, jax.tree_util.tree_leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8", "q4", "q3"])
def test_quantized_state_attends_like_its_dequantized_view(kv_dtype: str) -> None:
    """Decode (kernel over quantized pages) and prefill (dense gather) both equal attention over the
    dequantized cache: quantization error is the only difference from full precision."""
    cap = 12
    state = _shuffled_state(kv_dtype, cap, seed=1)
    pos = jnp.broadcast_to(jnp.arange(0, 9, dtype=jnp.int32), (B, 9))
    written = _write(state, _rand(1, B, 9, KVH, D), _rand(2, B, 9, KVH, D), pos)
    assert isinstance(written, PagedKVState)
    vk, vv = _view(written)
    dense = DenseKVState((vk,), (vv,))
    q_pos = jnp.asarray([[8], [5]], jnp.int32)  # rows at different lengths
    q = _rand(3, B, 1, H, D)
    np.testing.assert_allclose(_attend(written, q, q_pos, None), _attend(dense, q, q_pos, None), rtol=2e-2, atol=2e-2)
    qp = _rand(4, B, 9, H, D)
    np.testing.assert_allclose(_attend(written, qp, pos, 4), _attend(dense, qp, pos, 4), rtol=2e-2, atol=2e-2)


INV_FREQ = jnp.asarray(10_000.0 ** (-np.arange(0, D, 2) / D), jnp.float32)


@jax.jit
def _write_and_attend(state: PagedKVState, q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[jax.Array, PagedKVState]:
    """What an Attention node does through the step's cache context (q and k not rotated yet)."""
    ctx = _CacheContext(state, None)
    out = ctx.write_and_attend(0, q, k, v, pos, INV_FREQ)
    return out, ctx.state


def _context_step(state: PagedKVState, start: int, n: int, seed: int) -> tuple[jax.Array, PagedKVState, jax.Array, jax.Array, jax.Array]:
    """Write and attend ``n`` tokens from ``start``: the output, the new state, and the rotated queries,
    the keys (before RoPE) and the positions that were given."""
    pos = jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (B, n))
    k, v = _rand(seed, B, n, KVH, D), _rand(seed + 1, B, n, KVH, D)
    q = _rand(seed + 2, B, n, H, D)
    out, state = _write_and_attend(state, q, k, v, pos)
    return out, state, rotary(q, pos, INV_FREQ), k, pos


@pytest.mark.parametrize("kv_dtype", ["q4", "q3"])
def test_coded_formats_attend_like_their_decoded_keys(kv_dtype: str) -> None:
    """Through the step's cache context: the coded keys decode to the rotated keys (within the
    quantization error), and prefill (T > 1) and decode (T == 1) attention -- which never decode a
    key -- equal attention over the decoded keys."""
    state = _shuffled_state(kv_dtype, 12, seed=2)
    for start, n, seed in ((0, 9, 10), (9, 1, 20)):
        out, state, q, k, pos = _context_step(state, start, n, seed)
        view = _view(state)
        stored = view[0][:, start : start + n]
        err = float(jnp.linalg.norm(stored - rotary(k, pos, INV_FREQ)) / jnp.linalg.norm(k))
        assert err < 0.25, err
        expected = causal_attention(q, view[0], view[1], pos, sliding_window=None)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8"])
def test_other_formats_store_the_rotated_keys(kv_dtype: str) -> None:
    state = _shuffled_state(kv_dtype, 12, seed=3)
    _, state, _, k, pos = _context_step(state, 0, 5, 30)
    tolerance = {"fp32": 1e-6, "bf16": 1e-2, "fp8": 0.07}[kv_dtype]  # fp32: XLA may fuse the rotation differently
    np.testing.assert_allclose(_view(state)[0][:, :5], rotary(k, pos, INV_FREQ), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_a_decode_step_on_the_triton_kernels_is_one_kernel(kv_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over plain or fp8 pages the Triton path (interpreted here; the GPU's default) takes a decode step
    through ``append_and_attend``'s one kernel, prefill through the separate rotation, write and
    attention; the output and pages equal the XLA path's (rows at different lengths, pages scattered)."""
    import zgen.cache.paged_state as paged_state

    calls: list[int] = []
    one_kernel = paged_state.append_and_attend

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return one_kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_state, "append_and_attend", counted)
    ids = np.random.default_rng(6).permutation(2 * B + 1)[: 2 * B].reshape(B, 2)
    # fp8 as float pages (a CPU cache keeps them in integer containers, which take the XLA path)
    empty = jnp.zeros((KVH, 2 * B + 1, 16, D), jnp.float32)
    pages = [empty if kv_dtype == "fp32" else quantize(empty, "fp8") for _ in range(2)]
    state = PagedKVState((pages[0],), (pages[1],), jnp.asarray(ids, jnp.int32), kv_dtype, attention="xla")
    _, state, *_ = _context_step(state, 0, 20, 40)
    assert not calls
    pos = jnp.asarray([[20], [17]], jnp.int32)
    q, k, v = _rand(50, B, 1, H, D), _rand(51, B, 1, KVH, D), _rand(52, B, 1, KVH, D)
    expected, by_xla = _write_and_attend(state, q, k, v, pos)
    out, by_kernel = _write_and_attend(replace(state, attention="triton"), q, k, v, pos)
    assert calls
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(_view(by_kernel), _view(by_xla), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_key_calibration_centres_each_key_on_its_rotated_mean() -> None:
    """A key equal to its position's centre rotated to it (the sink's at position 0) codes to zero;
    decoding inverts encoding; the coding commutes with RoPE when the scale is tied per pair."""
    rng = np.random.default_rng(4)
    center, sink = (jnp.asarray(rng.standard_normal((KVH, D)), jnp.float32) for _ in range(2))
    pair_scale = jnp.asarray(rng.uniform(0.5, 2.0, (KVH, D // 2)), jnp.float32)
    calibration = KeyCalibration(center, sink, jnp.concatenate([pair_scale] * 2, axis=-1), INV_FREQ)
    pos = jnp.broadcast_to(jnp.arange(3), (B, 3))[:, :, None]
    k = _rand(5, B, 3, KVH, D)
    coded = calibration.encode(k, pos, head_axis=-2)
    np.testing.assert_allclose(calibration.decode(coded, pos, head_axis=-2), k, rtol=1e-5, atol=1e-5)
    means = jnp.where((pos == 0)[..., None], sink, center)
    np.testing.assert_allclose(calibration.encode(rotary(means, pos[..., 0], INV_FREQ), pos, head_axis=-2), 0.0, atol=1e-5)
    # Coding rotated keys = rotating the centred, scaled keys before the Hadamard rotation.
    centred = (k - means) * calibration.scale
    rotated = calibration.encode(rotary(k, pos[..., 0], INV_FREQ), pos, head_axis=-2)
    np.testing.assert_allclose(rotated, hadamard(rotary(centred, pos[..., 0], INV_FREQ)), rtol=1e-5, atol=1e-5)


# -- a tiny random model through the compiled step -----------------------------------------------------

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)

Forward = Callable[[dict[str, jax.Array], KVState, jax.Array, jax.Array, jax.Array], tuple[jax.Array, KVState]]


@dataclass(frozen=True)
class TinyModel:
    """A tiny random Llama's parameters and its step, compiled with the state donated (as a Runner does)."""

    params: dict[str, jax.Array]
    forward: Forward


@pytest.fixture(scope="module")
def tiny_model() -> TinyModel:
    graph = build_decoder(CONFIG)
    rng = np.random.default_rng(0)
    params = {
        name: jnp.asarray(rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 1.0), jnp.float32)
        for name, shape in graph.param_shapes().items()
    }
    return TinyModel(params, jax.jit(partial(forward, ModelSpec(graph, None)), donate_argnums=(1,)))


def _run(
    model: TinyModel,
    state: KVState,
    rows: Sequence[Sequence[int]],
    offsets: Sequence[int],
    *,
    width: int | None = None,
    index: Sequence[int] | None = None,
) -> tuple[np.ndarray, KVState]:
    """Feed row ``i``'s tokens at ``offsets[i]``.. in batch row ``index[i]`` of one step of ``width``
    rows (padding at position -1, as the runtime pads); the last-token logits of each given row (in
    the order given) and the returned state."""
    width = width or len(rows)
    index = list(index or range(len(rows)))
    length = max(len(r) for r in rows)
    tokens = np.zeros((width, length), np.int32)
    positions = np.full((width, length), -1, np.int32)
    last = np.zeros((width, 1), np.int32)
    for i, row, offset in zip(index, rows, offsets, strict=True):
        tokens[i, : len(row)] = row
        positions[i, : len(row)] = np.arange(offset, offset + len(row))
        last[i] = len(row) - 1
    logits, state = model.forward(model.params, state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(last))
    return np.asarray(logits[np.asarray(index), 0]), state


def _feed(model: TinyModel, manager: PagedKVManager, handles: Sequence[PagedKVCache], rows: Sequence[Sequence[int]]) -> np.ndarray:
    """One step as the runtime runs it: each handle reserves its row's tokens after what it holds, the
    manager lays out the step's state, the step writes it, the manager takes it back. Last-token logits."""
    starts = [handle.seq_len for handle in handles]
    for handle, row in zip(handles, rows, strict=True):
        handle.reserve(len(row))
    width, index = manager.layout(handles)
    step_rows = [StepRow(handle, start, len(row)) for handle, start, row in zip(handles, starts, rows, strict=True)]
    state = manager.step_state(step_rows, width, max(len(r) for r in rows))
    logits, state = _run(model, state, rows, starts, width=width, index=index)
    manager.absorb(state)
    return logits


def _model_pages(kv_dtype: str = "fp32", key_calibration: tuple[KeyCalibration, ...] | None = None) -> PagedConfig:
    """Pages shaped for the tiny model."""
    return PagedConfig(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, 4, kv_dtype, key_calibration=key_calibration)


def _manager(num_blocks: int, config: PagedConfig | None = None, *, max_len: int = 16, prefix_cache: bool = True) -> PagedKVManager:
    """A manager on a fresh pool of ``num_blocks`` pages of 4 tokens (by default one small layer: bookkeeping only)."""
    store = PageStore(config or PagedConfig(1, 1, 8, 4, "fp32"), BlockPool(num_blocks, 4))
    return PagedKVManager(store, max_len=max_len, prefix_cache=prefix_cache)


def test_calibrate_keys_measures_centres_sinks_and_sensitivity() -> None:
    model = random_model(CONFIG, dtype="float32")
    calibration = calibrate_keys(model, windows=3, window=16)
    assert len(calibration) == CONFIG.num_layers
    for layer in calibration:
        for stat in (layer.center, layer.sink, layer.scale):
            assert stat.shape == (CONFIG.num_kv_heads, CONFIG.head_dim) and bool(jnp.all(jnp.isfinite(stat)))
        assert bool(jnp.all(layer.scale > 0))
        np.testing.assert_allclose(jnp.mean(jnp.log(layer.scale), axis=-1), 0.0, atol=1e-5)  # geometric mean 1
    # Given ids: the sink of layer 0 is the mean pre-RoPE key of the windows' first tokens.
    ids = list(range(1, 33))
    calibration = calibrate_keys(model, ids, windows=2, window=16)
    x = model.params["embed"][jnp.asarray([ids[0], ids[16]])]
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + CONFIG.rms_norm_eps) * model.params["layers.0.input_norm"]
    q_rows = CONFIG.num_heads * CONFIG.head_dim
    k_rows = model.params["layers.0.qkv"][q_rows : q_rows + CONFIG.num_kv_heads * CONFIG.head_dim]
    keys = jnp.dot(normed, k_rows.T, precision=jax.lax.Precision.HIGHEST).reshape(2, CONFIG.num_kv_heads, CONFIG.head_dim)
    np.testing.assert_allclose(calibration[0].sink, keys.mean(0), rtol=1e-4, atol=1e-4)


def test_calibrated_manager_serves_states_again_after_a_step_donated_them(tiny_model: TinyModel) -> None:
    """The store hands each state fresh calibration arrays: a donated state does not kill the next one."""
    calibration = calibrate_keys(random_model(CONFIG, dtype="float32"), windows=2, window=8)
    manager = _manager(16, _model_pages("q3", calibration), max_len=12, prefix_cache=False)
    logits = []
    for _ in range(2):
        handle = manager.new_handle()
        logits.append(_feed(tiny_model, manager, [handle], [[3, 1, 4, 1, 5, 9]]))
        handle.release()
    np.testing.assert_array_equal(logits[0], logits[1])
    assert manager.pool.num_free == 16


def test_calibration_must_match_the_cache_shape() -> None:
    wrong = (KeyCalibration.identity(KVH + 1, D),)
    with pytest.raises(ConfigError, match="key_calibration"):
        PagedConfig(1, KVH, D, PS, "q4", key_calibration=wrong)
    with pytest.raises(ConfigError, match="layers"):
        PagedKVState.contiguous(2, 1, 8, KVH, D, kv_dtype="q4", page_size=PS, key_calibration=(KeyCalibration.identity(KVH, D),))


def test_contiguous_state_is_the_dense_layout_with_any_storage_dtype() -> None:
    state = PagedKVState.contiguous(2, 3, 10, KVH, D, kv_dtype="q4", page_size=4)
    assert state.capacity == 12
    np.testing.assert_array_equal(state.block_tables, np.arange(9).reshape(3, 3))
    assert state.num_pages == 9


@pytest.mark.parametrize("kv_dtype", ["fp32", "q4"])
def test_tiny_model_prefill_and_decode_logits_paged_equal_dense(tiny_model: TinyModel, kv_dtype: str) -> None:
    manager = _manager(40, _model_pages(kv_dtype), max_len=24, prefix_cache=False)
    manager.pool.allocate(5)  # the handles' blocks do not start at block 0
    handles = [manager.new_handle(), manager.new_handle()]
    dense: KVState = DenseKVState.zeros(CONFIG.num_layers, 2, 24, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)
    prompts = [[5, 17, 3, 88, 42, 9, 1, 60, 33], [7, 7, 21, 14, 2, 96, 50, 11, 4]]

    def check(lp: np.ndarray, ld: np.ndarray, what: str) -> None:
        if kv_dtype == "fp32":
            np.testing.assert_allclose(lp, ld, rtol=1e-4, atol=1e-4, err_msg=what)
        else:  # q4 at head_dim 16 (groups of 8): logits move by the quantization error, not more
            rel = float(np.linalg.norm(lp - ld) / np.linalg.norm(ld))
            assert rel < 0.35, f"{what}: relative logit error {rel:.3f}"

    lp = _feed(tiny_model, manager, handles, prompts)
    ld, dense = _run(tiny_model, dense, prompts, [0, 0])
    check(lp, ld, "prefill")
    pos = [9, 9]
    for step in range(4):  # T == 1: the paged decode kernel
        tok = [[int(np.argmax(ld[i]))] for i in range(2)]
        lp = _feed(tiny_model, manager, handles, tok)
        ld, dense = _run(tiny_model, dense, tok, pos)
        check(lp, ld, f"decode step {step}")
        pos = [p + 1 for p in pos]
    assert [h.seq_len for h in handles] == [13, 13] and manager.pool.num_free == 40 - 5 - 2 * 4
    for handle in handles:
        handle.release()
    assert manager.pool.num_free == 35


def test_prefix_reuse_gives_the_same_logits_as_a_full_prefill(tiny_model: TinyModel) -> None:
    manager = _manager(24, _model_pages())
    radix = manager.radix
    assert radix is not None
    shared = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    first = shared + [30, 31]
    handle = manager.new_handle()
    assert manager.match_prefix(handle, first) == 0 and radix.stats.misses == 1
    full_logits = _feed(tiny_model, manager, [handle], [first])
    manager.commit_prefix(handle, first)
    assert radix.num_blocks == 3 and radix.stats.inserted_blocks == 3  # 12 tokens = 3 full blocks
    handle.release()
    assert manager.pool.num_used == 3  # the radix tree keeps the committed blocks

    second = shared + [40, 41, 42]  # shares 10 tokens = 2 full blocks
    handles = [manager.new_handle(), manager.new_handle()]
    reused = [manager.match_prefix(h, p) for h, p in zip(handles, [second, first], strict=True)]
    assert reused == [8, 8]  # `first` could reuse 12 but must feed its last token: 8 = largest block multiple <= 11
    assert [h.seq_len for h in handles] == reused
    table = [h.block_table for h in handles]
    assert table[0][0, 0] == table[1][0, 0] and manager.pool.refcount(int(table[0][0, 0])) == 3  # shared, not copied
    logits = _feed(tiny_model, manager, handles, [second[8:], first[8:]])
    for h in handles:
        h.release()
    fresh: KVState = DenseKVState.zeros(CONFIG.num_layers, 2, 16, CONFIG.num_kv_heads, CONFIG.head_dim, jnp.float32)
    ref, _ = _run(tiny_model, fresh, [second, first], [0, 0])
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[1], full_logits[0], rtol=1e-4, atol=1e-4)


def test_a_failed_step_that_donated_the_pages_is_reported_until_they_are_reset(tiny_model: TinyModel) -> None:
    """A step that donated the store's pages and never handed its result back leaves every sequence on
    the pool without K/V: each use says so (CacheError) instead of reading freed buffers; the block
    bookkeeping is intact, and ``reset_pages`` starts over with zeroed pages."""
    manager = _manager(8, _model_pages())
    handle = manager.new_handle()
    handle.reserve(5)
    row = StepRow(handle, 0, 5)
    given = manager.step_state([row], 1, 5)
    assert isinstance(given, PagedKVState)
    _run(tiny_model, given, [[1, 2, 3, 4, 5]], [0])  # the returned state is lost: the step "failed"
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(given.k))
    for use in (lambda: handle.get(0), lambda: manager.step_state([row], 1, 5), lambda: handle.state):
        with pytest.raises(CacheError, match="donated"):
            use()
    assert manager.pool.num_used == 2 and handle.seq_len == 5
    manager.store.reset_pages()
    np.testing.assert_array_equal(handle.get(0).k, np.zeros((1, 5, CONFIG.num_kv_heads, CONFIG.head_dim), np.float32))
    handle.reset()
    _feed(tiny_model, manager, [handle], [[1, 2, 3, 4, 5]])  # the manager serves steps again
    assert float(jnp.abs(handle.get(0).k).max()) > 0
    handle.release()
    assert manager.pool.num_free == 8


# -- PagedKVManager bookkeeping -----------------------------------------------------------------------


def test_manager_reserve_layout_release_and_exhaustion() -> None:
    manager = _manager(10, max_len=16)
    assert manager.kind == "paged" and manager.pages
    a, b = manager.new_handle(), manager.new_handle()
    a.reserve(13)
    b.reserve(13)  # ceil(13/4) = 4 blocks per handle
    assert manager.pool.num_free == 2
    width, index = manager.layout([a, b])
    assert (width, index) == (2, [0, 1])
    state = manager.step_state([StepRow(a, 0, 13), StepRow(b, 0, 13)], width, 13)
    assert isinstance(state, PagedKVState) and state.block_tables.shape == (2, 8)  # at least 8 pages: fewer compiles
    np.testing.assert_array_equal(np.asarray(state.block_tables)[:, :4], np.concatenate([a.block_table, b.block_table])[:, :4])
    assert (np.asarray(state.block_tables)[:, 4:] == -1).all()
    manager.absorb(state)
    c = manager.new_handle()
    with pytest.raises(PoolExhaustedError):
        c.reserve(12)  # 3 blocks > 2 free
    assert c.seq_len == 0 and manager.pool.num_free == 2  # nothing changed
    with pytest.raises(CacheError, match="cannot reserve"):
        c.reserve(17)  # past the manager's max_len
    a.release()
    b.release()
    assert manager.pool.num_free == 10
    c.reserve(12)
    c.release()
    assert manager.pool.num_free == 10
    with pytest.raises(CacheError, match="released"):
        a.reserve(1)


def test_manager_reclaims_unused_prefix_blocks_only_when_that_suffices() -> None:
    manager = _manager(6, max_len=32)
    radix = manager.radix
    assert radix is not None and manager.pool.reclaim == radix.reclaim
    tokens = list(range(9))
    handle = manager.new_handle()
    assert manager.match_prefix(handle, tokens) == 0
    handle.reserve(9)
    manager.commit_prefix(handle, tokens)  # 2 full blocks
    handle.release()
    assert manager.pool.num_free == 4 and radix.num_blocks == 2
    big = manager.new_handle()
    with pytest.raises(PoolExhaustedError):
        big.reserve(28)  # 7 blocks > 4 free + 2 evictable: nothing is evicted
    assert radix.num_blocks == 2 and big.seq_len == 0 and manager.pool.num_free == 4

    reader = manager.new_handle()
    assert manager.match_prefix(reader, tokens) == 8  # the cached blocks are in use now
    with pytest.raises(PoolExhaustedError):
        big.reserve(24)  # 6 blocks > 4 free, and no cached block may go
    assert radix.num_blocks == 2
    reader.release()
    big.reserve(24)  # 6 blocks: the pool reclaims both cached blocks
    assert radix.num_blocks == 0 and radix.stats.evicted_blocks == 2
    big.release()
    assert manager.pool.num_free == 6


def test_manager_prefix_rules() -> None:
    manager = _manager(8, max_len=16)
    radix = manager.radix
    assert radix is not None
    tokens = list(range(12))
    handle = manager.new_handle()
    assert manager.match_prefix(handle, tokens[:1]) == 0  # a one-token prompt must feed its token: no lookup
    assert radix.stats.lookups == 0
    handle.reserve(12)
    with pytest.raises(CacheError, match="empty sequence"):
        manager.match_prefix(handle, tokens)
    handle.drop_blocks([1])  # a masked page (a context's): only the pages before it are offered
    manager.commit_prefix(handle, tokens)
    assert radix.entries() == [(tuple(tokens[:4]), int(handle.block_table[0, 0]))]
    manager.commit_prefix(handle, tokens[:3])  # no full block: nothing offered
    assert radix.num_blocks == 1
    handle.release()
    without = _manager(8, prefix_cache=False)
    other = without.new_handle()
    assert without.radix is None and without.pool.reclaim is None and without.match_prefix(other, tokens) == 0
    other.reserve(12)
    without.commit_prefix(other, tokens)
    other.release()
    assert without.pool.num_free == 8


# -- PagedKVCache host handle --------------------------------------------------------------------------


def test_cache_fork_shares_full_blocks_and_copies_the_partial_one_on_write() -> None:
    cache = PagedKVCache.create(1, 2, 32, KVH, D, page_size=4, num_blocks=16)
    k = _rand(0, 2, 6, KVH, D)
    cache.update(0, k, k)
    twin = cache.fork()
    assert cache.pool.num_used == 4  # nothing copied by fork
    assert all(cache.pool.refcount(b) == 2 for b in cache.owned_blocks())
    k2 = _rand(1, 2, 3, KVH, D)
    twin.update(0, k2, k2)
    # Block 0 of each row still shared; the partial block 1 was copied for the twin.
    assert twin.block_table[0, 0] == cache.block_table[0, 0]
    assert twin.block_table[0, 1] != cache.block_table[0, 1]
    np.testing.assert_array_equal(cache.get(0).k, k)
    np.testing.assert_array_equal(twin.get(0).k, jnp.concatenate([k, k2], axis=1))
    k3 = _rand(2, 2, 2, KVH, D)
    cache.update(0, k3, k3)  # the original writes into its own block 1 (now unshared): no copy
    np.testing.assert_array_equal(twin.get(0).k[:, 6:], k2)
    twin.release()
    cache.release()
    cache.pool.check_invariants(owners=[])
    assert cache.pool.num_free == 16


def test_cache_truncate_is_exact_and_frees_blocks() -> None:
    cache = PagedKVCache.create(2, 1, 32, KVH, D, page_size=4, kv_dtype="bf16", num_blocks=8)
    k = _rand(0, 1, 10, KVH, D)
    for layer in range(2):
        cache.update(layer, k, -k)
    before = cache.get(1)
    cache.truncate(5)
    assert cache.pool.num_used == 2 and cache.seq_len == 5
    np.testing.assert_array_equal(cache.get(1).k, before.k[:, :5])
    np.testing.assert_array_equal(cache.get(1).v, before.v[:, :5])
    with pytest.raises(CacheError, match="cannot truncate"):
        cache.truncate(6)


def test_cache_update_exhaustion_changes_nothing() -> None:
    cache = PagedKVCache.create(1, 2, 32, KVH, D, page_size=4, num_blocks=5)
    k = _rand(0, 2, 8, KVH, D)
    cache.update(0, k, k)  # 4 blocks
    table = cache.block_table
    with pytest.raises(PoolExhaustedError):
        cache.update(0, _rand(1, 2, 1, KVH, D), _rand(1, 2, 1, KVH, D))  # needs 2 more, 1 free
    np.testing.assert_array_equal(cache.block_table, table)
    assert cache.seq_len == 8 and cache.pool.num_free == 1
    np.testing.assert_array_equal(cache.get(0).k, k)


def test_cache_inject_blocks_and_errors() -> None:
    cache = PagedKVCache.create(1, 1, 16, KVH, D, page_size=4, num_blocks=8)
    k = _rand(0, 1, 8, KVH, D)
    cache.update(0, k, k)
    other = PagedKVCache(cache.store, 1, 16)
    other.inject_blocks([cache.owned_blocks()], 7)
    np.testing.assert_array_equal(other.get(0).k, k[:, :7])
    k2 = _rand(1, 1, 2, KVH, D)
    other.update(0, k2, k2)  # position 7 sits in a shared block: copied first
    np.testing.assert_array_equal(cache.get(0).k, k)
    np.testing.assert_array_equal(other.get(0).k, jnp.concatenate([k[:, :7], k2], axis=1))
    with pytest.raises(CacheError, match="empty cache"):
        other.inject_blocks([[0]], 4)
    with pytest.raises(CacheError, match=r"shaped \[batch=1"):
        other.update(0, _rand(0, 2, 1, KVH, D), _rand(0, 2, 1, KVH, D))
    with pytest.raises(CacheError, match="cannot append"):
        other.update(0, _rand(0, 1, 8, KVH, D), _rand(0, 1, 8, KVH, D))
    other.release()
    with pytest.raises(CacheError, match="released"):
        other.get(0)


# -- RadixCache --------------------------------------------------------------------------------------


def test_radix_match_insert_share_and_lru_eviction() -> None:
    pool = BlockPool(8, page_size=2)
    radix = RadixCache(pool)
    a = pool.allocate(3)
    assert radix.insert([1, 2, 3, 4, 5, 6, 7], a) == 3  # 7 tokens: 3 full blocks
    assert radix.match([1, 2, 3, 4, 9, 9]) == (a[:2], 4)
    assert radix.match([1, 3]) == ([], 0)
    b = pool.allocate(2)
    assert radix.insert([1, 2, 8, 8], b) == 1  # block [1, 2] already cached: keeps a[0]
    assert pool.refcount(b[0]) == 1 and pool.refcount(b[1]) == 2
    pool.free(a + b)  # the sequences finish; only the tree holds the blocks
    assert pool.num_used == 4
    radix.match([1, 2, 8, 8])  # most recently used path
    assert radix.evict(1) == 1
    assert radix.match([1, 2, 3, 4, 5, 6]) == (a[:2], 4)  # the LRU leaf [5, 6] went first
    pool.share([b[1]])  # in use again: not evictable
    assert radix.evictable_blocks() == 1  # [3, 4]; [1, 2] has an in-use child
    assert radix.evict(10) == 1
    assert radix.num_blocks == 2 and pool.refcount(b[1]) == 2
    s = radix.stats
    assert (s.lookups, s.hits, s.misses, s.inserted_blocks, s.evicted_blocks) == (4, 3, 1, 4, 2)
    assert len(block_hashes([1, 2, 8, 8], 2)) == 2 and radix.contains_hash(block_hashes([1, 2, 8, 8], 2)[1])


def test_radix_counts_a_sequence_deeper_than_pythons_recursion_limit() -> None:
    """A 3,000-block sequence (e.g. 48k tokens in pages of 16) is a 3,000-deep chain: counting what
    can be evicted, listing the entries and reclaiming walk it without recursion; reclaiming stops
    counting once it has found enough."""
    depth = 3_000
    pool = BlockPool(depth + 2, page_size=1)
    radix = RadixCache(pool)
    blocks = pool.allocate(depth)
    radix.insert(list(range(depth)), blocks)
    pool.share([blocks[depth // 2]])  # in use (as a running sequence would hold it): it and its ancestors stay
    pool.free(blocks)
    assert radix.evictable_blocks() == depth - depth // 2 - 1  # the nodes below the one in use
    assert radix.evictable_blocks(enough=5) == 5
    assert len(radix.entries()) == depth and radix.entries()[-1] == (tuple(range(depth)), blocks[-1])
    assert radix.reclaim(depth) == 0 and radix.num_blocks == depth  # more than can go: nothing goes
    assert radix.reclaim(4) == 4 and radix.num_blocks == depth - 4


def test_radix_evicts_least_recently_used_first_after_many_lookups() -> None:
    """Lookups queue their leaf again each time (older entries go stale, and a queue mostly stale is
    rebuilt): after hundreds of them eviction still takes the least recently used leaf first, a parent
    left a leaf by its last use, and every block comes back."""
    pool = BlockPool(8, page_size=1)
    radix = RadixCache(pool)
    a, b = pool.allocate(2), pool.allocate(2)
    radix.insert([1, 2], a)
    radix.insert([5, 6], b)
    pool.free(a + b)
    for _ in range(300):
        radix.match([1, 2])
    radix.match([5, 6])  # [5, 6] is the most recent now
    assert radix.evict(1) == 1 and radix.match([1, 2]) == ([a[0]], 1)  # [1, 2]'s leaf went first
    assert radix.evict(1) == 1 and radix.match([5, 6]) == ([b[0]], 1)  # [1], a leaf now, was just used: [5, 6]'s leaf goes
    assert radix.clear() == 2 and pool.num_free == 8


def test_radix_reclaim_is_all_or_nothing() -> None:
    pool = BlockPool(4, page_size=2)
    radix = RadixCache(pool)
    blocks = pool.allocate(3)
    radix.insert([1, 2, 3, 4, 5, 6], blocks)
    pool.free(blocks[1:])  # the sequence keeps only its first block
    assert radix.evictable_blocks() == 2
    assert radix.reclaim(3) == 0 and radix.num_blocks == 3  # 3 > 2 evictable: nothing goes
    assert radix.reclaim(2) == 2 and radix.num_blocks == 1 and pool.num_free == 3
