"""KV storage on CPU: bfloat16 and fp8 leaves of page pools and bfloat16 dense buffers live in integer
containers, and every write is in place."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zgen.cache.formats import empty_pages, kv_format
from zgen.cache.paged_state import PagedKVState
from zgen.cache.tensor import DenseKVState, causal_attention
from zgen.pallas.paged_attention.layouts import BitPages, as_bits, dequantize, float_pages, hadamard

KVH, PAGES, PS, D, H = 2, 37, 4, 32, 4
NARROW = ("bf16", "fp8", "q4", "q3")
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="integer containers are the CPU pools' storage")


def _leaf_shapes(pages: object) -> list[str]:
    """HLO spellings of the pool's leaf shapes (e.g. ``u16[2,37,4,32]``)."""
    names = {"uint8": "u8", "uint16": "u16", "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "f8e4m3fn"}
    return [f"{names[str(leaf.dtype)]}[{','.join(map(str, leaf.shape))}]" for leaf in jax.tree_util.tree_leaves(pages)]


def _state(kv_dtype: str, pages_per_seq: int = 4) -> PagedKVState:
    k, v = (empty_pages(kv_dtype, KVH, PAGES, PS, D) for _ in range(2))
    return PagedKVState((k,), (v,), jnp.arange(pages_per_seq, dtype=jnp.int32)[None] + 3, kv_dtype)


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_narrow_float_leaves_are_stored_as_unsigned_integers(kv_dtype: str) -> None:
    pages = empty_pages(kv_dtype, KVH, PAGES, PS, D)
    assert isinstance(pages, BitPages)
    assert all(leaf.dtype in (jnp.uint8, jnp.uint16, jnp.float32) for leaf in jax.tree_util.tree_leaves(pages))
    layout = float_pages(pages)  # the format's own float layout, as on an accelerator
    want = kv_format(kv_dtype).empty((KVH, PAGES, PS), D)
    assert jax.tree_util.tree_structure(layout) == jax.tree_util.tree_structure(want)
    assert [leaf.dtype for leaf in jax.tree_util.tree_leaves(layout)] == [leaf.dtype for leaf in jax.tree_util.tree_leaves(want)]
    assert pages.head_dim == D


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_fp32_and_fp16_pools_keep_their_float_arrays(kv_dtype: str) -> None:
    assert isinstance(empty_pages(kv_dtype, KVH, PAGES, PS, D), jax.Array)


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_written_tokens_hold_the_quantized_bits(kv_dtype: str) -> None:
    """A write stores exactly what the format's quantizer gives (bit for bit, read through the floats)."""
    state = _state(kv_dtype)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(1, 3, KVH, D)), jnp.float32)
    positions = jnp.array([[0, 5, 9]], jnp.int32)
    written = jax.jit(lambda s: s.write(0, k, k, positions))(state)
    stored = float_pages(written.v[0])  # values: no key coding, only q4/q3's rotation
    fmt = kv_format(kv_dtype)
    want = fmt.quantize(hadamard(k) if fmt.coded else k)
    for slot, position in enumerate((0, 5, 9)):
        page, offset = 3 + position // PS, position % PS
        got_leaves = [np.asarray(leaf[:, page, offset]) for leaf in jax.tree_util.tree_leaves(stored)]
        want_leaves = [np.asarray(leaf[0, slot]) for leaf in jax.tree_util.tree_leaves(want)]
        for got, exp in zip(got_leaves, want_leaves, strict=True):
            assert got.dtype == exp.dtype
            np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(exp).view(np.uint8))
    np.testing.assert_array_equal(
        np.asarray(dequantize(written.v[0], jnp.float32)), np.asarray(dequantize(stored, jnp.float32))
    )


@pytest.mark.parametrize("kv_dtype", ["fp32", *NARROW])
@pytest.mark.parametrize("pages_per_seq", [2, 40])
def test_a_decode_step_updates_the_pool_in_place(kv_dtype: str, pages_per_seq: int) -> None:
    """One compiled step that writes a token and attends over the pages, as the decode loop does,
    aliases the donated pool to its output and never copies or widens a whole pool leaf (XLA:CPU
    widened bf16/fp8 updates to f32, and copied the pool when it fused a hoisted page gather with the write)."""
    state = _state(kv_dtype, pages_per_seq)
    coded = kv_format(kv_dtype).coded

    @partial(jax.jit, donate_argnums=(0,))
    def step(s: PagedKVState, kv: jax.Array, q: jax.Array, positions: jax.Array) -> tuple[PagedKVState, jax.Array]:
        s = s.write(0, kv, kv, positions)
        return s, s.attend(0, q, positions, sliding_window=None)

    kv = jnp.ones((1, 1, KVH, D), jnp.float32)
    q = jnp.ones((1, 1, H, D), jnp.float32)
    hlo = step.lower(state, kv, q, jnp.array([[6]], jnp.int32)).compile().as_text()
    assert "input_output_alias" in hlo
    pool = _leaf_shapes(state.k[0])
    widened = f"f32[{KVH},{PAGES},{PS},{D}]" if not coded and kv_dtype != "fp32" else None
    for line in hlo.splitlines():
        if re.search(r"\bcopy\(", line):
            assert not any(f"= {shape}" in line for shape in pool), line
        if widened is not None:
            assert widened not in line, line


def test_as_bits_leaves_wide_layouts_alone() -> None:
    pages = jnp.zeros((KVH, PAGES, PS, D), jnp.float32)
    assert as_bits(pages) is pages


def test_dense_bf16_buffers_are_written_in_place_and_read_as_bf16() -> None:
    state = DenseKVState.zeros(1, 2, 64, KVH, D, jnp.bfloat16)
    assert state.k[0].dtype == jnp.uint16
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.normal(size=(2, 3, KVH, D)), jnp.float32)
    positions = jnp.array([[0, 1, 2], [5, 6, -1]], jnp.int32)
    write = jax.jit(lambda s, x: s.write(0, x, -x, positions), donate_argnums=(0,))
    hlo = write.lower(state, k).compile().as_text()
    assert "input_output_alias" in hlo and f"f32[2,64,{KVH},{D}]" not in hlo  # no widened copy of the buffer
    written = write(state, k)
    view = written.layer_view(0)
    assert view.k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(view.k[0, :3]), np.asarray(k[0].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(view.v[1, 5:7]), np.asarray((-k[1, :2]).astype(jnp.bfloat16)))
    assert not np.asarray(view.k[1, 7:]).any()  # the padding token at -1 was dropped
    row = written.stored(0, 1, 7)
    np.testing.assert_array_equal(np.asarray(row.k[0]), np.asarray(view.k[1, :7]))
    q = jnp.asarray(rng.normal(size=(2, 1, H, D)), jnp.float32)
    at = jnp.array([[2], [6]], jnp.int32)
    got = written.attend(0, q, at, sliding_window=None)
    want = causal_attention(q, view.k, view.v, at, sliding_window=None)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
