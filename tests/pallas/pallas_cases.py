"""Shared test base: random attention problems drawn by hypothesis, and the check against the reference.

Every implementation of an op must pass the same cases; tests pick the implementations that can run
here (Pallas kernels in interpret mode on CPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from zgen.pallas import flash_attention, paged_attention
from zgen.pallas.paged_attention.layouts import KVPages, quantize

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
# Tolerances against the f32 reference: bf16 rounds probabilities before the value matmul.
TOLERANCE = {"bf16": 3e-2, "f32": 2e-4}


def assert_close(actual: jax.Array, expected: jax.Array, dtype: str) -> None:
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@dataclasses.dataclass(frozen=True)
class PagedCase:
    q: jax.Array  # [B, T, H, D]
    k_pages: KVPages
    v_pages: KVPages
    block_tables: jax.Array
    q_positions: jax.Array  # [B, T]; -1 = padding
    page_mask: jax.Array | None
    dtype: str
    fmt: str
    soft_cap: float | None
    sliding_window: int | None

    def run(self, implementation: str, **options: object) -> jax.Array:
        """The op under jit: one compile is much cheaper on CPU than eager op-by-op dispatch."""

        def call(q: jax.Array, k: KVPages, v: KVPages, tables: jax.Array, q_pos: jax.Array, mask: jax.Array | None) -> jax.Array:
            return paged_attention(
                q, k, v, tables, q_pos, page_mask=mask, soft_cap=self.soft_cap,
                sliding_window=self.sliding_window, implementation=implementation, **options,  # type: ignore[arg-type]
            )

        return jax.jit(call)(self.q, self.k_pages, self.v_pages, self.block_tables, self.q_positions, self.page_mask)


@st.composite
def paged_cases(
    draw: st.DrawFn,
    formats: tuple[str, ...] = ("native", "fp8", "q4", "q3"),
    page_options: bool = True,
    max_queries: int = 1,
    page_masks: bool = True,
) -> PagedCase:
    """A random problem: each row holds ``length`` tokens and its queries are the last ``T`` of them
    (decode when T = 1, a prefill chunk after a cached prefix otherwise), rows shorter than T padded
    with position -1. ``page_options=False`` leaves out page masks and sliding windows,
    ``page_masks=False`` page masks only."""
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))  # 3: SmolLM2's 9 query heads over 3 kv heads
    head_dim = draw(st.sampled_from([64, 128]))
    page_size = draw(st.sampled_from([16, 32]))
    pages_per_seq = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    fmt = draw(st.sampled_from(formats))
    capacity = pages_per_seq * page_size
    # Lengths concentrate on the edges: empty, one token, page boundaries, full.
    edge = st.sampled_from(sorted({0, 1, page_size - 1, page_size, page_size + 1, capacity}))
    lengths = draw(st.lists(st.one_of(edge, st.integers(0, capacity)).map(lambda n: min(n, capacity)), min_size=batch, max_size=batch))
    num_queries = draw(st.integers(1, max_queries))
    masked = page_options and page_masks and draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    soft_cap = draw(st.sampled_from([None, None, 5.0]))
    sliding_window = draw(st.sampled_from([None, None, 1, page_size + 3])) if page_options else None

    rng = np.random.default_rng(seed)
    num_pages = batch * pages_per_seq + 2
    shape = (kv_heads, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = jnp.asarray(rng.standard_normal((batch, num_queries, kv_heads * group, head_dim)), DTYPES[dtype])
    q_positions = np.asarray(lengths)[:, None] - num_queries + np.arange(num_queries)[None, :]
    tables = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    page_mask = jnp.asarray(rng.random((batch, pages_per_seq)) < 0.7) if masked else None
    if fmt == "native":
        k_pages, v_pages = k.astype(DTYPES[dtype]), v.astype(DTYPES[dtype])
    else:
        k_pages, v_pages = quantize(k, fmt), quantize(v, fmt)  # type: ignore[arg-type]
    return PagedCase(
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        block_tables=jnp.asarray(tables, jnp.int32),
        q_positions=jnp.asarray(np.maximum(q_positions, -1), jnp.int32),
        page_mask=page_mask,
        dtype=dtype,
        fmt=fmt,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
    )


@dataclasses.dataclass(frozen=True)
class FlashCase:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    lengths: jax.Array | None
    dtype: str
    causal: bool
    soft_cap: float | None
    sliding_window: int | None

    def run(self, implementation: str) -> jax.Array:
        def call(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array | None) -> jax.Array:
            return flash_attention(
                q, k, v, lengths=lengths, causal=self.causal, soft_cap=self.soft_cap,
                sliding_window=self.sliding_window, implementation=implementation,
            )

        return jax.jit(call)(self.q, self.k, self.v, self.lengths)


@st.composite
def flash_cases(draw: st.DrawFn, max_len: int = 80) -> FlashCase:
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([64, 128]))
    seq = draw(st.integers(1, max_len))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    ragged = draw(st.booleans())
    lengths = draw(st.lists(st.integers(0, seq), min_size=batch, max_size=batch)) if ragged else None
    causal = draw(st.sampled_from([True, True, False]))
    soft_cap = draw(st.sampled_from([None, None, 5.0]))
    sliding_window = draw(st.sampled_from([None, None, 1, 17]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), DTYPES[dtype])

    return FlashCase(
        q=normal(batch, seq, kv_heads * group, head_dim),
        k=normal(batch, seq, kv_heads, head_dim),
        v=normal(batch, seq, kv_heads, head_dim),
        lengths=None if lengths is None else jnp.asarray(lengths, jnp.int32),
        dtype=dtype,
        causal=causal,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
    )
