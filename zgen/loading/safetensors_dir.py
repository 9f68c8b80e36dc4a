"""HF transformers checkpoint directories: config.json + single or sharded *.safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from zgen.config import ModelConfig
from zgen.errors import CheckpointError, ConfigError, ModelNotFoundError
from zgen.loading.params import HostParams, assemble

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
    return ModelConfig.from_hf(raw, read_json(generation) if generation.exists() else None)


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        files = sorted({directory / str(name) for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{directory} holds no *.safetensors weights")
    for file in files:
        if not file.exists():
            raise ModelNotFoundError(f"{file} is named by the safetensors index but missing")
    return files


def _zgen_name(hf_name: str) -> str | None:
    if hf_name.startswith("model.layers."):
        index, rest = hf_name[len("model.layers.") :].split(".", 1)
        short = _LAYER_TENSORS.get(rest)
        return None if short is None else f"layers.{index}.{short}"
    return _GLOBAL_TENSORS.get(hf_name)


def params_from_dir(directory: Path, config: ModelConfig) -> HostParams:
    tensors: dict[str, np.ndarray] = {}
    for file in _weight_files(directory):
        try:
            # "flax" reads bfloat16, which numpy lacks.
            with safe_open(file, framework="flax") as handle:
                for hf_name in handle.keys():
                    name = _zgen_name(hf_name)
                    if name is not None:
                        tensors[name] = np.asarray(handle.get_tensor(hf_name).astype("float32"))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(
                f"{file} is not a valid safetensors file ({err}); it may be truncated or corrupt: copy it again"
            ) from err
    if config.tie_word_embeddings and "lm_head" in tensors:
        del tensors["lm_head"]
    if not config.tie_word_embeddings and "lm_head" not in tensors:
        raise ConfigError(f"{directory}: config says tie_word_embeddings=false but there is no lm_head.weight")
    return assemble(config, tensors.get, str(directory))
