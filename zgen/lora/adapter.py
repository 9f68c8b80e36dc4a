"""LoRA adapters in PEFT's format, mapped onto zgen's fused weights.

A PEFT adapter directory holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, optional ``rank_pattern``/``alpha_pattern``) and ``adapter_model.safetensors``
with ``...layers.{i}.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight`` ([out, r]).
A targeted projection computes ``W x + scaling * B (A x)``, ``scaling = alpha / r`` (``alpha /
sqrt(r)`` with rsLoRA). Dropout only acts in training and is ignored.

zgen fuses q/k/v into one ``qkv`` weight and gate/up into ``gate_up`` (:mod:`zgen.loading.params`).
The adapters of the parts of a fused weight become one low-rank pair for it: their ``A`` stacked along
the rank, their ``B`` placed block-diagonally at each part's output rows (:func:`fused_factors`), so
``B_fused A_fused x`` is exactly the parts' corrections concatenated.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
from safetensors import SafetensorError, safe_open

from zgen.config import ModelConfig
from zgen.errors import AdapterError
from zgen.loading.params import check_values

# PEFT's module names (Llama-family checkpoints) -> zgen's unfused projection names.
TARGETS: dict[str, str] = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
}
# zgen's fused weights and the projections each one concatenates, in row order.
FUSED: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
_TENSOR = re.compile(r"(?:^|.*\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True, eq=False)
class LoraModule:
    """One adapted projection: ``a`` [r, in], ``b`` [out, r] (float32) and its ``scaling``."""

    a: np.ndarray
    b: np.ndarray
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True, eq=False)  # compared by identity: a loaded adapter is one set of weights
class LoraAdapter:
    """A loaded LoRA adapter: its modules by ``(layer, projection)`` with projection in
    ``q k v o gate up down``."""

    name: str
    rank: int
    alpha: float
    use_rslora: bool
    modules: Mapping[tuple[int, str], LoraModule]
    source: Path | None = None

    def __repr__(self) -> str:
        targets = sorted({p for _, p in self.modules})
        return f"LoraAdapter({self.name!r}, rank={self.rank}, alpha={self.alpha:g}, targets={targets})"


def load_adapter(path: str | Path, *, name: str | None = None) -> LoraAdapter:
    """Read a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    directory = Path(path).expanduser()
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise AdapterError(f"{directory} is not a PEFT LoRA adapter: it has no {needed.name}")
    try:
        raw: Any = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AdapterError(f"{config_file} is not readable JSON: {err}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{config_file} must hold a JSON object")
    config = cast(dict[str, Any], raw)
    _check_config(config, config_file)
    rank, alpha, rslora = int(config["r"]), float(config.get("lora_alpha", config["r"])), bool(config.get("use_rslora", False))
    tensors = _read_tensors(weights_file)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        check_values(value, f"{weights_file}: tensor {key!r}")
        match = _TENSOR.fullmatch(key)
        if match is None or match.group(2) not in TARGETS:
            raise AdapterError(
                f"{weights_file}: tensor {key!r} adapts a module zgen cannot adapt; LoRA targets are "
                f"{', '.join(TARGETS)} (no embeddings, lm_head, biases or DoRA magnitudes)"
            )
        halves.setdefault((int(match.group(1)), TARGETS[match.group(2)]), {})[match.group(3)] = value
    if not halves:
        raise AdapterError(f"{weights_file} holds no LoRA weights")
    modules: dict[tuple[int, str], LoraModule] = {}
    for (layer, proj), pair in sorted(halves.items()):
        where = f"{weights_file}: layer {layer} {proj}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where} has lora_{next(iter(pair))} without its other half")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where}: lora_A {a.shape} and lora_B {b.shape} are not a low-rank pair [r, in], [out, r]")
        module_name = f"model.layers.{layer}.{'mlp' if proj in ('gate', 'up', 'down') else 'self_attn'}.{proj}_proj"
        r = int(_pattern_value(config.get("rank_pattern"), module_name, rank))
        if a.shape[0] != r:
            raise AdapterError(f"{where} has rank {a.shape[0]} but adapter_config.json says r={r}; the files do not belong together")
        a_value = float(_pattern_value(config.get("alpha_pattern"), module_name, alpha))
        scaling = a_value / math.sqrt(r) if rslora else a_value / r
        modules[(layer, proj)] = LoraModule(a, b, scaling)
    return LoraAdapter(name or directory.name, rank, alpha, rslora, modules, directory)


def random_adapter(
    config: ModelConfig, rank: int, *, seed: int = 0, targets: Sequence[str] = ("q", "k", "v", "o", "gate", "up", "down"),
    alpha: float | None = None, name: str | None = None,
) -> LoraAdapter:
    """An adapter of ``rank`` on every layer's ``targets`` with random A and B (B nonzero, unlike a
    freshly initialised one), for speed runs and tests where no trained adapter is at hand."""
    rng = np.random.default_rng(seed)
    alpha = float(2 * rank if alpha is None else alpha)
    modules: dict[tuple[int, str], LoraModule] = {}
    for layer in range(config.num_layers):
        for proj in targets:
            out, into = projection_shape(config, proj)
            a = (rng.standard_normal((rank, into)) * into**-0.5).astype(np.float32)
            b = (rng.standard_normal((out, rank)) * rank**-0.5 * 0.1).astype(np.float32)
            modules[(layer, proj)] = LoraModule(a, b, alpha / rank)
    return LoraAdapter(name or f"random-{seed}", rank, alpha, False, modules)


_FINGERPRINTS: weakref.WeakKeyDictionary[LoraAdapter, str] = weakref.WeakKeyDictionary()


def adapter_fingerprint(adapter: LoraAdapter) -> str:
    """SHA-256 of what an adapter computes: every module's layer, projection, scaling and A and B
    values (not its name or path). Computed once per adapter object."""
    if adapter not in _FINGERPRINTS:
        digest = hashlib.sha256()
        for (layer, proj), module in sorted(adapter.modules.items()):
            digest.update(f"{layer}.{proj}:{module.scaling!r}:{module.a.shape}:{module.b.shape}".encode())
            digest.update(np.ascontiguousarray(module.a, np.float32).tobytes())
            digest.update(np.ascontiguousarray(module.b, np.float32).tobytes())
        _FINGERPRINTS[adapter] = digest.hexdigest()
    return _FINGERPRINTS[adapter]


def check_adapter(adapter: LoraAdapter, config: ModelConfig) -> None:
    """``adapter`` fits a model of ``config``: its layers exist and every pair has the projection's shape."""
    for (layer, proj), module in adapter.modules.items():
        if layer >= config.num_layers:
            raise AdapterError(
                f"adapter {adapter.name!r} adapts layer {layer} but the model has {config.num_layers} layers; "
                "it was trained for another base model"
            )
        out, into = projection_shape(config, proj)
        if module.a.shape[1] != into or module.b.shape[0] != out:
            raise AdapterError(
                f"adapter {adapter.name!r}: layer {layer} {proj} maps {module.a.shape[1]} -> {module.b.shape[0]} "
                f"features, but this model's {proj} projection maps {into} -> {out}; it was trained for another base model"
            )


def projection_shape(config: ModelConfig, proj: str) -> tuple[int, int]:
    """(out, in) features of an unfused projection."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "q": (q, c.hidden_size), "k": (kv, c.hidden_size), "v": (kv, c.hidden_size), "o": (c.hidden_size, q),
        "gate": (c.intermediate_size, c.hidden_size), "up": (c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }[proj]


AdapterMix = Sequence[tuple[LoraAdapter, float]]  # adapters applied together, each with its scale
# What a request may name: one adapter (scale 1), an (adapter, scale) pair, or several of either.
AdapterChoice = LoraAdapter | tuple[LoraAdapter, float] | Sequence[LoraAdapter | tuple[LoraAdapter, float]]


def adapter_pairs(choice: AdapterChoice | None) -> tuple[tuple[LoraAdapter, float], ...]:
    """``choice`` as (adapter, scale) pairs."""
    if choice is None:
        return ()
    if isinstance(choice, LoraAdapter):
        return ((choice, 1.0),)
    if isinstance(choice, tuple) and len(choice) == 2 and isinstance(choice[0], LoraAdapter) and not isinstance(choice[1], LoraAdapter):
        scale = choice[1]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise AdapterError(f"an adapter's scale must be a finite number, got {scale!r}")
        return ((choice[0], float(scale)),)
    if isinstance(choice, Sequence) and not isinstance(choice, str):
        items = cast(Sequence[LoraAdapter | tuple[LoraAdapter, float]], choice)
        return tuple(pair for item in items for pair in adapter_pairs(item))
    raise AdapterError(
        f"adapter= takes a LoraAdapter (zgen.load_adapter), an (adapter, scale) pair or a list of them, got {type(choice).__name__}"
    )


def fused_factors(mix: AdapterMix, config: ModelConfig, layer: int, fused: str) -> tuple[np.ndarray, np.ndarray] | None:
    """One low-rank pair ``(A [R, in], B [out, R])`` for fused weight ``fused`` of ``layer`` whose
    product is the sum of ``mix``'s scaled corrections (module docstring); None if none adapts it."""
    parts = FUSED[fused]
    sizes = [projection_shape(config, p)[0] for p in parts]
    offsets = np.cumsum([0, *sizes])
    a_blocks: list[np.ndarray] = []
    b_blocks: list[np.ndarray] = []
    for adapter, scale in mix:
        for n, part in enumerate(parts):
            module = adapter.modules.get((layer, part))
            if module is None:
                continue
            b = np.zeros((int(offsets[-1]), module.rank), np.float32)
            b[offsets[n] : offsets[n + 1]] = module.b * np.float32(scale * module.scaling)
            a_blocks.append(module.a)
            b_blocks.append(b)
    if not a_blocks:
        return None
    return np.concatenate(a_blocks, axis=0), np.concatenate(b_blocks, axis=1)


def _check_config(config: dict[str, Any], source: Path) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{source}: peft_type {peft_type!r} is not LoRA; zgen loads LoRA adapters only")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"{source}: the rank r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{source}: lora_alpha must be a finite number, got {alpha!r}")
    if config.get("use_dora"):
        raise AdapterError(f"{source}: DoRA adapters (use_dora) are not supported; merge it into the base model with peft first")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise AdapterError(
            f"{source}: the adapter also trains biases or whole modules (bias / modules_to_save); zgen applies "
            "low-rank pairs only: merge it into the base model with peft first"
        )
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in cast(list[object], targets) if t not in TARGETS]
        if unknown:
            raise AdapterError(f"{source}: unknown target modules {unknown}; zgen adapts {', '.join(TARGETS)}")


def _pattern_value(patterns: object, module: str, default: float) -> float:
    """PEFT's per-module override: the first key that matches the end of the module's name."""
    if isinstance(patterns, dict):
        for key, value in cast(dict[str, object], patterns).items():
            if re.fullmatch(rf"(.*\.)?{key}", module) and isinstance(value, (int, float)):
                return float(value)
    return default


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    try:
        # "flax" reads bfloat16, which numpy lacks.
        with safe_open(str(path), framework="flax") as handle:
            return {key: np.asarray(handle.get_tensor(key), np.float32) for key in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise AdapterError(f"{path} is not a readable safetensors file: {err}") from None
