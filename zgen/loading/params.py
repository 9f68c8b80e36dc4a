"""zgen's parameter layout, shared by every checkpoint format.

One dict per layer; the q/k/v projections and the gate/up projections are concatenated along their
output rows so that each costs one matmul. Linear weights keep the checkpoint's [out, in] layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import ml_dtypes
import numpy as np

from zgen.config import ModelConfig
from zgen.errors import CheckpointError, ConfigError

HostParams = dict[str, np.ndarray]  # flat "layers.3.qkv" → array, the on-disk form


def stack_rows(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def assemble(
    config: ModelConfig,
    get: Callable[[str], Any],
    source: str,
    linear: Callable[[list[Any]], Any] = stack_rows,
) -> dict[str, Any]:
    """Build zgen's flat parameters from per-projection tensors named in zgen's unfused scheme.

    ``get(name)`` returns a float array or None when the checkpoint lacks it; names are ``embed``,
    ``final_norm``, ``lm_head`` and ``layers.{i}.{input_norm,q,k,v,q_bias,k_bias,v_bias,q_norm,k_norm,
    o,post_norm,gate,up,down}``. ``linear(parts)`` makes one matmul weight of projections stacked
    along their output rows (a checkpoint's quantized projections need their own stacking).
    """

    def need(name: str) -> Any:
        value = get(name)
        if value is None:
            raise CheckpointError(f"{source} has no tensor for {name!r}; is the checkpoint complete?")
        return value

    params: dict[str, Any] = {"embed": need("embed"), "final_norm": need("final_norm")}
    if not config.tie_word_embeddings:
        params["lm_head"] = need("lm_head")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        params[p + "input_norm"] = need(p + "input_norm")
        params[p + "qkv"] = linear([need(p + "q"), need(p + "k"), need(p + "v")])
        params[p + "o"] = linear([need(p + "o")])
        params[p + "post_norm"] = need(p + "post_norm")
        params[p + "gate_up"] = linear([need(p + "gate"), need(p + "up")])
        params[p + "down"] = linear([need(p + "down")])
        if config.attention_bias:
            params[p + "qkv_bias"] = np.concatenate(
                [need(p + "q_bias"), need(p + "k_bias"), need(p + "v_bias")], axis=0
            )
        if config.qk_norm:
            params[p + "q_norm"] = need(p + "q_norm")
            params[p + "k_norm"] = need(p + "k_norm")
    return params


def layer_tensor_name(index: str, short: str | None) -> str | None:
    """zgen's unfused name of a per-layer tensor (``layers.3.q``); None for tensors zgen does not read
    (an unknown projection, or a layer index that is not a number of at most 9 ASCII digits)."""
    if short is None or not (index.isascii() and index.isdigit() and len(index) <= 9):
        return None
    return f"layers.{int(index)}.{short}"


def check_layer_count(config: ModelConfig, names: Iterable[str], source: str) -> None:
    """The checkpoint holds exactly the config's layers, judged by tensor names (``layer_tensor_name``)
    before any tensor is read or anything is built, so a corrupt layer count drives no allocation."""
    held = {int(name.split(".")[1]) for name in names if name.startswith("layers.")}
    expected = config.num_layers
    beyond = sorted(i for i in held if i >= expected)
    if beyond:
        raise CheckpointError(
            f"{source}: the weights hold {len(held)} layers, up to layer {beyond[-1]}, but the config says "
            f"{expected}; fix the layer count in the config (num_hidden_layers / block_count)"
        )
    missing = sorted(set(range(expected)) - held)
    if missing:
        raise CheckpointError(
            f"{source}: the config asks for {expected} layers but the weights hold {len(held)} (none for layers "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}); the config does not belong to these weights, or "
            "the checkpoint is incomplete"
        )


def check_values(value: np.ndarray, what: str, dtype: np.dtype[Any] | type = np.float32) -> None:
    """``value`` holds only finite numbers within ``dtype``'s range (CheckpointError for NaN or inf:
    a corrupt file; ConfigError for finite values beyond the range: a dtype too narrow for them)."""
    low, high = float(value.min()), float(value.max())  # NaN propagates through both
    limit = float(cast(Any, ml_dtypes.finfo(dtype)).max)  # numpy's finfo does not know bfloat16
    if -limit <= low and high <= limit:
        return
    if not (math.isfinite(low) and math.isfinite(high)):
        raise CheckpointError(
            f"{what} holds NaN or infinite values; the file is corrupt (overwritten or badly converted): download "
            "or copy it again"
        )
    raise ConfigError(
        f"{what} holds values in [{low:g}, {high:g}], beyond {np.dtype(dtype).name}'s range; load the model in "
        "bfloat16 or float32"
    )
