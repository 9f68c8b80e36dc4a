"""LoRA adapters: PEFT-format loading, parity with peft + transformers, per-row adapters in one batch,
the push/pop stack, merging, and typed errors for adapters that do not fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import peft
import pytest
import torch
import transformers

from tests.hf_reference import SMALL, hf_greedy, hf_logits, save_random_checkpoint
from zgen import Context, Generator, Request, SamplingConfig, load_adapter, load_model
from zgen.errors import AdapterError
from zgen.lora import LoraAdapter
from zgen.model import Model

IDS = [1, 17, 42, 5, 88, 3, 60, 61, 9, 33, 70, 12]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _make_adapter(base_dir: Path, out: Path, seed: int, **lora: Any) -> Any:
    """A PEFT LoRA on a fresh copy of the base with random A and B (B nonzero), saved to ``out``;
    returns the PEFT model (the reference)."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.1, **lora)).eval()
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora")
    config = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)
    hf = save_random_checkpoint(config, root / "base")
    peft_a = _make_adapter(root / "base", root / "a", 1, r=4, lora_alpha=8, target_modules=ALL_TARGETS)
    peft_b = _make_adapter(
        root / "base", root / "b", 2, r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 12},
    )
    return {
        "root": root, "model": load_model(root / "base", dtype="float32"), "hf": hf,
        "peft_a": peft_a, "peft_b": peft_b, "a": load_adapter(root / "a"), "b": load_adapter(root / "b"),
    }


@pytest.mark.parametrize("which", ["a", "b"])
def test_logits_and_greedy_match_peft(setup: dict[str, Any], which: str) -> None:
    model, adapter, reference = setup["model"], setup[which], setup[f"peft_{which}"]
    generator = Generator(model)
    ours = generator.logits(IDS, adapter=adapter)
    ref = hf_logits(reference, IDS)
    assert np.abs(ours - ref).max() <= 1e-4
    assert np.abs(ref - hf_logits(setup["hf"], IDS)).max() > 1e-2  # the adapter really changes the model
    result = generator.generate(IDS[:5], GREEDY, adapter=adapter)
    ref_tokens, ref_logprobs = hf_greedy(reference, IDS[:5], 12, eos=[10_000])
    assert result.token_ids == ref_tokens
    np.testing.assert_allclose(result.logprobs, ref_logprobs, atol=1e-4)


def test_embeddings_with_adapter_match_peft(setup: dict[str, Any]) -> None:
    from zgen import embed

    model, adapter, reference = setup["model"], setup["b"], setup["peft_b"]
    texts = [IDS, IDS[:4]]
    with torch.no_grad():
        hidden = [reference.base_model.model.model(input_ids=torch.tensor([t])).last_hidden_state[0].numpy() for t in texts]
    ref = np.stack([h.mean(axis=0) for h in hidden])
    np.testing.assert_allclose(embed(model, texts, normalize=False, adapter=adapter), ref, atol=1e-4)
    model.push_adapter(adapter)
    try:
        np.testing.assert_allclose(embed(model, texts, normalize=False), ref, atol=1e-4)
    finally:
        model.pop_adapter()


def test_mixed_batch_equals_each_alone(setup: dict[str, Any]) -> None:
    model, a, b = setup["model"], setup["a"], setup["b"]
    generator = Generator(model)
    requests = [
        Request(IDS[:5], GREEDY, adapter=a), Request(IDS[2:9], GREEDY, adapter=b), Request(IDS[:5], GREEDY),
        Request(IDS[1:4], GREEDY, adapter=(a, 0.5)), Request(IDS[:5], GREEDY, adapter=[a, b]),
    ]
    together = generator.batch_generate(requests)
    for request, result in zip(requests, together, strict=True):
        alone = Generator(model).generate(request.prompt, request.sampling, adapter=request.adapter)
        assert result.token_ids == alone.token_ids
        np.testing.assert_allclose(result.logprobs, alone.logprobs, atol=1e-5)
    assert together[0].token_ids != together[2].token_ids  # the rows really ran different weights
    assert "".join(generator.generate_stream(IDS[:5], GREEDY, adapter=a)) == together[0].text


def test_push_pop_and_merge_equal_per_request(setup: dict[str, Any]) -> None:
    model, a, b = setup["model"], setup["a"], setup["b"]
    generator = Generator(model)
    base = generator.logits(IDS)
    mixed = generator.logits(IDS, adapter=[(a, 0.5), b])
    model.push_adapter(a, 0.5)
    try:
        model.push_adapter(b)
        np.testing.assert_allclose(generator.logits(IDS), mixed, atol=1e-5)
        assert model.pop_adapter() is b
        np.testing.assert_allclose(generator.logits(IDS), generator.logits(IDS, adapter=[]), atol=0)
    finally:
        model.adapters.clear()
    np.testing.assert_allclose(generator.logits(IDS), base, atol=0)
    with pytest.raises(AdapterError):
        model.pop_adapter()

    per_request = generator.generate(IDS[:5], GREEDY, adapter=[(a, 0.5), b])
    model.merge_adapter(a, 0.5)
    model.merge_adapter(b)
    try:
        merged = generator.generate(IDS[:5], GREEDY)
        assert merged.token_ids == per_request.token_ids
        np.testing.assert_allclose(merged.logprobs, per_request.logprobs, atol=1e-4)
        np.testing.assert_allclose(generator.logits(IDS), mixed, atol=1e-4)
    finally:
        assert model.unmerge_adapter(a) is a
        model.unmerge_adapter()
    np.testing.assert_allclose(generator.logits(IDS), base, atol=1e-5)
    with pytest.raises(AdapterError):
        model.unmerge_adapter()


def test_context_stack(setup: dict[str, Any]) -> None:
    model, a = setup["model"], setup["a"]
    expected = Generator(model).generate(IDS[:5], GREEDY, adapter=a).token_ids
    ctx = Context(model)
    ctx.fill_tokens(IDS[:5])
    ctx.push_adapter(a)
    twin = ctx.fork()
    assert ctx.generate_result(GREEDY).token_ids == expected
    assert twin.generate_result(GREEDY).token_ids == expected  # a fork keeps the stack
    assert twin.pop_adapter() is a
    plain = Context(model)
    plain.fill_tokens(IDS[:5])
    assert plain.generate_result(GREEDY).token_ids == Generator(model).generate(IDS[:5], GREEDY).token_ids


def _edited(setup: dict[str, Any], name: str, **changes: Any) -> Path:
    target = setup["root"] / name
    shutil.copytree(setup["root"] / "a", target)
    config_file = target / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))
    return target


def test_mismatched_adapters_get_typed_errors(setup: dict[str, Any], tmp_path: Path) -> None:
    model: Model = setup["model"]
    with pytest.raises(AdapterError, match="unknown target modules"):
        load_adapter(_edited(setup, "unknown", target_modules=["q_proj", "lm_head"]))
    with pytest.raises(AdapterError, match="rank"):
        load_adapter(_edited(setup, "rank", r=6))
    with pytest.raises(AdapterError, match="positive integer"):
        load_adapter(_edited(setup, "zero", r=0))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter(tmp_path)
    # An adapter trained for a wider base.
    wide = transformers.LlamaConfig(**{**SMALL, "hidden_size": 32, "intermediate_size": 48})
    save_random_checkpoint(wide, tmp_path / "wide")
    _make_adapter(tmp_path / "wide", tmp_path / "wide_lora", 3, r=2, target_modules=["q_proj"])
    foreign: LoraAdapter = load_adapter(tmp_path / "wide_lora")
    generator = Generator(model)
    with pytest.raises(AdapterError, match="another base model"):
        generator.generate(IDS[:5], GREEDY, adapter=foreign)
    with pytest.raises(AdapterError, match="another base model"):
        model.push_adapter(foreign)
    with pytest.raises(AdapterError, match="another base model"):
        model.merge_adapter(foreign)
    with pytest.raises(AdapterError, match="adapter="):
        generator.generate(IDS[:5], GREEDY, adapter="a")  # type: ignore[arg-type]
    assert not model.adapters and not model.merged_adapters
    assert generator.generate(IDS[:5], GREEDY).token_ids  # nothing was left broken


def test_cli_lora_flag(setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from zgen.cli import app

    monkeypatch.setenv("ZGEN_XLA_CACHE_DIR", str(tmp_path / "xla"))
    root, model = setup["root"], setup["model"]
    base = ["generate", "-m", str(root / "base"), "-p", "w17 w42 w5", "--temperature", "0", "-n", "8", "--ignore-eos", "--json"]
    result = CliRunner().invoke(app, [*base, "--lora", f"{root / 'a'}:0.5", "--lora", str(root / "b")])
    assert result.exit_code == 0, result.output
    expected = Generator(model).generate("w17 w42 w5", SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True),
                                         adapter=[(setup["a"], 0.5), setup["b"]])
    assert json.loads(result.stdout)["token_ids"] == expected.token_ids
    missing = CliRunner().invoke(app, [*base, "--lora", str(tmp_path / "nowhere")])
    assert missing.exit_code == 1 and "adapter_config.json" in missing.output
    bad_scale = CliRunner().invoke(app, [*base, "--lora", f"{root / 'a'}:nan"])
    assert bad_scale.exit_code == 2 and "finite" in bad_scale.output


def test_both_gather_paths_equal_each_rows_own_pair(setup: dict[str, Any]) -> None:
    import jax.numpy as jnp

    from zgen.lora import random_adapter
    from zgen.lora.bank import stack_mixes
    from zgen.lora.graph import lora_projection

    config = setup["model"].config
    mixes = [[(random_adapter(config, 4, seed=s), 1.0)] for s in range(3)]
    bank = stack_mixes(mixes, config, jnp.dtype(jnp.float32)).arrays  # slot 0 (none) + 3 adapters
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    weight = np.random.default_rng(0).standard_normal((qkv_rows, config.hidden_size)).astype(np.float32)
    params = {"layers.0.qkv": jnp.asarray(weight), **bank}
    a, b = np.asarray(bank["layers.0.qkv.lora_a"]), np.asarray(bank["layers.0.qkv.lora_b"])
    for rows, seq in [(6, 1), (2, 1), (6, 3)]:  # all slots at once; gathered (few rows); gathered (prefill)
        x = np.random.default_rng(rows + seq).standard_normal((rows, seq, config.hidden_size)).astype(np.float32)
        slots = np.arange(rows) % 4
        ours = np.asarray(lora_projection(params, "layers.0", jnp.asarray(slots))("qkv", jnp.asarray(x)))
        ref = np.stack([x[r] @ weight.T + (x[r] @ a[slots[r]].T) @ b[slots[r]].T for r in range(rows)])
        np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_cli_embed_lora(setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from zgen import embed
    from zgen.cli import app

    monkeypatch.setenv("ZGEN_XLA_CACHE_DIR", str(tmp_path / "xla"))
    root = setup["root"]
    (tmp_path / "in.txt").write_text("w17 w42 w5\nw9\n")
    args = ["embed", "-m", str(root / "base"), "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.jsonl"), "--lora", f"{root / 'a'}:2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line)["embedding"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(rows, embed(setup["model"], ["w17 w42 w5", "w9"], adapter=(setup["a"], 2.0)), atol=1e-5)


def test_adapters_with_grammar_rows() -> None:
    """A grammar-constrained row (whose forward runs apart from its draws) keeps its adapter."""
    import dataclasses
    import re

    from zgen import Grammar, ModelConfig
    from zgen.loading.builtin import builtin_model_path
    from zgen.loading.gguf_file import open_gguf
    from zgen.lora import random_adapter
    from zgen.model import random_model
    from zgen.tokenizer import Tokenizer

    config = ModelConfig.from_hf(dict(
        model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        eos_token_id=2, tie_word_embeddings=True,
    ))
    tokenizer = Tokenizer.from_gguf(open_gguf(builtin_model_path("smollm2")))
    model = dataclasses.replace(random_model(config, dtype="float32", seed=1), tokenizer=tokenizer)
    adapter = random_adapter(config, 4, seed=7, alpha=64.0)
    constrained = SamplingConfig(temperature=1.0, seed=3, max_new_tokens=12, grammar=Grammar.regex("[a-z]{3,8}"))
    free = SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    generator = Generator(model)
    together = generator.batch_generate([Request("go", constrained, adapter=adapter), Request("go", free, adapter=adapter)])
    assert re.fullmatch("[a-z]{3,8}", together[0].text)
    assert together[0].token_ids == generator.generate("go", constrained, adapter=adapter).token_ids
    assert together[1].token_ids == generator.generate("go", free, adapter=adapter).token_ids
    assert together[1].token_ids != generator.generate("go", free).token_ids  # the adapter changes the row


def test_beam_search_with_adapter_matches_peft(setup: dict[str, Any]) -> None:
    model, adapter, reference = setup["model"], setup["a"], setup["peft_a"]
    with torch.no_grad():
        out = reference.generate(
            input_ids=torch.tensor([IDS[:5]]), attention_mask=torch.ones(1, 5, dtype=torch.long), num_beams=3,
            num_return_sequences=3, do_sample=False, max_new_tokens=6, eos_token_id=list(model.eos_token_ids), pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )
    beams = Generator(model).beam_search(IDS[:5], 3, max_new_tokens=6, adapter=adapter)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    assert [b.token_ids for b in beams] == [out.sequences[i, 5 : 5 + n].tolist() for i, n in enumerate(lengths)]
    np.testing.assert_allclose([b.score for b in beams], out.sequences_scores.tolist(), atol=1e-4)


def test_adapters_on_quantized_weights(setup: dict[str, Any]) -> None:
    """A per-request adapter runs on int8 base weights (QLoRA-style) exactly as on the float weights
    they stand for; merging one into quantized weights is refused."""
    import dataclasses

    from zgen.errors import AdapterError
    from zgen.model import quantize_model
    from zgen.quantized_weights import QuantizedWeight, dequantize

    quantized = quantize_model(setup["model"], "int8")
    params = {name: dequantize(w) if isinstance(w, QuantizedWeight) else w for name, w in quantized.params.items()}
    float_twin = dataclasses.replace(quantized, params=params, attachments={})
    ours = Generator(quantized).logits(IDS, adapter=setup["a"])
    np.testing.assert_allclose(ours, Generator(float_twin).logits(IDS, adapter=setup["a"]), atol=1e-5)
    with pytest.raises(AdapterError, match="quantized"):
        quantized.merge_adapter(setup["a"])
