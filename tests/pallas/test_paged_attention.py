from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from pallas_cases import PagedCase, assert_close, paged_cases

from zgen.errors import ConfigError
from zgen.pallas import paged_decode_attention
from zgen.pallas.common import platform
from zgen.pallas.paged_attention.layouts import quantize

# Examples per (implementation, page format): interpreted kernels compile a program per shape.
EXAMPLES = {"xla": 3, "triton": 2}
FORMATS = ("native", "fp8", "q4", "q3")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("implementation", sorted(EXAMPLES))
def test_matches_reference(implementation: str, fmt: str) -> None:
    @settings(max_examples=EXAMPLES[implementation], deadline=None, derandomize=True)
    @given(paged_cases(formats=(fmt,)))
    def check(case: PagedCase) -> None:
        assert_close(case.run(implementation), case.run("reference"), case.dtype)

    check()


@pytest.mark.skipif(platform() == "gpu", reason="the TPU interpreter is exercised on CPU")
def test_mosaic_tpu_matches_reference() -> None:
    """jax's TPU kernel, interpreted on CPU (slowly: one problem), for inputs it supports.

    It rounds through bf16 internally even for f32 inputs, hence the bf16 tolerance.
    """
    q, k, v, tables, _ = _dense_problem()
    lengths = jnp.asarray([0, 37], jnp.int32)
    got = paged_decode_attention(q, k, v, tables, lengths, soft_cap=5.0, implementation="mosaic_tpu")
    expected = paged_decode_attention(q, k, v, tables, lengths, soft_cap=5.0, implementation="reference")
    assert_close(got, expected, "bf16")


def test_mosaic_tpu_refuses_what_it_cannot_mask() -> None:
    q, k, v, tables, lengths = _dense_problem()
    with pytest.raises(ConfigError):
        paged_decode_attention(q, k, v, tables, lengths, sliding_window=4, implementation="mosaic_tpu")


def _dense_problem(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((2, 6, 16, 64)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 6, 16, 64)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    tables = jnp.asarray([[4, 1, 3], [0, 5, 2]], jnp.int32)
    return q, k, v, tables, jnp.asarray([40, 17], jnp.int32)


def test_reference_is_softmax_attention_over_the_sequence() -> None:
    q, k, v, tables, lengths = _dense_problem()
    out = paged_decode_attention(q, k, v, tables, lengths, implementation="reference")
    for b in range(2):
        keys = k[:, tables[b]].reshape(2, -1, 64)[:, : lengths[b]]
        vals = v[:, tables[b]].reshape(2, -1, 64)[:, : lengths[b]]
        qg = q[b].reshape(2, 2, 64)
        w = jax.nn.softmax(jnp.einsum("kgd,ktd->kgt", qg, keys) / 8.0, axis=-1)
        np.testing.assert_allclose(out[b], jnp.einsum("kgt,ktd->kgd", w, vals).reshape(4, 64), atol=1e-5)


def test_masked_pages_are_never_read() -> None:
    q, k, v, tables, lengths = _dense_problem()
    mask = jnp.asarray([[True, False, True], [True, True, True]])
    poisoned = tables.at[0, 1].set(-7)  # a dropped page whose table entry is garbage
    expected = paged_decode_attention(q, k, v, tables, lengths, page_mask=mask, implementation="reference")
    for impl in ("xla", "triton"):
        got = paged_decode_attention(q, k, v, poisoned, lengths, page_mask=mask, implementation=impl)
        np.testing.assert_allclose(got, expected, atol=2e-4)
        assert np.all(np.isfinite(np.asarray(got)))


@pytest.mark.parametrize("implementation", ["reference", "xla", "triton"])
def test_empty_sequences_give_zeros(implementation: str) -> None:
    q, k, v, tables, _ = _dense_problem()
    out = paged_decode_attention(q, k, v, tables, jnp.asarray([0, 5], jnp.int32), page_mask=jnp.asarray([[True] * 3, [False] * 3]), implementation=implementation)
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("fmt", ["fp8", "q4", "q3"])
def test_works_under_jit_with_quantized_pages(fmt: str) -> None:
    q, k, v, tables, lengths = _dense_problem()
    kq, vq = quantize(k, fmt), quantize(v, fmt)  # type: ignore[arg-type]
    fn = jax.jit(lambda q, kq, vq, t, n: paged_decode_attention(q, kq, vq, t, n, implementation="xla"))
    expected = paged_decode_attention(q, kq, vq, tables, lengths, implementation="reference")
    np.testing.assert_allclose(fn(q, kq, vq, tables, lengths), expected, atol=2e-4)


def test_rejects_mismatched_layouts() -> None:
    q, k, v, tables, lengths = _dense_problem()
    with pytest.raises(ValueError):
        paged_decode_attention(q, quantize(k, "q4"), v, tables, lengths)
    with pytest.raises(ValueError):
        paged_decode_attention(q, k, v, tables, lengths, implementation="cuda")


def test_triton_reads_f32_q4_scales() -> None:
    """The Triton kernel widens 2-byte metadata to u32 pairs; 4-byte (f32) scales take the direct path."""
    from zgen.pallas.paged_attention.layouts import quantize_q4

    q, k, v, tables, lengths = _dense_problem()
    kq, vq = quantize_q4(k, scale_dtype=jnp.float32), quantize_q4(v, group_size=16, scale_dtype=jnp.float32)
    kb, vb = quantize_q4(k), quantize_q4(v, group_size=16)
    for kk, vv in ((kq, vq), (kb, vb)):
        got = paged_decode_attention(q, kk, vv, tables, lengths, implementation="triton")
        expected = paged_decode_attention(q, kk, vv, tables, lengths, implementation="reference")
        np.testing.assert_allclose(got, expected, atol=2e-4)
