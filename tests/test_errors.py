"""Bad input gets a typed error that says what was wrong, and leaves files and caches intact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.hf_reference import save_random_checkpoint, small_configs
from zgen import Generator, SamplingConfig, load_model
from zgen.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    ModelNotFoundError,
    PromptTooLongError,
    TokenIdError,
    UnsupportedModelError,
)
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
