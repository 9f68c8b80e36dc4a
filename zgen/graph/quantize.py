"""Weight quantization as a transform of a graph's parameters: every weight a node reads only as a
matmul operand (:meth:`~zgen.graph.core.Node.linear_weights`) is replaced by a
:class:`~zgen.quantized_weights.QuantizedWeight`, which :func:`~zgen.graph.core.linear` multiplies
directly. Embeddings, norms and the LM head stay in the compute dtype: they are not in that list."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from zgen.graph.core import Graph
from zgen.quantized_weights import WeightQuantization, quantize, scale_dtype_for


def quantize_linear_weights(
    graph: Graph,
    params: Mapping[str, Any],
    scheme: WeightQuantization,
    dtype: jnp.dtype,
) -> dict[str, Any]:
    """``params`` (host or device arrays) on the device, with the graph's linear weights quantized by
    ``scheme`` (scales for compute ``dtype``) and the others cast to ``dtype``."""
    linear = set(graph.linear_weights())
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name in linear:
            # One matrix at a time, so a load holds at most one float32 copy on the device.
            out[name] = jax.block_until_ready(quantize(jnp.asarray(value), scheme, scale_dtype_for(dtype)))
        else:
            out[name] = jnp.asarray(value, dtype=dtype)
    return out
