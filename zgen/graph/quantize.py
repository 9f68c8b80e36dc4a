"""Weight quantization as a transform of a graph's parameters: every weight a node reads only as a
matmul operand (:meth:`~zgen.graph.core.Node.linear_weights`) is replaced by a
:class:`~zgen.quantized_weights.QuantizedWeight`, which :func:`~zgen.graph.core.linear` multiplies
directly, and so is the LM head where the scheme asks for it (``head_bits``) and no embedding lookup
reads the same matrix. Embeddings and norms stay in the compute dtype."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from zgen.graph.core import Graph
from zgen.graph.nodes import Embed, LMHead
from zgen.quantized_weights import WeightQuantization, quantize, scale_dtype_for


def quantize_linear_weights(
    graph: Graph,
    params: Mapping[str, Any],
    scheme: WeightQuantization,
    dtype: jnp.dtype,
) -> dict[str, Any]:
    """``params`` (host or device arrays) on the device, with the graph's linear weights quantized by
    ``scheme`` (scales for compute ``dtype``) and the others cast to ``dtype``."""
    schemes = dict.fromkeys(graph.linear_weights(), scheme)
    head = scheme.head()
    if head is not None:
        looked_up = {node.weight for node in graph.nodes if isinstance(node, Embed)}
        schemes.update({node.weight: head for node in graph.nodes if isinstance(node, LMHead) and node.weight not in looked_up})
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name in schemes:
            # One matrix at a time, so a load holds at most one float32 copy on the device.
            out[name] = jax.block_until_ready(quantize(jnp.asarray(value), schemes[name], scale_dtype_for(dtype)))
        else:
            out[name] = jnp.asarray(value, dtype=dtype)
    return out
