from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from zgen.errors import ConfigError
from zgen.pallas.quantized_matmul import quantized_matmul, supports, triton_mma
from zgen.pallas.quantized_matmul.triton import BYTES_PER_PROGRAM, Launch, launch
from zgen.quantized_weights import QuantizedWeight, WeightQuantization, dequantize, quantize

TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}


@st.composite
def problems(draw: st.DrawFn) -> tuple[jax.Array, QuantizedWeight]:
    """Rows of a decode step against a random int8 or int4 weight: groups from 64 (the narrowest the
    kernel reads) to a whole row (int8's default, several pieces a group), one or several output
    channels a program."""
    bits = draw(st.sampled_from([4, 8]))
    dtype = draw(st.sampled_from(["bfloat16", "float32"]))
    group = draw(st.sampled_from([64, 128] + ([None] if bits == 8 else [])))
    width = draw(st.sampled_from([256, 2304])) if group is None else group * draw(st.sampled_from([2, 4, 6]))
    out = draw(st.sampled_from([16, 48, 64, 192]))
    rows = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    weight = jnp.asarray(rng.standard_normal((out, width)) * width**-0.5, jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, width)), dtype)
    scale_dtype = jnp.float32 if dtype == "float32" else jnp.float16
    return x, quantize(weight, WeightQuantization(bits, group), jnp.dtype(scale_dtype))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(problems())
def test_matches_the_dequantized_product(problem: tuple[jax.Array, QuantizedWeight]) -> None:
    """The kernel (interpreted on CPU) against x @ dequantize(W).T in float32."""
    x, weight = problem
    assert supports(x, weight)
    got = jax.jit(lambda x, w: quantized_matmul(x, w, implementation="triton"))(x, weight)
    expected = x.astype(jnp.float32) @ dequantize(weight).T
    tol = TOLERANCE[str(x.dtype)]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected), atol=tol, rtol=tol)
    assert got.dtype == x.dtype


@pytest.mark.parametrize(("bits", "group", "width", "out", "scale_dtype"), [
    (4, 64, 256, 64, "float16"), (4, 128, 512, 528, "bfloat16"), (4, 64, 1024, 64, "bfloat16"), (8, None, 128, 64, "float16"),
])
def test_one_row_in_bfloat16(bits: int, group: int | None, width: int, out: int, scale_dtype: str) -> None:
    """Batch-1 decode, the kernel's main case (528 int4 outputs: two channels a program; 1024 inputs:
    a loop of two steps of four groups); 2-byte scales read in u32 pairs (int8's single scale per
    row, an odd count, stays as it is)."""
    rng = np.random.default_rng(bits)
    weight = quantize(jnp.asarray(rng.standard_normal((out, width)) * 0.1, jnp.float32), WeightQuantization(bits, group), jnp.dtype(scale_dtype))
    x = jnp.asarray(rng.standard_normal((1, 1, width)), jnp.bfloat16)
    assert supports(x, weight)
    got = quantized_matmul(x, weight)
    expected = x.astype(jnp.float32) @ dequantize(weight).T
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected), atol=2e-2, rtol=2e-2)


def test_launch_settings_and_what_goes_to_xla() -> None:
    """int8 takes 4 output channels a program and int4 16 (fewer where that leaves under 264
    programs), int4 loops over 4 groups a step where the width has them, a long row is split over
    programs (Llama-3-8B's down projection); GGUF's groups of 32 and a fifth row are XLA's."""
    def weight(out: int, width: int, scheme: WeightQuantization) -> QuantizedWeight:
        return quantize(jnp.zeros((out, width), jnp.float32), scheme, jnp.dtype(jnp.float16))

    assert launch(1, weight(48, 1024, WeightQuantization(8))) == Launch(1, 1024, 1)
    assert launch(1, weight(4096, 4096, WeightQuantization(8))) == Launch(4, 1024, 1)
    assert launch(1, weight(4096, 14336, WeightQuantization(8))) == Launch(4, 1024, 1, 2)
    assert launch(4, weight(6144, 4096, WeightQuantization(4))) == Launch(16, 128, 4, 4)
    assert launch(1, weight(4096, 14336, WeightQuantization(4))) == Launch(16, 128, 4, 14)
    assert launch(1, weight(576, 1536, WeightQuantization(4))) == Launch(2, 128, 2)
    assert launch(1, weight(48, 1024, WeightQuantization(4, 32))) is None
    assert launch(5, weight(48, 1024, WeightQuantization(8))) is None


@pytest.mark.parametrize(("bits", "group"), [(4, 64), (8, 128), (8, None)])
def test_a_row_split_over_programs(monkeypatch: pytest.MonkeyPatch, bits: int, group: int | None) -> None:
    """Programs that each read a part of a row (from their own group on), their partial sums added
    outside: a small byte budget splits a small weight as Llama-3-8B's down projection is split."""
    monkeypatch.setitem(BYTES_PER_PROGRAM, bits, 512)
    rng = np.random.default_rng(bits)
    weight = quantize(jnp.asarray(rng.standard_normal((24, 1536)) * 0.05, jnp.float32), WeightQuantization(bits, group), jnp.dtype(jnp.float32))
    x = jnp.asarray(rng.standard_normal((2, 1536)), jnp.float32)
    setting = launch(2, weight)
    assert setting is not None and setting.splits > 1
    got = quantized_matmul(x, weight, implementation="triton")
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ dequantize(weight).T), atol=1e-4, rtol=1e-4)


def test_symmetric_int8_with_offsets_and_leading_axes() -> None:
    """8-bit codes with offsets (a layout the loaders may give) and a [B, T, in] input."""
    rng = np.random.default_rng(1)
    codes = jnp.asarray(rng.integers(-127, 128, (32, 128)), jnp.int8)
    scales = jnp.asarray(rng.uniform(0.01, 0.1, (32, 2)), jnp.float32)
    offsets = jnp.asarray(rng.uniform(-0.1, 0.1, (32, 2)), jnp.float32)
    weight = QuantizedWeight(codes, scales, offsets, bits=8, group_size=64)
    x = jnp.asarray(rng.standard_normal((1, 3, 128)), jnp.float32)
    assert supports(x, weight)
    got = quantized_matmul(x, weight)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ dequantize(weight).T), atol=1e-4, rtol=1e-4)


def test_products_the_kernel_does_not_take_go_to_xla() -> None:
    """Groups of 32 (GGUF's) and steps of more rows: XLA's multiply-and-sum, or its dot for prefill."""
    rng = np.random.default_rng(3)
    weight = quantize(jnp.asarray(rng.standard_normal((40, 64)), jnp.float32), WeightQuantization(8, 32), jnp.dtype(jnp.float32))
    for rows in (1, 6, 17):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        assert not supports(x, weight)
        np.testing.assert_allclose(np.asarray(quantized_matmul(x, weight)), np.asarray(x @ dequantize(weight).T), rtol=1e-5, atol=1e-5)


@st.composite
def tensor_core_problems(draw: st.DrawFn) -> tuple[jax.Array, QuantizedWeight]:
    """Up to 16 bf16/f16 rows against a 4-bit weight: groups of 32 to 128 inputs, one or several
    groups a loop step, rows split over programs where there are few output channels."""
    dtype = draw(st.sampled_from(["bfloat16", "float16"]))
    group = draw(st.sampled_from([32, 64, 128]))
    width = 2 * group * draw(st.sampled_from([1, 3, 4]))
    out = draw(st.sampled_from([64, 128]))
    rows = draw(st.sampled_from([1, 2, 5, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    weight = jnp.asarray(rng.standard_normal((out, width)) * width**-0.5, jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, width)), dtype)
    scale_dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
    return x, quantize(weight, WeightQuantization(4, group), jnp.dtype(scale_dtype))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(tensor_core_problems())
def test_tensor_core_kernel_matches_the_dequantized_product(problem: tuple[jax.Array, QuantizedWeight]) -> None:
    """4-bit codes on the tensor cores (interpreted on CPU) against x @ dequantize(W).T in float32."""
    x, weight = problem
    assert triton_mma.launch(x.shape[0], weight, x.dtype) is not None
    got = jax.jit(lambda x, w: quantized_matmul(x, w, implementation="triton-mma"))(x, weight)
    expected = x.astype(jnp.float32) @ dequantize(weight).T
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected), atol=2e-2, rtol=2e-2)
    assert got.dtype == x.dtype


def test_tensor_core_launch_settings() -> None:
    """Two groups of 128 a step; rows split until a product has 264 programs (Llama-3-8B's qkv and
    down projection); SmolLM2's groups of 32, three a step. 8-bit codes, float32 rows, a 17th row
    and output channels that are not a multiple of 64 stay with the other forms."""
    def weight(out: int, width: int, bits: int = 4, group: int | None = None) -> QuantizedWeight:
        return quantize(jnp.zeros((out, width), jnp.float32), WeightQuantization(bits, group), jnp.dtype(jnp.bfloat16))

    bf16 = jnp.dtype(jnp.bfloat16)
    assert triton_mma.launch(1, weight(28672, 4096), bf16) == triton_mma.Launch(2, 1)
    assert triton_mma.launch(16, weight(6144, 4096), bf16) == triton_mma.Launch(2, 4)
    assert triton_mma.launch(1, weight(4096, 14336), bf16) == triton_mma.Launch(2, 7)
    assert triton_mma.launch(1, weight(576, 576), jnp.dtype(jnp.float16)) == triton_mma.Launch(3, 3)
    assert triton_mma.launch(1, weight(4096, 4096, bits=8), bf16) is None
    assert triton_mma.launch(1, weight(4096, 4096), jnp.dtype(jnp.float32)) is None
    assert triton_mma.launch(17, weight(4096, 4096), bf16) is None
    assert triton_mma.launch(1, weight(528, 512), bf16) is None


def test_rejects_mismatched_inputs_and_unknown_implementations() -> None:
    weight = quantize(jnp.ones((16, 64), jnp.float32), WeightQuantization(8), jnp.dtype(jnp.float32))
    with pytest.raises(ConfigError, match="inputs"):
        quantized_matmul(jnp.ones((1, 32)), weight)
    with pytest.raises(ConfigError, match="unknown quantized_matmul implementation"):
        quantized_matmul(jnp.ones((1, 64)), weight, implementation="cuda")
