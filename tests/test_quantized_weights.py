"""Weight-only quantization: the layout's round trip, quantized models against their float originals,
GGUF blocks computed directly against their dequantized values, and the CLI flag."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from typer.testing import CliRunner

from tests.hf_reference import SMALL, save_random_checkpoint
from tests.tiny_gguf import VOCAB, write_tiny_gguf
from zgen import Generator, SamplingConfig
from zgen.cli import app
from zgen.contexts.snapshot import model_fingerprint
from zgen.errors import ConfigError, UnsupportedModelError
from zgen.loading.gguf_quantized import fuse, read_codes
from zgen.model import Model, load_model, quantize_model
from zgen.pallas.quantized_matmul import quantized_matmul
from zgen.quantized_weights import QuantizedWeight, WeightQuantization, dequantize, quantize, quantized_linear

F32 = jnp.dtype(jnp.float32)


def _matrix(out: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((out, width)).astype(np.float32)


# -- the layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits, group", [(8, None), (8, 32), (4, 32), (4, 64)])
def test_round_trip_error_is_at_most_half_a_step(bits: int, group: int | None) -> None:
    w = _matrix(48, 256)
    q = quantize(jnp.asarray(w), WeightQuantization(bits, group), F32)
    assert q.shape == w.shape and q.bits == bits
    step = np.repeat(np.asarray(q.scales, np.float32), q.group_size, axis=1)
    error = np.abs(np.asarray(dequantize(q)) - w)
    # Round to nearest against the stored scale: half a step, plus float32 rounding of w / scale.
    assert np.all(error <= step * (0.5 + 1e-5))


def test_int4_packs_two_codes_per_byte_in_planar_halves() -> None:
    w = _matrix(4, 128)
    q = quantize(jnp.asarray(w), WeightQuantization(4, 32), F32)
    assert q.values.dtype == jnp.uint8 and q.values.shape == (4, 64)
    codes = np.clip(np.round((w.reshape(4, 4, 32) - np.asarray(q.offsets)[..., None]) / np.asarray(q.scales)[..., None]), 0, 15)
    codes = codes.reshape(4, 128).astype(np.uint8)
    packed = np.asarray(q.values)
    np.testing.assert_array_equal(packed & 0xF, codes[:, :64])
    np.testing.assert_array_equal(packed >> 4, codes[:, 64:])


@pytest.mark.parametrize("bits, group", [(8, 32), (8, None), (4, 32)])
@pytest.mark.parametrize("matmul, rows", [("dequantize", 3), ("grouped", 3), ("reduce", 3), ("reduce", 12)])
def test_quantized_linear_is_the_dot_with_the_dequantized_matrix(bits: int, group: int | None, matmul: str, rows: int) -> None:
    w = quantize(jnp.asarray(_matrix(40, 192)), WeightQuantization(bits, group, matmul), F32)
    x = jnp.asarray(_matrix(rows, 192, seed=1))
    expected = np.asarray(x) @ np.asarray(dequantize(w)).T
    np.testing.assert_allclose(np.asarray(jax.jit(quantized_linear)(x, w)), expected, rtol=1e-5, atol=1e-4)


def test_default_groups_and_bad_group_sizes() -> None:
    int4 = WeightQuantization(4)
    assert int4.group_for(4096) == 128 and int4.group_for(576) == 32
    assert WeightQuantization(8).group_for(576) == 576  # per output channel
    with pytest.raises(ConfigError, match="int4 needs a weight width"):
        int4.group_for(112)
    with pytest.raises(ConfigError, match="does not divide"):
        WeightQuantization(4, 64).group_for(576)
    with pytest.raises(ConfigError, match="bits must be 8 or 4"):
        WeightQuantization(3)
    with pytest.raises(ConfigError, match="matmul must be one of"):
        WeightQuantization(8, matmul="fast")
    with pytest.raises(ConfigError, match="head_bits must be None, 8 or 4"):
        WeightQuantization(4, head_bits=16)


# -- a tiny random Llama, quantized at load ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    # Widths 64 and 128 take int4 groups of 32; weights of HF's init scale (std 0.02) times 10 so the
    # logits spread and the argmax is not a near tie.
    config = transformers.LlamaConfig(**{**SMALL, "intermediate_size": 128}, initializer_range=0.2)
    save_random_checkpoint(config, directory)
    return directory


@pytest.fixture(scope="module")
def tiny_float(tiny_dir: Path) -> Model:
    return load_model(tiny_dir, dtype="float32")


IDS = [5, 17, 33, 8, 61, 42, 9, 70, 11, 3]


def _relative_logit_error(a: Model, b: Model) -> float:
    """RMS difference of the two models' logits over the prompt, relative to the logits' spread."""
    la, lb = Generator(a).logits(IDS), Generator(b).logits(IDS)
    return float(np.sqrt(np.mean((la - lb) ** 2)) / la.std())


def _with_dequantized_weights(model: Model) -> Model:
    params = {name: dequantize(w) if isinstance(w, QuantizedWeight) else w for name, w in model.params.items()}
    return Model(model.config, model.tokenizer, model.graph, params, model.dtype, model.source, model.load_timings)


def test_int8_and_int4_models_compute_their_weights_and_stay_near_the_float_model(tiny_dir: Path, tiny_float: Model) -> None:
    int8 = load_model(tiny_dir, dtype="float32", weights="int8")
    int4 = load_model(tiny_dir, dtype="float32", weights="int4")
    assert isinstance(int8.params["layers.0.qkv"], QuantizedWeight)
    assert int8.params["embed"].dtype == jnp.float32  # the embedding table stays float
    for model in (int8, int4):  # both named formats keep the (untied) LM head in int8
        head = model.params["lm_head"]
        assert isinstance(head, QuantizedWeight) and head.bits == 8 and head.matmul == "kernel"
    # The quantized matmuls compute the float model of the dequantized weights (int8's matmul is the
    # same dequantize-then-dot, checked per matrix above).
    assert _relative_logit_error(_with_dequantized_weights(int4), int4) < 1e-5
    # Against the original weights: per-channel int8 errs ~0.6 % RMS per weight, and this random
    # model (weights at 10x HF's init scale, so the argmax is no near tie) amplifies that about 4x.
    # int4 (groups of 32) errs ~8 % per weight, ~35 % on these logits: only a loose sanity bound here,
    # its quality on a real model is the SmolLM2 perplexity table (docs/weight_quantization.md).
    assert _relative_logit_error(tiny_float, int8) < 0.05
    assert _relative_logit_error(tiny_float, int4) < 0.6
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    reference = Generator(tiny_float).generate(IDS, greedy).token_ids
    assert Generator(int8).generate(IDS, greedy).token_ids == reference


def test_a_head_tied_to_the_embeddings_stays_float(small_chat: Model) -> None:
    """The head's rows are also the embedding lookups: the named formats leave a tied table float."""
    int8 = quantize_model(small_chat, "int8")
    assert isinstance(int8.params["layers.0.gate_up"], QuantizedWeight)
    assert not isinstance(int8.params["embed"], QuantizedWeight) and "lm_head" not in int8.params


def test_quantize_model_matches_quantizing_at_load(tiny_dir: Path, tiny_float: Model) -> None:
    in_memory, at_load = quantize_model(tiny_float, "int4"), load_model(tiny_dir, dtype="float32", weights="int4")
    np.testing.assert_array_equal(Generator(in_memory).logits(IDS), Generator(at_load).logits(IDS))
    # Saved contexts know a quantized model from its float original.
    assert model_fingerprint(in_memory) == model_fingerprint(at_load) != model_fingerprint(tiny_float)
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_model(in_memory, "int8")


def test_every_matmul_form_computes_the_same_logits(tiny_float: Model) -> None:
    """Through the runtime, the three forms compute the same product (a 6-token step: "reduce"
    takes its multiply-and-sum path)."""
    logits = {
        matmul: Generator(quantize_model(tiny_float, WeightQuantization(4, 32, matmul))).logits(IDS[:6])
        for matmul in ("dequantize", "grouped", "reduce")
    }
    for matmul in ("grouped", "reduce"):
        np.testing.assert_allclose(logits[matmul], logits["dequantize"], rtol=0, atol=1e-5 * np.abs(logits["dequantize"]).max())


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_matmul_runs_through_the_runtime(tiny_float: Model, bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``matmul="kernel"``: the runtime's contexts hand the products of a decode-sized step to the
    Triton kernel on a GPU (here the platform check says GPU and the kernel runs interpreted): the
    same logits and greedy tokens as dequantize-then-dot in float32."""
    import zgen.runtime.step as step

    scheme = lambda matmul: WeightQuantization(bits, 32, matmul)  # noqa: E731
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    plain = Generator(quantize_model(tiny_float, scheme("dequantize")))
    monkeypatch.setattr(step, "platform", lambda: "gpu")
    calls: list[int] = []
    monkeypatch.setattr(step, "quantized_matmul", lambda x, w: calls.append(1) or quantized_matmul(x, w))
    kernel = Generator(quantize_model(tiny_float, scheme("kernel")))
    expected = plain.logits(IDS[:6])
    np.testing.assert_allclose(kernel.logits(IDS[:6]), expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert calls, "the kernel was not called"
    assert kernel.generate(IDS, greedy).token_ids == plain.generate(IDS, greedy).token_ids


def test_unsupported_weight_choices_are_typed_errors(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError, match="weights='int3' is not supported"):
        load_model(tiny_dir, weights="int3")
    with pytest.raises(ConfigError, match="HF directory"):
        load_model(tiny_dir, weights="gguf")


# -- GGUF blocks computed directly ------------------------------------------------------------------

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16


def _metadata(writer: gguf.GGUFWriter) -> None:
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)


def _write_quantized_gguf(path: Path, types: dict[str, str]) -> Path:
    """A tiny Llama GGUF whose tensors named in ``types`` (by their suffix) are stored quantized."""
    rng = np.random.default_rng(0)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    tensors = {"token_embd.weight": mat(len(VOCAB), HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(2):
        tensors |= {
            f"blk.{i}.attn_norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32),
            f"blk.{i}.attn_q.weight": mat(HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": mat(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.ffn_gate.weight": mat(INTERMEDIATE, HIDDEN),
            f"blk.{i}.ffn_up.weight": mat(INTERMEDIATE, HIDDEN),
            f"blk.{i}.ffn_down.weight": mat(HIDDEN, INTERMEDIATE),
        }
    writer = gguf.GGUFWriter(path, "llama")
    _metadata(writer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(VOCAB)
    writer.add_token_types([gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    for name, value in tensors.items():
        kind = next((t for suffix, t in types.items() if name.endswith(suffix)), None)
        if kind is None:
            writer.add_tensor(name, value)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# SmolLM2's mix (Q4_1 projections, Q8_0 embedding), and one mixing Q4_0, Q4_1 and Q8_0 inside fused
# matrices (q/k Q4_1 with v Q8_0 meet in int8 with offsets).
MIXES = {
    "smollm2": {"token_embd.weight": "Q8_0", "_q.weight": "Q4_1", "_k.weight": "Q4_1", "_v.weight": "Q4_1",
                "_output.weight": "Q4_1", "_gate.weight": "Q4_1", "_up.weight": "Q4_1", "_down.weight": "Q4_1"},
    "mixed": {"_q.weight": "Q4_1", "_k.weight": "Q4_1", "_v.weight": "Q8_0", "_output.weight": "Q4_0",
              "_gate.weight": "Q8_0", "_up.weight": "Q8_0", "_down.weight": "Q4_0"},
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_gguf_blocks_computed_directly_equal_the_dequantized_path(tmp_path: Path, mix: str) -> None:
    path = _write_quantized_gguf(tmp_path / "tiny.gguf", MIXES[mix])
    dense = load_model(path, dtype="float32", cache_dir=tmp_path / "cache")
    direct = load_model(path, dtype="float32", cache_dir=tmp_path / "cache", weights="gguf")
    for name in ("layers.0.qkv", "layers.1.o", "layers.0.gate_up", "layers.1.down"):
        held = direct.params[name]
        assert isinstance(held, QuantizedWeight)
        # The same float32 weights, bit for bit: the math is the same up to the dot's summation order.
        np.testing.assert_array_equal(np.asarray(dequantize(held)), np.asarray(dense.params[name]))
    bits = {name: w.bits for name, w in direct.params.items() if isinstance(w, QuantizedWeight)}
    assert bits["layers.0.qkv"] == (4 if mix == "smollm2" else 8) and bits["layers.0.down"] == 4
    ids = [257, 40, 98, 99, 100, 33, 120, 7]
    a, b = Generator(dense).logits(ids), Generator(direct).logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    assert Generator(direct).generate(ids, greedy).token_ids == Generator(dense).generate(ids, greedy).token_ids


def test_q4_k_super_blocks_repack_to_the_weights_gguf_dequantizes() -> None:
    """Q4_K (no Python quantizer to write a model with): random super-blocks, any byte a valid code or
    6-bit scale, under small float16 d and dmin, read into groups of 32."""
    rng = np.random.default_rng(0)
    out, width = 6, 512
    blocks = rng.integers(0, 256, size=(out * width // 256, 144), dtype=np.uint8)
    for start in (0, 2):  # d, dmin
        blocks[:, start : start + 2] = rng.uniform(1e-3, 2e-2, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    data = blocks.reshape(out, -1)
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_K).reshape(out, width)
    weight = fuse([read_codes(data, "Q4_K", (out, width))])
    assert weight.bits == 4 and weight.group_size == 32
    # The same float32 products; XLA may fuse scale * q + offset into one rounding.
    np.testing.assert_allclose(np.asarray(dequantize(weight)), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())


def test_gguf_weights_refuse_float_projections(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "float.gguf")
    with pytest.raises(UnsupportedModelError, match="stored as F32"):
        load_model(path, cache_dir=tmp_path / "cache", weights="gguf")


def test_smollm2_q4_1_computed_directly_gives_the_dequantized_greedy_tokens(smollm2: Model) -> None:
    direct = load_model("smollm2", dtype="float32", weights="gguf")
    prompt = [{"role": "user", "content": "Name three primary colors."}]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=24)
    ours, reference = Generator(direct).generate(prompt, greedy), Generator(smollm2).generate(prompt, greedy)
    assert ours.token_ids == reference.token_ids
    # Each chosen token's log-prob (a log-softmax of the logits) agrees to float32 summation order.
    assert np.abs(np.asarray(ours.logprobs) - np.asarray(reference.logprobs)).max() < 1e-4


# -- CLI ---------------------------------------------------------------------------------------------


def test_cli_checks_weights_before_loading(tiny_dir: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "--weights", "int3", "-p", "w5"])
    assert result.exit_code == 2 and "'int3' is not one of int8, int4, gguf" in result.output
    result = runner.invoke(app, ["eval", "ppl", "--weights", "gguf", "-m", str(tiny_dir), "--text-file", str(tiny_dir / "config.json")])
    assert result.exit_code == 2 and "use --weights int8 or int4" in result.output
