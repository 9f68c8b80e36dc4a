"""Model configuration: one frozen dataclass for every supported decoder architecture."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

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


# Bounds on what a config may ask for. Token ids, positions and sizes live in int32 arrays on the
# device. The graph is built per layer and RoPE tables per head-dim pair, so those two are also bounded
# on their own (no published model comes near either): a corrupt header cannot make a load build
# without limit, even where no weights are compared (random_model).
MAX_SIZE = 2**31 - 1
MAX_LAYERS = 1024
MAX_HEAD_DIM = 4096


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (`rope_scaling.rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not _is_finite_real(value) or value <= 0:
                raise ConfigError(f"rope_scaling.{name} must be a finite positive number, got {value!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor}); fix the config"
            )
        n = self.original_max_position_embeddings
        if not _is_int(n) or not 1 <= n <= MAX_SIZE:
            raise ConfigError(f"rope_scaling.original_max_position_embeddings must be an integer in [1, 2**31), got {n!r}")


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
        """Every field is checked for type and range: a wrong value is a ConfigError here, never a
        NaN, an exception or an unbounded allocation later."""
        if self.architecture not in set(ARCHITECTURES.values()):
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; zgen supports "
                f"{sorted(set(ARCHITECTURES.values()))}"
            )
        upper = {"num_layers": MAX_LAYERS, "head_dim": MAX_HEAD_DIM}
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= upper.get(name, MAX_SIZE):
                raise ConfigError(
                    f"model config field {name} must be an integer in [1, {upper.get(name, MAX_SIZE)}], got {value!r}; "
                    "the config is corrupt or not for this checkpoint"
                )
        if not _is_finite_real(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise ConfigError(f"model config field rms_norm_eps must be a finite positive number, got {self.rms_norm_eps!r}")
        # theta < 1 would give rotary frequencies above 1 that grow with the pair index (and overflow).
        if not _is_finite_real(self.rope_theta) or self.rope_theta < 1:
            raise ConfigError(f"model config field rope_theta must be a finite number >= 1, got {self.rope_theta!r}")
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model config field {name} must be a bool, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or not 1 <= self.sliding_window <= MAX_SIZE):
            raise ConfigError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        special = ([] if self.bos_token_id is None else [("bos_token_id", self.bos_token_id)]) + [
            ("eos_token_id", i) for i in self.eos_token_ids
        ]
        for name, token in special:
            if not _is_int(token) or not 0 <= token < self.vocab_size:
                raise ConfigError(
                    f"{name} {token!r} is not a token id of the vocabulary [0, {self.vocab_size}); fix it in "
                    "config.json / generation_config.json (or the GGUF metadata)"
                )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None) -> ModelConfig:
        """Build from a transformers `config.json` (and optionally `generation_config.json`)."""
        model_type = raw.get("model_type")
        listed: object = raw.get("architectures") or []
        if not isinstance(listed, list):
            raise ConfigError(f"config field 'architectures' must be a list of names, got {listed!r}")
        archs = [str(a) for a in cast(list[object], listed)]
        architecture = ARCHITECTURES.get(str(model_type)) or next(
            (ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None
        )
        if architecture is None:
            raise UnsupportedModelError(
                f"config.json has model_type={model_type!r}, architectures={archs!r}; zgen supports "
                f"model types {sorted(set(ARCHITECTURES.values()))}"
            )
        try:
            hidden = _int_field(raw, "hidden_size")
            heads = _int_field(raw, "num_attention_heads")
            # Absent (or null) head_dim / num_key_value_heads take HF's defaults; an explicit 0 is refused.
            head_dim = _int_field(raw, "head_dim", hidden // heads if heads > 0 else 0)
            rope_params = _mapping_field(raw, "rope_parameters")
            scaling_raw = _mapping_field(raw, "rope_scaling") or (rope_params if rope_params.get("rope_type") else {})
            rope_theta = _float_field(raw, "rope_theta", _float_field(rope_params, "rope_theta", 10000.0))
            if _bool_field(raw, "attention_bias", False) and architecture != "qwen2":
                raise UnsupportedModelError(
                    f"attention_bias=true for {architecture} (biases on every attention projection) is not supported"
                )
            sliding = _int_field(raw, "sliding_window", 0)
            if architecture in ("qwen2", "qwen3") and not _bool_field(raw, "use_sliding_window", False):
                sliding = 0
            return cls(
                architecture=architecture,
                vocab_size=_int_field(raw, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_int_field(raw, "intermediate_size"),
                num_layers=_int_field(raw, "num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=_int_field(raw, "num_key_value_heads", heads),
                head_dim=head_dim,
                max_position_embeddings=_int_field(raw, "max_position_embeddings", 4096),
                rms_norm_eps=_float_field(raw, "rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=_rope_scaling(scaling_raw),
                tie_word_embeddings=_bool_field(raw, "tie_word_embeddings", False),
                attention_bias=architecture == "qwen2",  # Qwen2 always has q/k/v biases
                qk_norm=architecture == "qwen3",
                sliding_window=sliding or None,
                bos_token_id=_int_field(raw, "bos_token_id", None),
                eos_token_ids=_eos_ids(raw, generation_config),
            )
        except KeyError as missing:
            raise ConfigError(f"config.json is missing the required field {missing}") from None


_ABSENT: Any = object()


def _present(raw: Mapping[str, Any], key: str, default: Any) -> Any:
    """``raw[key]``, where JSON null counts as absent; KeyError when absent without a default."""
    value = raw.get(key)
    if value is None:
        if default is _ABSENT:
            raise KeyError(key)
        return default
    return value


def _int_value(value: Any, key: str) -> int:
    # JSON has one number type: an integral float (4096.0) is an integer, 64.5 or "64" is not.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise ConfigError(f"config field {key!r} must be an integer, got {value!r}")
    return int(value)


def _int_field(raw: Mapping[str, Any], key: str, default: Any = _ABSENT) -> Any:
    """The integer ``raw[key]``, or ``default`` (returned as given) when it is absent."""
    value = _present(raw, key, default)
    return value if value is default else _int_value(value, key)


def _float_field(raw: Mapping[str, Any], key: str, default: Any = _ABSENT) -> float:
    value = _present(raw, key, default)
    if not _is_finite_real(value):
        raise ConfigError(f"config field {key!r} must be a finite number, got {value!r}")
    return float(value)


def _bool_field(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = _present(raw, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config field {key!r} must be true or false, got {value!r}")
    return value


def _mapping_field(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = _present(raw, key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"config field {key!r} must be an object, got {value!r}")
    return cast(Mapping[str, Any], value)


def _eos_ids(raw: Mapping[str, Any], generation_config: Mapping[str, Any] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation_config or {}, raw):
        value: Any = source.get("eos_token_id")
        items: list[Any] = value if isinstance(value, list) else [value]  # pyright: ignore[reportUnknownVariableType]
        for item in items:
            if item is not None and (token := _int_value(item, "eos_token_id")) not in ids:
                ids.append(token)
    return tuple(ids)


def _rope_scaling(raw: Mapping[str, Any]) -> Llama3RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported; zgen supports 'llama3'")
    return Llama3RopeScaling(
        factor=_float_field(raw, "factor"),
        low_freq_factor=_float_field(raw, "low_freq_factor"),
        high_freq_factor=_float_field(raw, "high_freq_factor"),
        original_max_position_embeddings=_int_field(raw, "original_max_position_embeddings"),
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
