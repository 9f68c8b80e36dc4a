"""zgen's parameter layout, shared by every checkpoint format.

One dict per layer; the q/k/v projections and the gate/up projections are concatenated along their
output rows so that each costs one matmul. Linear weights keep the checkpoint's [out, in] layout.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from zgen.config import ModelConfig
from zgen.errors import CheckpointError

HostParams = dict[str, np.ndarray]  # flat "layers.3.qkv" → array, the on-disk form


def assemble(config: ModelConfig, get: Callable[[str], np.ndarray | None], source: str) -> HostParams:
    """Build zgen's flat parameters from per-projection tensors named in zgen's unfused scheme.

    ``get(name)`` returns a float array or None when the checkpoint lacks it; names are ``embed``,
    ``final_norm``, ``lm_head`` and ``layers.{i}.{input_norm,q,k,v,q_bias,k_bias,v_bias,q_norm,k_norm,
    o,post_norm,gate,up,down}``.
    """

    def need(name: str) -> np.ndarray:
        value = get(name)
        if value is None:
            raise CheckpointError(f"{source} has no tensor for {name!r}; is the checkpoint complete?")
        return value

    params: HostParams = {"embed": need("embed"), "final_norm": need("final_norm")}
    if not config.tie_word_embeddings:
        params["lm_head"] = need("lm_head")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        params[p + "input_norm"] = need(p + "input_norm")
        params[p + "qkv"] = np.concatenate([need(p + "q"), need(p + "k"), need(p + "v")], axis=0)
        params[p + "o"] = need(p + "o")
        params[p + "post_norm"] = need(p + "post_norm")
        params[p + "gate_up"] = np.concatenate([need(p + "gate"), need(p + "up")], axis=0)
        params[p + "down"] = need(p + "down")
        if config.attention_bias:
            params[p + "qkv_bias"] = np.concatenate(
                [need(p + "q_bias"), need(p + "k_bias"), need(p + "v_bias")], axis=0
            )
        if config.qk_norm:
            params[p + "q_norm"] = need(p + "q_norm")
            params[p + "k_norm"] = need(p + "k_norm")
    return params
