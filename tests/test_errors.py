"""Bad input gets a typed error that says what was wrong, and leaves files and caches intact."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy

from tests import tiny_gguf
from tests.hf_reference import save_random_checkpoint, small_configs
from zgen import Context, Engine, Generator, SamplingConfig, load_model
from zgen.cache.factory import CacheOption, compressed_kv, dense_attention, paged_kv, prefix_cache
from zgen.config import Llama3RopeScaling, ModelConfig
from zgen.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    ModelNotFoundError,
    PromptTooLongError,
    TokenIdError,
    UnsupportedModelError,
)
from zgen.evaluation import perplexity, read_text_file
from zgen.model import Model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen2")
    save_random_checkpoint(small_configs()["qwen2"], directory)
    return directory


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoint, target)
    return target


def test_missing_path() -> None:
    with pytest.raises(ModelNotFoundError, match="built-in name"):
        load_model("/nonexistent/model")


def test_missing_config(checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(checkpoint, tmp_path)
    (directory / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(directory)


def test_missing_weights(checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(checkpoint, tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(directory)


def test_corrupt_safetensors_header(checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(checkpoint, tmp_path)
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"{not json at all" + b" " * 16
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(directory)
    assert weights.read_bytes() == bytes(data)  # the file is left as it was


def test_unknown_architecture(checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["model_type"], config["architectures"] = "gpt_bigcode", ["GPTBigCodeForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gpt_bigcode"):
        load_model(directory)


def test_config_weights_disagree(checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] += 8
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="gate_up"):
        load_model(directory)


def test_truncated_gguf(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with smollm2_gguf_path.open("rb") as src:
        truncated.write_bytes(src.read(5_000_000))
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(truncated, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.safetensors")), "no converted cache from a broken file"


def test_bad_dtype() -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        load_model("smollm2", dtype="int8")


def test_prompt_longer_than_context(smollm2: Model) -> None:
    gen = Generator(smollm2)
    context = smollm2.config.max_position_embeddings
    with pytest.raises(PromptTooLongError, match="context"):
        gen.generate([5] * (context - 10), SamplingConfig(max_new_tokens=20))


def test_token_id_out_of_range(smollm2: Model) -> None:
    gen = Generator(smollm2)
    with pytest.raises(TokenIdError, match="outside"):
        gen.generate([1, 2, smollm2.config.vocab_size], SamplingConfig(max_new_tokens=2))
    with pytest.raises(TokenIdError):
        gen.generate([-1], SamplingConfig(max_new_tokens=2))


def test_prompt_ids_are_ints_in_the_vocabulary(smollm2: Model) -> None:
    """Plain ids take a fast check; numpy integers pass as ints; bools, floats and ids past the vocabulary do not."""
    gen = Generator(smollm2)
    ids = gen.encode_prompt([1, np.int64(2), 3])
    assert ids == [1, 2, 3] and all(type(i) is int for i in ids)
    for bad in ([1, True], [1, 2.0], [0, smollm2.config.vocab_size]):
        with pytest.raises(TokenIdError):
            gen.encode_prompt(bad)  # type: ignore[arg-type]


def test_empty_prompt(smollm2: Model) -> None:
    with pytest.raises(InputError, match="empty"):
        Generator(smollm2).generate("", SamplingConfig(max_new_tokens=2))


def test_session_survives_bad_request(smollm2: Model) -> None:
    session = Generator(smollm2).new_session()
    first = session.generate("The sky is", SamplingConfig(temperature=0.0, max_new_tokens=4))
    before = session.token_ids
    with pytest.raises(TokenIdError):
        session.generate([10**9], SamplingConfig(max_new_tokens=2))
    assert session.token_ids == before
    again = session.generate("The sky is", SamplingConfig(temperature=0.0, max_new_tokens=4))
    assert again.token_ids == first.token_ids


# ------------------------------------------------------------------------------------------------
# Configs are checked (types, ranges, and against the weights) before anything is built


def with_config(checkpoint: Path, tmp_path: Path, **changes: object) -> Path:
    directory = copy_of(checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_hidden_layers": 10**9}, "num_layers"),  # refused at once: no graph of 10**9 layers is built
        ({"num_hidden_layers": 1}, "weights hold 2 layers"),  # fewer in the config than in the weights
        ({"num_hidden_layers": 3}, "config asks for 3 layers"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rope_theta": -10000.0}, "rope_theta"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps"),
        ({"num_attention_heads": 0}, "num_heads"),  # was a ZeroDivisionError
        ({"num_key_value_heads": 0}, "num_kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"rope_scaling": [1, 2]}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": float("nan")}}, "factor"),
        ({"eos_token_id": 96}, "eos_token_id 96"),  # == vocab: NaN log-probs before
        ({"eos_token_id": [2, 2**40]}, "eos_token_id"),
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"hidden_size": 64.5}, "hidden_size"),
        ({"vocab_size": True}, "vocab_size"),
        ({"vocab_size": 10**12}, "vocab_size"),
        ({"max_position_embeddings": 2**40}, "max_position_embeddings"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ],
)
def test_corrupt_config_values_are_refused(checkpoint: Path, tmp_path: Path, changes: dict[str, object], match: str) -> None:
    with pytest.raises((ConfigError, CheckpointError), match=match) as caught:
        load_model(with_config(checkpoint, tmp_path, **changes))
    assert "config.json" in str(caught.value) or "weights" in str(caught.value)


def test_sharded_index_cannot_name_files_outside_the_model(checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(checkpoint, tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    (directory / "model.safetensors").rename(outside)
    for name in ("../elsewhere.safetensors", str(outside), "", 7):
        index = {"weight_map": {"model.embed_tokens.weight": name}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="shard"):
            load_model(directory)


def _edit_tensor(directory: Path, name: str, edit: Callable[[np.ndarray], None]) -> None:
    weights = directory / "model.safetensors"
    tensors = safetensors.numpy.load_file(weights)
    edit(tensors[name])
    safetensors.numpy.save_file(tensors, weights)


def test_non_finite_weights_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(checkpoint, tmp_path)
    _edit_tensor(directory, "model.layers.1.mlp.down_proj.weight", lambda w: w.__setitem__((3, 5), np.nan))
    with pytest.raises(CheckpointError, match="layers.1.down.*NaN or infinite"):
        load_model(directory)


def test_overwritten_tensor_bytes_that_decode_as_nan_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(checkpoint, tmp_path)
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4096:] = b"\xff" * 4096  # 0xffffffff is a float32 NaN; the file's length and header are unchanged
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        load_model(directory)


def test_weights_beyond_float16_range_are_refused_in_float16(checkpoint: Path, tmp_path: Path) -> None:
    directory = copy_of(checkpoint, tmp_path)
    _edit_tensor(directory, "model.norm.weight", lambda w: w.__setitem__(0, 1e6))
    with pytest.raises(ConfigError, match="beyond float16's range"):
        load_model(directory, dtype="float16")
    assert load_model(directory, dtype="float32").config.num_layers == 2


def _gguf_metadata(**overrides: object) -> Callable[[gguf.GGUFWriter], None]:
    values: dict[str, object] = {
        "block_count": tiny_gguf.LAYERS, "context_length": 128, "embedding_length": tiny_gguf.HIDDEN,
        "feed_forward_length": tiny_gguf.INTERMEDIATE, "head_count": tiny_gguf.HEADS,
        "head_count_kv": tiny_gguf.KV_HEADS, "rope_freq_base": 10000.0, "layer_norm_rms_eps": 1e-5,
    } | overrides

    def write(writer: gguf.GGUFWriter) -> None:
        for key, value in values.items():
            if value is not None:
                getattr(writer, f"add_{key}")(value)

    return write


def test_tiny_gguf_loads_and_generates(tmp_path: Path) -> None:
    model = load_model(tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache")
    assert (model.config.num_layers, model.config.vocab_size) == (tiny_gguf.LAYERS, len(tiny_gguf.VOCAB))
    with Generator(model) as gen:
        assert len(gen.generate("ab", SamplingConfig(temperature=0.0, max_new_tokens=3, ignore_eos=True)).token_ids) == 3


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"block_count": 4_000_000_000}, "num_layers"),  # grew memory without bound before
        ({"block_count": 1}, "weights hold 2 layers"),
        ({"block_count": 3}, "config asks for 3 layers"),
        ({"rope_freq_base": float("nan")}, "rope_theta"),
        ({"layer_norm_rms_eps": float("nan")}, "rms_norm_eps"),
        ({"head_count": 0}, "num_heads"),
        ({"context_length": None}, "lacks llama.context_length"),
    ],
)
def test_corrupt_gguf_metadata_is_refused(tmp_path: Path, overrides: dict[str, object], match: str) -> None:
    path = tiny_gguf.write_tiny_gguf(tmp_path / "bad.gguf", _gguf_metadata(**overrides))
    with pytest.raises(CheckpointError, match=match):
        load_model(path, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.safetensors")), "nothing converted from a refused file"


def _patch_count(path: Path, offset: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + 8] = count.to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("where", "match"), [("field count", "field count"), ("array count", "tokenizer.ggml.token_type")])
def test_gguf_metadata_counts_past_the_file_are_refused(tmp_path: Path, where: str, match: str) -> None:
    """gguf's reader would loop over every claimed element, reading nothing past the end of the file
    (a hang the input fuzz test found); the loader refuses the count first."""
    path = tiny_gguf.write_tiny_gguf(tmp_path / "bad.gguf")
    if where == "field count":
        offset = 16  # magic, version, tensor count
    else:
        field = gguf.GGUFReader(path).fields["tokenizer.ggml.token_type"]  # an array of int32
        offset = field.offset + 8 + len(field.name.encode()) + 4 + 4  # key length, key, value type, item type
    _patch_count(path, offset, 2**56)
    with pytest.raises(CheckpointError, match=rf"{match}\)? claims .* past the end of the file"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_gguf_tensor_with_nan_is_refused(tmp_path: Path) -> None:
    tensors = tiny_gguf.tiny_tensors()
    tensors["blk.1.ffn_up.weight"][0, 0] = np.inf
    path = tiny_gguf.write_tiny_gguf(tmp_path / "nan.gguf", tensors=tensors)
    with pytest.raises(CheckpointError, match="blk.1.ffn_up.weight holds NaN or infinite"):
        load_model(path, cache_dir=tmp_path / "cache")


def test_model_config_refuses_bad_values_directly() -> None:
    good = dict(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    assert ModelConfig(**good).q_per_kv == 2  # type: ignore[arg-type]
    for bad in ({"num_layers": 2.0}, {"head_dim": 10**6}, {"eos_token_ids": (64,)}, {"sliding_window": 0},
                {"rope_scaling": Llama3RopeScaling(8.0, 1.0, 4.0, 32)} | {"rope_theta": 0.5}):
        with pytest.raises(ConfigError):
            ModelConfig(**(good | bad))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="high_freq_factor"):
        Llama3RopeScaling(8.0, 4.0, 4.0, 32)


# ------------------------------------------------------------------------------------------------
# Token ids and text: refused before they reach the model


@pytest.fixture(scope="module")
def tiny(checkpoint: Path) -> Model:
    return load_model(checkpoint)


@pytest.mark.parametrize("text", ["abc\udcff", "\ud800", "w3 \udc80 w4"])
def test_text_that_is_not_unicode_is_an_input_error(tiny: Model, text: str) -> None:
    with Generator(tiny) as gen:
        with pytest.raises(InputError, match="lone surrogate"):
            gen.encode_prompt(text)
        with pytest.raises(InputError, match="lone surrogate"):
            gen.encode_prompt([{"role": "user", "content": text}]) if tiny.tokenizer.chat_template else tiny.tokenizer.encode(text)


def test_tokenizer_refuses_what_is_not_text(tiny: Model) -> None:
    tokenizer = tiny.tokenizer
    with pytest.raises(InputError, match="decode it first"):
        tokenizer.encode(b"w3 w4")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="must be a str"):
        tokenizer.encode(5)  # type: ignore[arg-type]
    for ids in ([1.5], ["5"], [True], [2**40]):
        with pytest.raises(TokenIdError):
            tokenizer.decode(ids)  # type: ignore[arg-type]


def test_prompts_that_are_neither_text_ids_nor_messages(tiny: Model) -> None:
    with Generator(tiny) as gen:
        with pytest.raises(InputError, match="decode it first"):
            gen.encode_prompt(b"w3 w4")  # type: ignore[arg-type]
        for prompt in ([{"role": "user", "content": "w3"}, 5], [{"role": "user", "content": "w3"}, "w4"]):
            with pytest.raises(InputError, match="chat messages are dicts"):
                gen.encode_prompt(prompt)  # type: ignore[arg-type]
        for ids in ([1, 1.5], [1, "5"], [True]):
            with pytest.raises(TokenIdError):
                gen.encode_prompt(ids)  # type: ignore[arg-type]


def test_chat_messages_must_be_string_dicts(tiny: Model) -> None:
    tokenizer = dataclasses.replace(tiny.tokenizer, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "w3"}]) == "w3"
    for messages in (["w3"], [{"role": "user"}], [{"role": "user", "content": 5}], [{"role": "user", "content": "x", "n": None}], "w3"):
        with pytest.raises(InputError, match="message"):
            tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def test_invalid_ids_are_refused_everywhere(tiny: Model) -> None:
    vocab = tiny.config.vocab_size
    with Generator(tiny) as gen:
        with pytest.raises(TokenIdError):
            gen.logits([vocab + 5])
        for ids in ([1.5], ["5"], [True], [-1], [2**40]):
            with pytest.raises(TokenIdError):
                gen.encode_prompt(ids)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="stop_token_ids"):
        SamplingConfig(stop_token_ids=(2**31,))


@pytest.mark.parametrize("choice", [None, float("nan"), 1.7, 3.0, "3", True, -1, 10**9, (1,)])
def test_a_choice_function_returning_no_token_id_fails_its_request(tiny: Model, choice: object) -> None:
    with Generator(tiny) as gen:
        with pytest.raises(TokenIdError, match="choice function returned"):
            gen.generate([3, 4], SamplingConfig(max_new_tokens=3, choose=lambda ids, probs: choice))  # type: ignore[arg-type, return-value]
        ok = gen.generate([3, 4], SamplingConfig(max_new_tokens=3, ignore_eos=True, choose=lambda ids, probs: int(ids[0])))
    assert len(ok.token_ids) == 3


def test_context_fills_refuse_bad_text_and_ids(tiny: Model) -> None:
    engine = Engine(tiny, paged_kv(4))
    ctx = Context(engine)
    ctx.fill("w3 w4")
    before = ctx.token_ids
    for fill in (lambda: ctx.fill("w5 \udcff"), lambda: ctx.fill(b"w5"), lambda: ctx.fill_tokens([1.5]),
                 lambda: ctx.fill_tokens([2**40]), lambda: ctx.fill_tokens([True])):
        with pytest.raises(InputError):
            fill()  # type: ignore[no-untyped-call]
    assert ctx.token_ids == before


# ------------------------------------------------------------------------------------------------
# Sampling and cache options: no silent coercions


@pytest.mark.parametrize("temperature", [1e-39, 1e-38, 5e-324, 1e-7])
def test_temperatures_too_small_to_divide_by_are_refused(temperature: float) -> None:
    with pytest.raises(ConfigError, match="temperature"):
        SamplingConfig(temperature=temperature)
    assert SamplingConfig(temperature=1e-6).temperature == 1e-6


@pytest.mark.parametrize(
    "option",
    [paged_kv(float("nan")), paged_kv(float("inf")), paged_kv(-1.0), paged_kv(8, page_size=2**40), paged_kv(8, page_size=1.5),  # type: ignore[arg-type]
     compressed_kv(2**40), prefix_cache(1.5), prefix_cache(True), prefix_cache(-1), dense_attention("bogus")],  # type: ignore[arg-type]
)
def test_invalid_cache_options_are_config_errors(tiny: Model, option: CacheOption) -> None:
    with pytest.raises(ConfigError):
        Engine(tiny, option)


# ------------------------------------------------------------------------------------------------
# Perplexity inputs


def test_perplexity_refuses_windows_and_chunks_it_cannot_serve(tiny: Model) -> None:
    ids = list(range(3, 40))
    context = tiny.config.max_position_embeddings
    for window, chunk, match in ((8, 100_000, "chunk=100000 is larger than window"), (context + 1, 8, "longer than"),
                                 (1, 1, "window"), (8, 0, "chunk"), (8.5, 2, "window"), (8, True, "chunk")):
        with pytest.raises(InputError, match=match):
            perplexity(tiny, ids, window=window, chunk=chunk)  # type: ignore[arg-type]
    assert perplexity(tiny, ids, window=8, chunk=8).windows == 5


def test_read_text_file_refuses_binary_undecodable_endless_and_missing(tmp_path: Path) -> None:
    text = tmp_path / "ok.txt"
    text.write_text("héllo wörld\n", encoding="utf-8")
    assert read_text_file(text) == "héllo wörld\n"
    binary = tmp_path / "bin"
    binary.write_bytes(b"\x7fELF\x00\x01\x02")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("abc\xff".encode("latin-1"))
    for path, match in ((binary, "binary"), (latin, "not UTF-8"), (Path("/dev/zero"), "binary"),
                        (tmp_path / "missing.txt", "cannot read"), (tmp_path, "cannot read")):
        with pytest.raises(InputError, match=match):
            read_text_file(path)
    with pytest.raises(InputError, match="larger than 4 bytes"):
        read_text_file(text, max_bytes=4)
