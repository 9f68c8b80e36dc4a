"""The LoRA modules of a batch job: adapters registered by name, chosen per request.

As with vLLM's ``--lora-modules``, a job registers adapters by name (``zgen batch --lora-modules
NAME=PATH[:SCALE]``; ``zgen.batch.run(..., lora_modules={"NAME": path | adapter | (either, scale)})``)
and a request picks one with its body's ``model`` equal to a registered name, or with zgen's own body
field ``"lora": "NAME"``. Requests naming none run on the base model, in the same engine steps as the
adapter requests (the engine gathers each row's adapter). Once modules are registered, a ``model`` that
is neither the base model's name nor a module's becomes an error record; a ``lora`` field naming no
registered module (or any ``lora`` field in a job without modules) does too. A job without modules
ignores ``model``, as before.

Resuming: the registered modules (each name's scale and weights' digest) are written beside the output
as ``<output>.lora.json`` before the first record. A later run on an output that already holds records
must register the same modules (names, weights, scales; where the files lie does not matter), or it is
refused: the records already written were made with the recorded ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np

from zgen.batch.format import BatchRequest, LineError
from zgen.config import ModelConfig
from zgen.errors import ConfigError, InputError
from zgen.lora.adapter import LoraAdapter, adapter_pairs, check_adapter, load_adapter

ModuleSource = str | Path | LoraAdapter
ModuleSpec = ModuleSource | tuple[ModuleSource, float]  # an adapter (a PEFT directory or loaded), with a scale
AdapterPairs = tuple[tuple[LoraAdapter, float], ...]


@dataclass(frozen=True)
class Selection:
    """What a request runs with: the name its response reports and its adapters (none: the base model)."""

    model: str
    adapters: AdapterPairs = ()


@dataclass(frozen=True)
class LoraModules:
    """The job's adapters by name (:func:`register_modules` builds it) and the base model's name."""

    base_name: str
    adapters: Mapping[str, tuple[LoraAdapter, float]] = field(default_factory=lambda: {})

    def select(self, request: BatchRequest) -> Selection | LineError:
        """The adapter ``request`` names with ``model`` or ``lora`` (module docstring), or why none fits."""
        model, lora = request.model, request.lora
        names = ", ".join(repr(n) for n in self.adapters)
        if lora is not None and not self.adapters:
            return _error(request, "invalid_parameter", f"lora={lora!r}, but this job registers no LoRA modules (zgen batch --lora-modules NAME=PATH)", "lora")
        if not self.adapters:
            return Selection(model or self.base_name)
        if model is not None and model != self.base_name and model not in self.adapters:
            message = f"model {model!r} is neither the base model {self.base_name!r} nor a LoRA module of this job ({names})"
            return _error(request, "model_not_found", message, "model")
        if lora is not None and lora not in self.adapters:
            return _error(request, "model_not_found", f"lora {lora!r} is not a LoRA module of this job ({names})", "lora")
        if lora is not None and model in self.adapters and model != lora:
            return _error(request, "invalid_parameter", f"model names the LoRA module {model!r} and lora names {lora!r}; name one", "lora")
        chosen = lora if lora is not None else model if model in self.adapters else None
        if chosen is None:
            return Selection(model or self.base_name)
        return Selection(chosen, (self.adapters[chosen],))

    def identity(self) -> dict[str, dict[str, object]]:
        """What resuming compares: each module's scale and weights' digest (and, for people, its source)."""
        return {
            name: {"scale": scale, "sha256": _digest(adapter), "source": None if adapter.source is None else str(adapter.source)}
            for name, (adapter, scale) in sorted(self.adapters.items())
        }


def _error(request: BatchRequest, code: str, message: str, param: str) -> LineError:
    return LineError(request.line, request.custom_id, code, message, param)


def register_modules(specs: Mapping[str, ModuleSpec] | None, *, base_name: str, config: ModelConfig) -> LoraModules:
    """The adapters of ``specs`` (name -> PEFT directory or loaded adapter, optionally with a scale)
    loaded and checked to fit a model of ``config``: an AdapterError for one that does not, a ConfigError
    for a name that cannot be told apart from the base model."""
    adapters: dict[str, tuple[LoraAdapter, float]] = {}
    for name, spec in (specs or {}).items():
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"a LoRA module's name must be non-empty text, got {name!r}")
        if name == base_name:
            raise ConfigError(f"the LoRA module {name!r} has the base model's name, so requests could not choose between them; rename it")
        source, scale = cast(tuple[ModuleSource, float], spec) if isinstance(spec, tuple) else (spec, 1.0)
        adapter = source if isinstance(source, LoraAdapter) else load_adapter(source, name=name)
        ((adapter, scale),) = adapter_pairs((adapter, scale))  # checks the scale
        check_adapter(adapter, config)
        adapters[name] = (adapter, scale)
    return LoraModules(base_name, adapters)


def _digest(adapter: LoraAdapter) -> str:
    digest = hashlib.sha256()
    for (layer, proj), module in sorted(adapter.modules.items()):
        digest.update(f"{layer}.{proj}.{module.scaling!r};".encode())
        digest.update(np.ascontiguousarray(module.a, np.float32).tobytes())
        digest.update(np.ascontiguousarray(module.b, np.float32).tobytes())
    return digest.hexdigest()


def modules_file(output: Path) -> Path:
    """Where the modules an output's records were made with are kept."""
    return output.with_name(output.name + ".lora.json")


def check_resume(output: Path, identity: Mapping[str, Mapping[str, object]], *, has_records: bool) -> None:
    """Refuse to add to ``output`` with other modules than its records were made with; for an output
    without records, note ``identity`` (hold the output's lock)."""
    path = modules_file(output)
    if not has_records:
        if identity:
            temporary = path.with_name(path.name + ".tmp")
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(identity, indent=2) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        else:
            path.unlink(missing_ok=True)
        return
    recorded = _recorded(path)
    if _compared(recorded) != _compared(identity):
        raise InputError(
            f"{output} holds results made with LoRA modules {_describe(recorded)}, and this run registers "
            f"{_describe(identity)}; resume with the same modules (names, weights and scales) or write to a new output"
        )


def _recorded(path: Path) -> Mapping[str, Mapping[str, object]]:
    if not path.exists():
        return {}
    try:
        raw: object = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read {path}, the LoRA modules of the job's results: {err}; restore it or start a new output") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in cast(dict[str, object], raw).values()):
        raise InputError(f"{path} does not list LoRA modules; restore it or start a new output")
    return cast(dict[str, dict[str, object]], raw)


def _compared(identity: Mapping[str, Mapping[str, object]]) -> dict[str, tuple[object, object]]:
    return {name: (entry.get("scale"), entry.get("sha256")) for name, entry in identity.items()}


def _describe(identity: Mapping[str, Mapping[str, object]]) -> str:
    if not identity:
        return "none"
    return ", ".join(f"{name}={entry.get('source') or '(loaded)'}:{entry.get('scale')}" for name, entry in identity.items())
