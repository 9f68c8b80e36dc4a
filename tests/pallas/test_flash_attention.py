from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pallas_cases import DTYPES, FlashCase, assert_close, flash_cases

from zgen.cache.tensor import causal_attention
from zgen.pallas import append_and_attend, flash_attention
from zgen.pallas.common import platform
from zgen.pallas.flash_attention import triton, xla

IMPLEMENTATIONS = {"xla": 10, "triton": 5}


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_matches_reference(implementation: str) -> None:
    @settings(max_examples=IMPLEMENTATIONS[implementation], deadline=None, derandomize=True)
    @given(flash_cases())
    def check(case: FlashCase) -> None:
        assert_close(case.run(implementation), case.run("reference"), case.dtype)

    check()


SMALL_BLOCKS = {"xla": (xla.flash_attention, {}), "triton": (triton.flash_attention, {"interpret": True})}


@pytest.mark.parametrize("implementation", sorted(SMALL_BLOCKS))
def test_small_blocks_match_reference(implementation: str) -> None:
    """Several query and key blocks, so the block loop bounds (causal, window, lengths) are exercised."""

    @settings(max_examples=6, deadline=None, derandomize=True)
    @given(flash_cases(max_len=70))
    def check(case: FlashCase) -> None:
        b, _, h, d = case.q.shape
        lengths = case.lengths if case.lengths is not None else jnp.full((b,), case.k.shape[1], jnp.int32)
        impl, extra = SMALL_BLOCKS[implementation]
        fn = functools.partial(
            impl, causal=case.causal, sliding_window=case.sliding_window,
            soft_cap=case.soft_cap, scale=d**-0.5, block_q=16, block_k=32, **extra,
        )
        assert_close(jax.jit(fn)(case.q, case.k, case.v, lengths), case.run("reference"), case.dtype)

    check()


def test_reference_is_causal_softmax_attention() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 9, 2, 64)), jnp.float32) for _ in range(3))
    out = flash_attention(q, k, v, implementation="reference")
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    logits = jnp.where(jnp.tril(jnp.ones((9, 9), bool)), logits, -jnp.inf)
    expected = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_padded_queries_are_zero() -> None:
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 12, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 12, 2, 64)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([12, 5], jnp.int32)
    for impl in ("reference", "xla", "triton"):
        out = flash_attention(q, k, v, lengths=lengths, implementation=impl)
        assert np.all(np.asarray(out[1, 5:]) == 0)
        # The valid prefix does not depend on what sits in the padding.
        out2 = flash_attention(q, k.at[1, 5:].set(1e3), v.at[1, 5:].set(1e3), lengths=lengths, implementation=impl)
        np.testing.assert_allclose(out2[1, :5], out[1, :5], atol=1e-5)


def test_mosaic_gpu_covers_only_plain_causal_self_attention() -> None:
    """zgen's Hopper kernel (GPU-only) is picked only where it fits: causal bf16/f16 from slot 0,
    head_dim 64 or 128, no window, cap or ``q_positions``."""
    from zgen.pallas.flash_attention import mosaic_gpu

    q = jnp.zeros((1, 8, 4, 128), jnp.bfloat16)
    k = jnp.zeros((1, 8, 2, 128), jnp.bfloat16)
    assert mosaic_gpu.supports(q, k, causal=True, sliding_window=None, soft_cap=None)
    assert mosaic_gpu.supports(q.astype(jnp.float16), k.astype(jnp.float16), causal=True, sliding_window=None, soft_cap=None)
    assert not mosaic_gpu.supports(q, k, causal=False, sliding_window=None, soft_cap=None)
    assert not mosaic_gpu.supports(q, k, causal=True, sliding_window=4, soft_cap=None)
    assert not mosaic_gpu.supports(q, k, causal=True, sliding_window=None, soft_cap=30.0)
    assert not mosaic_gpu.supports(q.astype(jnp.float32), k.astype(jnp.float32), causal=True, sliding_window=None, soft_cap=None)
    assert not mosaic_gpu.supports(q, k.astype(jnp.float16), causal=True, sliding_window=None, soft_cap=None)
    assert not mosaic_gpu.supports(q[..., :32], k[..., :32], causal=True, sliding_window=None, soft_cap=None)
    wide = jnp.zeros((1, 8, 4, 256), jnp.bfloat16)
    assert not mosaic_gpu.supports(wide, wide[:, :, :2], causal=True, sliding_window=None, soft_cap=None)
    positions = jnp.zeros((1, 8), jnp.int32)
    assert not mosaic_gpu.supports(q, k, causal=True, sliding_window=None, soft_cap=None, q_positions=positions)


@pytest.mark.skipif(platform() != "gpu", reason="Mosaic GPU kernels run compiled only: the CPU interpreter has no WGMMA transpose")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("t", "heads", "kv_heads", "head_dim"), [(300, 8, 2, 128), (1024, 4, 4, 64), (130, 32, 8, 128)])
def test_mosaic_gpu_matches_reference(dtype: str, t: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """Several tiles and key blocks, a ragged batch (the second row padded), GQA."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((2, t, heads, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, t, kv_heads, head_dim)), dtype) for _ in range(2))
    lengths = jnp.asarray([t, t // 2 + 1], jnp.int32)
    got = flash_attention(q, k, v, lengths=lengths, implementation="mosaic_gpu")
    assert_close(got, flash_attention(q, k, v, lengths=lengths, implementation="reference"), "bf16")


# -- queries at given positions (a prefill chunk after a cached prefix, decode steps) ----------------


@dataclasses.dataclass(frozen=True)
class PositionedCase:
    """Queries at ``q_positions`` in a buffer of ``S`` key slots, as a KV cache calls the op."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_positions: jax.Array
    lengths: jax.Array | None
    dtype: str
    causal: bool
    soft_cap: float | None
    sliding_window: int | None

    def run(self, implementation: str) -> jax.Array:
        def call(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, lengths: jax.Array | None) -> jax.Array:
            return flash_attention(
                q, k, v, lengths=lengths, q_positions=positions, causal=self.causal, soft_cap=self.soft_cap,
                sliding_window=self.sliding_window, implementation=implementation,
            )

        return jax.jit(call)(self.q, self.k, self.v, self.q_positions, self.lengths)

    def run_kernel(self, kernel: Callable[..., jax.Array], **config: Any) -> jax.Array:
        """A backend function called directly (explicit block shapes)."""
        b, s = self.k.shape[:2]
        lengths = self.lengths if self.lengths is not None else jnp.full((b,), s, jnp.int32)
        fn = functools.partial(
            kernel, causal=self.causal, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
            scale=self.q.shape[-1] ** -0.5, **config,
        )
        return jax.jit(fn)(self.q, self.k, self.v, lengths, self.q_positions)


@st.composite
def positioned_cases(draw: st.DrawFn, max_queries: int = 40, group_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> PositionedCase:
    """Each row's queries at ``offset .. offset + n - 1`` (a cached prefix of ``offset`` slots before
    them), its last ``T - n`` queries padding at position -1; lengths 1 and block edges are favoured."""
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from(group_sizes))
    head_dim = draw(st.sampled_from([64, 128]))
    edges = st.sampled_from([1, 2, 15, 16, 17, 31, 32, 33])
    t = draw(st.one_of(edges, st.integers(1, max_queries)).map(lambda n: min(n, max_queries)))
    capacity = t + draw(st.one_of(st.sampled_from([0, 1, 16, 32, 47]), st.integers(0, 64)))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    rows = []
    for _ in range(batch):
        real = draw(st.integers(0, t)) if draw(st.booleans()) else t
        offset = draw(st.integers(0, capacity - t))
        rows.append([offset + i if i < real else -1 for i in range(t)])
    lengths = (
        draw(st.lists(st.one_of(edges, st.integers(0, capacity)).map(lambda n: min(n, capacity)), min_size=batch, max_size=batch))
        if draw(st.booleans())
        else None
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), DTYPES[dtype])

    return PositionedCase(
        q=normal(batch, t, kv_heads * group, head_dim),
        k=normal(batch, capacity, kv_heads, head_dim),
        v=normal(batch, capacity, kv_heads, head_dim),
        q_positions=jnp.asarray(rows, jnp.int32),
        lengths=None if lengths is None else jnp.asarray(lengths, jnp.int32),
        dtype=dtype,
        causal=draw(st.sampled_from([True, True, False])),
        soft_cap=draw(st.sampled_from([None, None, 5.0])),
        sliding_window=draw(st.sampled_from([None, None, 1, 17])),
    )


POSITIONED_EXAMPLES = {"xla": 10, "triton": 6}


@pytest.mark.parametrize("implementation", sorted(POSITIONED_EXAMPLES))
def test_positioned_queries_match_reference(implementation: str) -> None:
    @settings(max_examples=POSITIONED_EXAMPLES[implementation], deadline=None, derandomize=True)
    @given(positioned_cases())
    def check(case: PositionedCase) -> None:
        assert_close(case.run(implementation), case.run("reference"), case.dtype)

    check()


POSITIONED_KERNELS: dict[str, tuple[Callable[..., jax.Array], dict[str, Any]]] = {
    "xla": (lambda q, k, v, n, pos, **kw: xla.flash_attention(q, k, v, n, q_positions=pos, **kw), {"block_q": 8, "block_k": 16}),
    "triton_prefill": (triton.prefill_attention, {"interpret": True, "block_q": 16, "block_k": 16}),
    "triton_decode": (triton.decode_attention, {"interpret": True, "block_k": 16, "num_splits": 3}),
}


@pytest.mark.parametrize("kernel", sorted(POSITIONED_KERNELS))
def test_positioned_small_blocks_match_reference(kernel: str) -> None:
    """Several key blocks (and decode splits), so the position-bounded block loops are exercised."""
    fn, config = POSITIONED_KERNELS[kernel]

    @settings(max_examples=5, deadline=None, derandomize=True)
    @given(positioned_cases(max_queries=33, group_sizes=(1, 2) if kernel == "triton_decode" else (1, 2, 4)))
    def check(case: PositionedCase) -> None:
        assert_close(case.run_kernel(fn, **config), case.run("reference"), case.dtype)

    check()


def test_reference_positions_are_the_dense_cache_rule() -> None:
    """Slot j is visible to the query at position p iff j <= p (and j > p - window): causal_attention's rule."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 5, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 24, 2, 64)), jnp.float32) for _ in range(2))
    positions = jnp.asarray([[0, 1, 2, 3, 4], [9, 10, 11, 12, 23]], jnp.int32)
    for window in (None, 4):
        expected = causal_attention(q, k, v, positions, sliding_window=window)
        got = flash_attention(q, k, v, q_positions=positions, sliding_window=window, implementation="reference")
        np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("implementation", ["reference", "xla", "triton"])
def test_padding_positions_give_zeros(implementation: str) -> None:
    """Queries at -1 (padding rows of a batch) see no key: zeros, never NaN; one token per row (decode)."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((3, 1, 8, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((3, 32, 2, 64)), jnp.float32) for _ in range(2))
    positions = jnp.asarray([[0], [-1], [31]], jnp.int32)
    out = np.asarray(flash_attention(q, k, v, q_positions=positions, implementation=implementation))
    assert np.all(np.isfinite(out)) and np.all(out[1] == 0)
    np.testing.assert_allclose(out[[0, 2]], np.asarray(causal_attention(q, k, v, positions, sliding_window=None))[[0, 2]], atol=2e-5)


def test_triton_picks_decode_for_few_rows_per_kv_head() -> None:
    """One token of 8 heads over 2 kv heads is 4 rows per kv head: the split-K decode kernel runs."""
    k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = functools.partial(triton.flash_attention, causal=True, sliding_window=None, soft_cap=None, scale=0.1)

    def traced(t: int) -> str:
        return str(jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((2, t, 8, 64), jnp.bfloat16), k, k, n))

    assert "zgen_flash_decode" in traced(1) and "zgen_flash_attention" not in traced(1)
    assert "zgen_flash_attention" in traced(triton.DECODE_MAX_ROWS)


@pytest.mark.parametrize("window", [None, 1, 17, 40])
@pytest.mark.parametrize("kernel", sorted(POSITIONED_KERNELS))
def test_kernels_at_every_offset(kernel: str, window: int | None) -> None:
    """Every prefix length before a 20-query chunk (16-key blocks): each block edge meets each query
    tile edge, where the unmasked interior-block ranges are easiest to get off by one."""
    fn, config = POSITIONED_KERNELS[kernel]
    rng = np.random.default_rng(4)
    t, capacity = 20, 72
    q = jnp.asarray(rng.standard_normal((2, t, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, capacity, 2, 64)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([capacity, capacity - 3], jnp.int32)
    options = dict(causal=True, sliding_window=window, soft_cap=None)
    run = jax.jit(functools.partial(fn, scale=0.125, **options, **config))
    expected = jax.jit(functools.partial(flash_attention, implementation="reference", **options))
    for offset in range(capacity - t + 1):
        positions = jnp.asarray([offset, capacity - t - offset], jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)
        want = expected(q, k, v, lengths=lengths, q_positions=positions)
        np.testing.assert_allclose(run(q, k, v, lengths, positions), want, atol=2e-5, err_msg=f"offset {offset}")


@st.composite
def append_cases(draw: st.DrawFn) -> tuple[tuple[jax.Array, ...], dict[str, Any], str]:
    """One decode token per row over a filled contiguous cache: rows at the first slot, the last, a
    block boundary, anywhere, or padding (-1); head groups of any size (SmolLM2 has 3)."""
    batch, kv_heads = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    group, head_dim = draw(st.sampled_from([1, 3, 4, 8])), draw(st.sampled_from([32, 64]))
    slots, dtype = draw(st.sampled_from([32, 64, 96])), draw(st.sampled_from(sorted(DTYPES)))
    edge = st.sampled_from([-1, 0, 15, 16, slots - 1])
    positions = draw(st.lists(st.one_of(edge, st.integers(-1, slots - 1)), min_size=batch, max_size=batch))
    options = dict(
        sliding_window=draw(st.sampled_from([None, 5])), soft_cap=draw(st.sampled_from([None, 5.0])),
        num_splits=draw(st.sampled_from([None, 1, 2])),
        inv_freq=draw(st.sampled_from([None, 10_000.0 ** (-np.arange(0, head_dim, 2) / head_dim)])),
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    heads = kv_heads * group

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), DTYPES[dtype])

    arrays = (
        normal(batch, 1, heads, head_dim), normal(batch, 1, kv_heads, head_dim), normal(batch, 1, kv_heads, head_dim),
        normal(batch, slots, kv_heads, head_dim), normal(batch, slots, kv_heads, head_dim),
        jnp.asarray(positions, jnp.int32)[:, None],
    )
    return arrays, options, dtype


def test_append_decode_matches_write_then_attend() -> None:
    """The one-kernel decode step (interpreted) stores what RoPE and a write store (to the last bit
    without rotation, within one rounding with it) and attends as the reference does over the written
    cache, split or finished in the kernel, rows at -1 left alone."""

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(append_cases())
    def check(case: tuple[tuple[jax.Array, ...], dict[str, Any], str]) -> None:
        arrays, options, dtype = case
        window, cap, inv_freq = options["sliding_window"], options["soft_cap"], options["inv_freq"]
        inv_freq = None if inv_freq is None else jnp.asarray(inv_freq, jnp.float32)
        expected = append_and_attend(*arrays, inv_freq=inv_freq, sliding_window=window, soft_cap=cap, implementation="reference")
        kernel = functools.partial(
            triton.append_decode_attention, scale=arrays[0].shape[-1] ** -0.5, interpret=True, block_k=16,
            **{**options, "inv_freq": inv_freq},
        )
        out, k, v = jax.jit(kernel)(*arrays)
        rounding = 0 if inv_freq is None else 2 ** -7 if dtype == "bf16" else 1e-6
        np.testing.assert_allclose(np.asarray(k, np.float32), np.asarray(expected[1], np.float32), rtol=rounding, atol=rounding)
        np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(expected[2], np.float32))
        assert_close(out, expected[0], dtype)
        padding = np.asarray(arrays[5][:, 0]) < 0
        assert not np.any(np.asarray(out, np.float32)[padding])

    check()


def test_append_decode_takes_any_multiple_of_16_slots() -> None:
    """Key blocks are the largest power of two dividing the buffer (48 slots: 16), which it updates in
    place; a buffer no 16-slot block divides is refused."""
    rng = np.random.default_rng(3)
    q, kv = jnp.asarray(rng.standard_normal((1, 1, 4, 32)), jnp.float32), jnp.asarray(rng.standard_normal((1, 1, 2, 32)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((1, 48, 2, 32)), jnp.float32)
    positions = jnp.asarray([[40]], jnp.int32)
    expected = append_and_attend(q, kv, kv, cache, cache, positions, implementation="reference")
    got = triton.append_decode_attention(q, kv, kv, cache, cache, positions, sliding_window=None, soft_cap=None, scale=32**-0.5, interpret=True)
    assert_close(got[0], expected[0], "f32")
    with pytest.raises(ValueError, match="16-slot"):
        triton.append_decode_attention(q, kv, kv, cache[:, :40], cache[:, :40], positions, sliding_window=None, soft_cap=None, scale=0.1, interpret=True)
