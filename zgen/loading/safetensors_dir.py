"""HF transformers checkpoint directories: config.json + single or sharded *.safetensors."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from zgen.config import ModelConfig
from zgen.errors import CheckpointError, ConfigError, ModelNotFoundError
from zgen.loading.params import HostParams, assemble, check_layer_count, layer_tensor_name

_LAYER_TENSORS = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "o",
    "post_attention_layernorm.weight": "post_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
_GLOBAL_TENSORS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path} does not exist; an HF model directory needs it") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); restore the file from the original checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def config_from_dir(directory: Path) -> ModelConfig:
    raw = read_json(directory / "config.json")
    generation = directory / "generation_config.json"
    try:
        return ModelConfig.from_hf(raw, read_json(generation) if generation.exists() else None)
    except ConfigError as err:
        raise ConfigError(f"{directory / 'config.json'}: {err}") from None


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        files = sorted({_shard(directory, index, name) for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{directory} holds no *.safetensors weights")
    for file in files:
        if not file.exists():
            raise ModelNotFoundError(f"{file} is named by the safetensors index but missing")
    return files


def _shard(directory: Path, index: Path, name: object) -> Path:
    """A shard the index names: a file name inside the model directory, never a path out of it."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index} names a shard {name!r}; shard names must be file names")
    shard = directory / name
    if shard.resolve().parent != directory.resolve():
        raise CheckpointError(
            f"{index} names the shard {name!r} outside the model directory {directory}; a checkpoint reads only "
            "its own files: fix the index"
        )
    return shard


def _zgen_name(hf_name: str) -> str | None:
    if hf_name.startswith("model.layers."):
        index, _, rest = hf_name[len("model.layers.") :].partition(".")
        return layer_tensor_name(index, _LAYER_TENSORS.get(rest))
    return _GLOBAL_TENSORS.get(hf_name)


@contextlib.contextmanager
def _shard_reader(file: Path) -> Iterator[Any]:
    """An open shard; any way the file is unreadable becomes a CheckpointError naming it."""
    try:
        # "flax" reads bfloat16, which numpy lacks.
        with safe_open(file, framework="flax") as handle:
            yield handle
    except (SafetensorError, OSError, ValueError, TypeError) as err:
        raise CheckpointError(
            f"{file} is not a valid safetensors file ({err}); it may be truncated or corrupt: copy it again"
        ) from err


def params_from_dir(directory: Path, config: ModelConfig) -> HostParams:
    """The checkpoint's parameters in zgen's layout. The tensor names, read from the file headers
    alone, are checked against the config's layer count before any tensor is read."""
    files = _weight_files(directory)
    names: list[str] = []
    for file in files:
        with _shard_reader(file) as handle:
            names += [name for hf_name in handle.keys() if (name := _zgen_name(hf_name)) is not None]
    check_layer_count(config, names, str(directory))
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        with _shard_reader(file) as handle:
            for hf_name in handle.keys():
                name = _zgen_name(hf_name)
                if name is not None:
                    tensors[name] = np.asarray(handle.get_tensor(hf_name).astype("float32"))
    if config.tie_word_embeddings and "lm_head" in tensors:
        del tensors["lm_head"]
    if not config.tie_word_embeddings and "lm_head" not in tensors:
        raise ConfigError(f"{directory}: config says tie_word_embeddings=false but there is no lm_head.weight")
    return assemble(config, tensors.get, str(directory))
