"""Model configuration: one frozen dataclass for every supported decoder architecture."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zgen.errors import ConfigError, UnsupportedModelError

# HF `model_type` / `architectures[0]` → zgen architecture name.
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "LlamaForCausalLM": "llama",
    "mistral": "mistral",
    "MistralForCausalLM": "mistral",
    "qwen2": "qwen2",
    "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (`rope_scaling.rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on the q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"model config field {name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.architecture not in set(ARCHITECTURES.values()):
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; zgen supports "
                f"{sorted(set(ARCHITECTURES.values()))}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None) -> ModelConfig:
        """Build from a transformers `config.json` (and optionally `generation_config.json`)."""
        model_type = raw.get("model_type")
        listed: list[Any] = raw.get("architectures") or []
        archs = [str(a) for a in listed]
        architecture = ARCHITECTURES.get(str(model_type)) or next(
            (ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None
        )
        if architecture is None:
            raise UnsupportedModelError(
                f"config.json has model_type={model_type!r}, architectures={archs!r}; zgen supports "
                f"model types {sorted(set(ARCHITECTURES.values()))}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            head_dim = raw.get("head_dim") or hidden // heads
            rope_params: Mapping[str, Any] = raw.get("rope_parameters") or {}
            scaling_raw = raw.get("rope_scaling") or (rope_params if rope_params.get("rope_type") else None)
            rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
            if raw.get("attention_bias") and architecture != "qwen2":
                raise UnsupportedModelError(
                    f"attention_bias=true for {architecture} (biases on every attention projection) is not supported"
                )
            sliding = raw.get("sliding_window")
            if architecture in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
                sliding = None
            return cls(
                architecture=architecture,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=_rope_scaling(scaling_raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=architecture == "qwen2",  # Qwen2 always has q/k/v biases
                qk_norm=architecture == "qwen3",
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=_optional_int(raw.get("bos_token_id")),
                eos_token_ids=_eos_ids(raw, generation_config),
            )
        except KeyError as missing:
            raise ConfigError(f"config.json is missing the required field {missing}") from None
        except (TypeError, ValueError) as bad:
            raise ConfigError(f"config.json has a malformed value: {bad}") from None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _eos_ids(raw: Mapping[str, Any], generation_config: Mapping[str, Any] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation_config or {}, raw):
        value: Any = source.get("eos_token_id")
        items: list[Any] = value if isinstance(value, list) else [value]  # pyright: ignore[reportUnknownVariableType]
        for item in items:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def _rope_scaling(raw: Mapping[str, Any] | None) -> Llama3RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported; zgen supports 'llama3'")
    return Llama3RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


def rope_inverse_frequencies(config: ModelConfig) -> list[float]:
    """Per-pair rotary frequencies, with Llama-3.1 scaling applied where configured."""
    half = config.head_dim // 2
    inv = [1.0 / config.rope_theta ** (2 * i / config.head_dim) for i in range(half)]
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    scaled: list[float] = []
    for freq in inv:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            scaled.append(freq)
        elif wavelen > low_wavelen:
            scaled.append(freq / scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            scaled.append((1 - smooth) * freq / scaling.factor + smooth * freq)
    return scaled
