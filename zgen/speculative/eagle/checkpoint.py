"""An EAGLE head on disk: ``head.json`` (the target's fingerprint, the feature layers, the last step)
and orbax checkpoints of the head's parameters and optimizer state per saved step (``steps/``).

Training saves as it goes and continues from the last saved step when run again; :func:`load_head`
reads the parameters of the last step, and refuses a head whose target is not the given model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from zgen.errors import CheckpointError
from zgen.model import Model
from zgen.speculative.eagle.head import EagleHead, fingerprint, head_param_shapes

META = "head.json"
STEPS = "steps"
FORMAT = 1


@dataclass(frozen=True)
class HeadMeta:
    """What ``head.json`` records."""

    fingerprint: str  # the target's (:func:`~zgen.speculative.eagle.head.fingerprint`)
    target: str  # the target's name, for messages
    feature_layers: tuple[int, ...]
    step: int  # the last saved training step
    format: int = FORMAT


def _stored(params: dict[str, Any]) -> dict[str, Any]:
    # orbax names files after the keys: keep dots (parameter paths) out of them
    return {name.replace(".", "__"): value for name, value in params.items()}


def _unstored(params: dict[str, Any]) -> dict[str, Any]:
    return {name.replace("__", "."): value for name, value in params.items()}


def read_meta(path: Path) -> HeadMeta | None:
    """The head's record, or ``None`` where nothing was saved yet."""
    file = path / META
    if not file.exists():
        return None
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        layers = tuple(int(i) for i in raw["feature_layers"])
        meta = HeadMeta(str(raw["fingerprint"]), str(raw["target"]), layers, int(raw["step"]), int(raw["format"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{file} is not an EAGLE head record ({err}): point to a directory `zgen eagle train --out` wrote") from err
    if meta.format != FORMAT:
        raise CheckpointError(f"{file} has format {meta.format}; this zgen reads format {FORMAT}: train the head again")
    return meta


def _manager(path: Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager((path / STEPS).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2))


def save(path: Path, meta: HeadMeta, params: dict[str, jax.Array], opt_state: Any) -> None:
    """Save a training step (the parameters and optimizer state, then the record that points at them)."""
    path.mkdir(parents=True, exist_ok=True)
    with _manager(path) as manager:
        saved = ocp.args.Composite(params=ocp.args.StandardSave(_stored(params)), opt_state=ocp.args.StandardSave(opt_state))
        manager.save(meta.step, args=saved)
        manager.wait_until_finished()
    record = asdict(meta) | {"feature_layers": list(meta.feature_layers)}
    tmp = path / (META + ".tmp")
    tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    tmp.replace(path / META)


def restore(path: Path, meta: HeadMeta, params: dict[str, Any], opt_state: Any | None) -> tuple[dict[str, jax.Array], Any]:
    """The parameters (and the optimizer state, given its template) saved at ``meta.step``;
    ``params``: a template of the parameters (arrays or shape structs)."""
    items: dict[str, Any] = {"params": ocp.args.StandardRestore(_stored(params))}
    if opt_state is not None:
        items["opt_state"] = ocp.args.StandardRestore(opt_state)
    try:
        with _manager(path) as manager:
            restored = manager.restore(meta.step, args=ocp.args.Composite(**items))
    except Exception as err:  # orbax raises many types for a missing or damaged step
        raise CheckpointError(f"cannot read step {meta.step} of the EAGLE head in {path}: {err}") from err
    return _unstored(dict(restored["params"])), restored["opt_state"] if opt_state is not None else None


def check_target(meta: HeadMeta, model: Model, path: Path) -> None:
    """Refuse a head trained for another model."""
    if meta.fingerprint != fingerprint(model):
        raise CheckpointError(
            f"the EAGLE head in {path} was trained for {meta.target}, not for this model (their configs or weights "
            "differ): load it with its own target, or train a head for this model with `zgen eagle train`"
        )


def load_head(path: str | Path, model: Model) -> EagleHead:
    """The head saved in ``path`` for ``model`` (its last step, in the model's dtype)."""
    directory = Path(path)
    meta = read_meta(directory)
    if meta is None:
        raise CheckpointError(f"{directory} holds no EAGLE head ({META} is missing): train one with `zgen eagle train --out {directory}`")
    check_target(meta, model, directory)
    shapes = head_param_shapes(model.config, meta.feature_layers)
    template = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
    params, _ = restore(directory, meta, template, None)
    return EagleHead(model, {name: jnp.asarray(value, model.dtype) for name, value in params.items()}, meta.feature_layers)
