from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from pallas_cases import DTYPES, PagedCase, assert_close, paged_cases

from zgen.errors import ConfigError
from zgen.pallas import paged_attention, paged_decode_attention
from zgen.pallas.common import platform
from zgen.pallas.paged_attention.common import split_pages, visible_pages
from zgen.pallas.paged_attention.layouts import Fp8Pages, KeyCalibration, dequantize, hadamard, quantize
from zgen.rope import apply_rope

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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("implementation", sorted(EXAMPLES))
def test_query_chunks_match_reference(implementation: str, fmt: str) -> None:
    """Several queries per row at their own positions (a prefill chunk after a cached prefix, padded
    rows): each sees exactly the keys up to its position."""

    @settings(max_examples=EXAMPLES[implementation], deadline=None, derandomize=True)
    @given(paged_cases(formats=(fmt,), max_queries=40))
    def check(case: PagedCase) -> None:
        assert_close(case.run(implementation), case.run("reference"), case.dtype)

    check()


@pytest.mark.parametrize("coded", [False, True], ids=["plain", "coded"])
def test_gathered_matches_reference(coded: bool) -> None:
    """The gather-then-flash backend (long prefill chunks on the GPU): every format, windows, caps,
    padded rows; keys decoded from their coding when they have one."""

    @settings(max_examples=6, deadline=None, derandomize=True)
    @given(st.data())
    def check(data: st.DataObject) -> None:
        case: PagedCase = data.draw(paged_cases(max_queries=40, page_masks=False))
        kv_heads = jax.tree_util.tree_leaves(case.k_pages)[0].shape[0]
        options = {"key_calibration": data.draw(key_calibrations(kv_heads, case.q.shape[-1]))} if coded else {}
        assert_close(case.run("gathered", **options), case.run("reference", **options), case.dtype)

    check()


@pytest.mark.parametrize("rows_per_copy", [1, 2])
def test_gathered_in_groups_of_rows_matches_reference(rows_per_copy: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose copy exceeds the cap is gathered a group of rows at a time (a last group padded
    when the rows do not divide): the same attention."""
    from zgen.pallas.paged_attention import gathered

    @settings(max_examples=4, deadline=None, derandomize=True)
    @given(paged_cases(formats=("native", "q4"), max_queries=40, page_masks=False))
    def check(case: PagedCase) -> None:
        row_bytes = gathered.gathered_bytes(1, case.block_tables.shape[1], case.k_pages, case.q.dtype)
        monkeypatch.setattr(gathered, "MAX_GATHER_BYTES", rows_per_copy * row_bytes)
        assert_close(case.run("gathered"), case.run("reference"), case.dtype)

    check()


def test_a_gpu_gathers_long_chunks_while_one_rows_copy_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's choice: long query chunks without a page mask gather whatever the batch (it goes a
    group of rows at a time), unless one row's copy alone exceeds the cap."""
    from zgen.pallas.paged_attention import api, gathered

    monkeypatch.setattr(api, "platform", lambda: "gpu")
    _, k, _, _, _ = _dense_problem()
    cap = gathered.MAX_GATHER_BYTES
    long_chunk = gathered.MIN_QUERIES
    assert api.default_implementation(k, False, None, num_queries=long_chunk, gathered_row_bytes=cap) == "gathered"
    assert api.default_implementation(k, False, None, num_queries=long_chunk, gathered_row_bytes=cap + 1) == "triton"
    assert api.default_implementation(k, True, None, num_queries=long_chunk, gathered_row_bytes=1) == "triton"
    assert api.default_implementation(k, False, None, num_queries=long_chunk - 1, gathered_row_bytes=1) == "triton"

    # paged_attention asks about one row: a batch of two over the cap still gathers (in two groups).
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, long_chunk, 4, 64)), jnp.float32)
    tables = jnp.asarray([[0, 1, 2, 3], [4, 5, 1, 0]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(long_chunk, dtype=jnp.int32), (2, long_chunk))
    monkeypatch.setattr(gathered, "MAX_GATHER_BYTES", gathered.gathered_bytes(1, tables.shape[1], k, q.dtype))
    taken: list[str] = []
    gather = gathered.paged_attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        taken.append("gathered")
        return gather(*args, **kwargs)

    monkeypatch.setattr(gathered, "paged_attention", spy)
    out = paged_attention(q, k, k, tables, positions)
    assert taken == ["gathered"]
    np.testing.assert_allclose(out, paged_attention(q, k, k, tables, positions, implementation="reference"), atol=1e-5)


def test_gathered_refuses_page_masks() -> None:
    q, k, v, tables, lengths = _dense_problem()
    with pytest.raises(ConfigError, match="page_mask"):
        paged_decode_attention(q, k, v, tables, lengths, page_mask=jnp.ones(tables.shape, bool), implementation="gathered")


def _triton_in_splits(case: PagedCase, num_splits: int) -> jax.Array:
    """The interpreted Triton kernel on ``case``'s visible pages, in ``num_splits`` splits."""
    from zgen.pallas.paged_attention import triton

    page_size = jax.tree_util.tree_leaves(case.k_pages)[0].shape[2]
    pages = visible_pages(case.block_tables, case.q_positions, case.page_mask, page_size, case.sliding_window)
    return triton.paged_attention(
        case.q, case.k_pages, case.v_pages, jnp.where(pages, case.block_tables, 0), case.q_positions, pages,
        scale=case.q.shape[-1] ** -0.5, soft_cap=case.soft_cap, sliding_window=case.sliding_window,
        interpret=True, num_splits=num_splits,
    )


def test_triton_splits_match_reference() -> None:
    """Query chunks whose visible slots straddle split boundaries."""

    @settings(max_examples=3, deadline=None, derandomize=True)
    @given(paged_cases(formats=("native", "q4"), max_queries=20))
    def check(case: PagedCase) -> None:
        assert_close(_triton_in_splits(case, 3), case.run("reference"), case.dtype)

    check()


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_decode_reads_query_groups_from_the_rows_heads(num_splits: int) -> None:
    """A decode step's kernel loads each kv head's query group itself; with one split it writes the
    finished rows, with more it leaves partials to merge. Groups of any size, empty rows included."""

    @settings(max_examples=4, deadline=None, derandomize=True)
    @given(paged_cases(formats=("native", "q4")))
    def check(case: PagedCase) -> None:
        got = _triton_in_splits(case, num_splits)
        assert got.dtype == case.q.dtype
        assert_close(got, case.run("reference"), case.dtype)

    check()


def test_quantized_pages_split_into_shorter_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough programs for the GPU already, quantized pages still split into runs of at most
    QUANTIZED_SPLIT_PAGES pages (their loop is latency-bound); bf16 pages keep the longer runs."""
    from zgen.pallas.paged_attention import triton

    tables, visible = jnp.zeros((64, 512), jnp.int32), jnp.ones((64, 512), bool)
    assert split_pages(tables, visible, 64 * 8, None)[0] == 256
    assert split_pages(tables, visible, 64 * 8, None, 128)[0] == 128
    longest: dict[str, int | None] = {}
    for fmt in ("native", "q4"):
        k = jnp.zeros((2, 8, 16, 64), jnp.float32)
        pages = k.astype(jnp.bfloat16) if fmt == "native" else quantize(k, "q4")

        def spy(*args: Any, fmt: str = fmt) -> Any:
            longest[fmt] = args[4]
            return split_pages(*args)

        monkeypatch.setattr(triton, "split_pages", spy)
        q = jnp.zeros((2, 1, 4, 64), jnp.bfloat16)
        block_tables = jnp.zeros((2, 4), jnp.int32)
        jax.eval_shape(
            lambda q, t: triton.paged_attention(
                q, pages, pages, t, jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 4), bool), scale=0.125, soft_cap=None,
                sliding_window=None, interpret=True,
            ),
            q, block_tables,
        )
    assert longest == {"native": None, "q4": triton.QUANTIZED_SPLIT_PAGES}


def test_query_chunk_equals_decoding_token_by_token() -> None:
    """A chunk of queries gives what one-token decode gives at each of its positions."""
    q, k, v, tables, _ = _dense_problem()
    chunk = jnp.asarray(np.random.default_rng(3).standard_normal((2, 6, 4, 64)), jnp.float32)
    positions = jnp.asarray([[30, 31, 32, 33, 34, 35], [10, 11, 12, 13, -1, -1]], jnp.int32)
    for impl in ("reference", "xla", "triton"):
        out = paged_attention(chunk, k, v, tables, positions, implementation=impl)
        for t in range(6):
            one = paged_decode_attention(chunk[:, t], k, v, tables, positions[:, t] + 1, implementation=impl)
            np.testing.assert_allclose(out[:, t], one, atol=2e-5)
        assert np.all(np.asarray(out[1, 4:]) == 0)


def test_decode_kernels_refuse_query_chunks() -> None:
    q, k, v, tables, _ = _dense_problem()
    with pytest.raises(ConfigError, match="decode kernel"):
        paged_attention(jnp.stack([q, q], axis=1), k, v, tables, jnp.asarray([[3, 4], [5, 6]]), implementation="mosaic_gpu")


@st.composite
def key_calibrations(draw: st.DrawFn, kv_heads: int, head_dim: int) -> KeyCalibration:
    """A random key calibration: centres, sinks, per-channel scales and RoPE frequencies."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    base = draw(st.sampled_from([10_000.0, 100_000.0]))
    center, sink = (jnp.asarray(3 * rng.standard_normal((kv_heads, head_dim)), jnp.float32) for _ in range(2))
    scale = jnp.asarray(rng.uniform(0.25, 4.0, (kv_heads, head_dim)), jnp.float32)
    return KeyCalibration(center, sink, scale, jnp.asarray(base ** (-np.arange(0, head_dim, 2) / head_dim), jnp.float32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("implementation", sorted(EXAMPLES))
def test_coded_keys_match_reference(implementation: str, fmt: str) -> None:
    """Keys coded with a calibration: the kernels (query folded into the coding, the centre's share
    added per page) give what the reference gives by decoding every key."""

    @settings(max_examples=EXAMPLES[implementation], deadline=None, derandomize=True)
    @given(st.data())
    def check(data: st.DataObject) -> None:
        case: PagedCase = data.draw(paged_cases(formats=(fmt,), max_queries=12))
        kv_heads = jax.tree_util.tree_leaves(case.k_pages)[0].shape[0]
        calibration = data.draw(key_calibrations(kv_heads, case.q.shape[-1]))
        assert_close(case.run(implementation, key_calibration=calibration), case.run("reference", key_calibration=calibration), case.dtype)

    check()


def test_reference_decodes_each_key_at_its_position() -> None:
    """The reference against a hand-built one: ``hadamard(code) / scale`` plus the key's centre (the
    sink's at position 0) rotated to its position, page index * page_size + offset."""
    q, k, v, tables, lengths = _dense_problem()
    rng = np.random.default_rng(1)
    inv_freq = jnp.asarray(10_000.0 ** (-np.arange(0, 64, 2) / 64), jnp.float32)
    calibration = KeyCalibration(*(jnp.asarray(rng.uniform(0.5, 2.0, (2, 64)), jnp.float32) for _ in range(3)), inv_freq)
    kq, vq = quantize(k, "q4"), quantize(v, "q4")
    out = paged_decode_attention(q, kq, vq, tables, lengths, key_calibration=calibration, implementation="reference")
    stored_k, stored_v = dequantize(kq, jnp.float32), dequantize(vq, jnp.float32)
    for b in range(2):
        n = int(lengths[b])
        coded = stored_k[:, tables[b]].reshape(2, -1, 64)[:, :n]
        pos = jnp.arange(n)
        shift = jnp.where((pos == 0)[None, :, None], calibration.sink[:, None], calibration.center[:, None])
        keys = hadamard(coded) / calibration.scale[:, None] + apply_rope(shift, pos, inv_freq)
        vals = stored_v[:, tables[b]].reshape(2, -1, 64)[:, :n]
        w = jax.nn.softmax(jnp.einsum("kgd,ktd->kgt", q[b].reshape(2, 2, 64), keys) / 8.0, axis=-1)
        np.testing.assert_allclose(out[b], jnp.einsum("kgt,ktd->kgd", w, vals).reshape(4, 64), atol=1e-5)


@pytest.mark.parametrize("d", [16, 64, 96])
def test_hadamard_is_sylvesters_orthonormal_matrix_blockwise(d: int) -> None:
    """The fast transform equals the block-diagonal Sylvester matrix (blocks of the largest power of two
    dividing d), and applying it twice gives the input back."""
    block = d & -d
    sylvester = np.ones((1, 1))
    while sylvester.shape[0] < block:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    matrix = np.kron(np.eye(d // block), sylvester / np.sqrt(block))
    x = np.random.default_rng(0).standard_normal((3, d)).astype(np.float32)
    np.testing.assert_allclose(hadamard(jnp.asarray(x)), x @ matrix.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hadamard(hadamard(jnp.asarray(x))), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["mosaic_gpu", "mosaic_tpu"])
def test_backends_that_cannot_read_coded_keys_refuse_them(implementation: str) -> None:
    q, k, v, tables, lengths = _dense_problem()
    with pytest.raises(ConfigError, match="cannot read coded keys"):
        paged_decode_attention(
            q, k, v, tables, lengths, key_calibration=KeyCalibration.identity(2, 64), implementation=implementation
        )


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
    with pytest.raises(ConfigError, match="unknown paged attention implementation"):
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


@st.composite
def append_cases(draw: st.DrawFn, fp8: bool) -> tuple[tuple[Any, ...], dict[str, Any], str]:
    """One decode token per row over filled pages (plain or fp8) in a shuffled pool: rows at the first
    slot, a page edge, the table's last slot, anywhere, or padding (-1); an unallocated (-1) table
    entry past each row's pages; head groups of any size (SmolLM2 has 3)."""
    batch, kv_heads = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    group, head_dim = draw(st.sampled_from([1, 3, 4]), label="group"), draw(st.sampled_from([32, 64]))
    page_size, pps, dtype = 16, draw(st.sampled_from([2, 3])), draw(st.sampled_from(sorted(DTYPES)))
    slots = page_size * pps
    edge = st.sampled_from([-1, 0, 15, 16, slots - 1])
    positions = draw(st.lists(st.one_of(edge, st.integers(-1, slots - 1)), min_size=batch, max_size=batch))
    options = dict(
        sliding_window=draw(st.sampled_from([None, 5])), soft_cap=draw(st.sampled_from([None, 5.0])),
        num_splits=draw(st.sampled_from([None, 1, 2])),
        inv_freq=draw(st.sampled_from([None, 10_000.0 ** (-np.arange(0, head_dim, 2) / head_dim)])),
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    num_pages = batch * pps + 1
    tables = rng.permutation(num_pages)[: batch * pps].reshape(batch, pps)
    for row, pos in enumerate(positions):  # the page after the one written is not allocated yet
        tables[row, max(pos, 0) // page_size + 1 :] = -1

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), DTYPES[dtype])

    def pool() -> Any:
        pages = normal(kv_heads, num_pages, page_size, head_dim)
        return quantize(pages, "fp8") if fp8 else pages

    arrays = (
        normal(batch, 1, kv_heads * group, head_dim), normal(batch, 1, kv_heads, head_dim), normal(batch, 1, kv_heads, head_dim),
        pool(), pool(), jnp.asarray(tables, jnp.int32), jnp.asarray(positions, jnp.int32)[:, None],
    )
    return arrays, options, dtype


@pytest.mark.parametrize("fp8", [False, True])
def test_append_decode_matches_rotate_write_then_attend(fp8: bool) -> None:
    """The paged one-kernel decode step (interpreted on a CPU, compiled on a GPU) stores what RoPE and a page write store (to the
    last bit without rotation, within one rounding with it) -- nothing for padding rows -- and attends as the reference does over the written pages, split or finished."""
    from zgen.pallas.paged_attention import append_and_attend, triton

    @settings(max_examples=8, deadline=None, derandomize=True)
    @given(append_cases(fp8))
    def check(case: tuple[tuple[Any, ...], dict[str, Any], str]) -> None:
        arrays, options, dtype = case
        window, cap, inv_freq = options["sliding_window"], options["soft_cap"], options["inv_freq"]
        inv_freq = None if inv_freq is None else jnp.asarray(inv_freq, jnp.float32)
        expected = append_and_attend(*arrays, inv_freq=inv_freq, sliding_window=window, soft_cap=cap, implementation="reference")
        kernel = functools.partial(
            triton.append_decode_attention, scale=arrays[0].shape[-1] ** -0.5, interpret=platform() == "cpu",
            **{**options, "inv_freq": inv_freq},
        )
        out, k, v = jax.jit(kernel)(*arrays)
        # A rotated key may round the other way in bf16; an fp8 token's scale may differ in its last bit
        # (XLA may divide by a reciprocal), and a code on a rounding boundary then by one step (2**-3)
        assert isinstance(k, Fp8Pages) == fp8
        for got, want, rotated in ((k, expected[1], inv_freq is not None), (v, expected[2], False)):
            rounding = 2**-3 if fp8 else (2**-7 if dtype == "bf16" else 1e-6) if rotated else 0
            held, wanted = (np.asarray(dequantize(pages, jnp.float32)) for pages in (got, want))
            np.testing.assert_allclose(held, wanted, rtol=rounding, atol=rounding)
            assert np.mean(held != wanted) <= (0.02 if rounding else 0.0)
        assert_close(out, expected[0], dtype)
        padding = np.asarray(arrays[6][:, 0]) < 0
        assert not np.any(np.asarray(out, np.float32)[padding])

    check()


def test_append_and_attend_takes_plain_pages_only() -> None:
    """Layouts other than plain and fp8 are written by the page write and read by paged_attention; one
    decode token a row."""
    from zgen.pallas.paged_attention import append_and_attend

    q, kv = jnp.zeros((1, 1, 2, 32)), jnp.zeros((1, 1, 1, 32))
    pages, tables, positions = jnp.zeros((1, 2, 16, 32)), jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ConfigError, match="plain float or fp8 pages"):
        append_and_attend(q, kv, kv, quantize(pages, "q4"), quantize(pages, "q4"), tables, positions)
    with pytest.raises(ValueError, match="one token per row"):
        append_and_attend(jnp.zeros((1, 2, 2, 32)), kv, kv, pages, pages, tables, jnp.zeros((1, 2), jnp.int32))
