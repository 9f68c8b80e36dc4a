"""``add_rms_norm``: ``x + delta`` and its RMS norm, the work between two blocks of a decoder layer.

XLA leaves it as two or three launches (the add, the sum of squares, the scaling); in a batch-1 decode
step, where every launch costs more than its bytes, the Triton kernel does it in one.
"""

from __future__ import annotations

import functools

from jaxtyping import Array, Float

from zgen import numerics
from zgen.errors import ConfigError
from zgen.pallas.common import interpret_pallas, platform, with_reference_gradient


def add_rms_norm(
    x: Float[Array, "*rows size"],
    delta: Float[Array, "*rows size"],
    weight: Float[Array, " size"],
    eps: float,
    *,
    implementation: str | None = None,
) -> tuple[Float[Array, "*rows size"], Float[Array, "*rows size"]]:
    """The residual stream after a block (``x + delta``, rounded to the activation dtype) and its RMS
    norm times ``weight`` (normalised in float32, rounded, then scaled: :func:`zgen.numerics.rms_norm`).

    ``implementation``: None (Triton on GPUs, XLA elsewhere), "reference" / "xla" (the same XLA ops)
    or "triton" (differentiable: its gradient is the XLA ops').
    """
    if x.shape != delta.shape or x.dtype != delta.dtype or weight.shape != x.shape[-1:]:
        raise ConfigError(
            f"add_rms_norm needs x and delta of one shape and dtype and a weight over their last axis; got "
            f"x {x.dtype}{list(x.shape)}, delta {delta.dtype}{list(delta.shape)}, weight {list(weight.shape)}"
        )
    chosen = implementation or ("triton" if platform() == "gpu" else "xla")
    if chosen in ("reference", "xla"):
        return numerics.add_rms_norm(x, delta, weight, eps)
    if chosen == "triton":
        from zgen.pallas.rms_norm import triton

        kernel = functools.partial(triton.add_rms_norm, eps=eps, interpret=interpret_pallas())
        return with_reference_gradient(kernel, functools.partial(numerics.add_rms_norm, eps=eps))(x, delta, weight)
    raise ConfigError(f"unknown add_rms_norm implementation {chosen!r}; choose reference, xla, triton or None")
