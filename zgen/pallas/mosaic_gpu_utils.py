"""Helpers shared by the kernels written against the Pallas Mosaic GPU backend (Hopper)."""

from __future__ import annotations

from typing import Any, TypeAlias

from jax.experimental.pallas import mosaic_gpu as plgpu

# GMEM, SMEM and accumulator refs share no public type that the Mosaic GPU primitives accept.
Ref: TypeAlias = Any
# jax renamed the row layout of a WGMMA tile between releases.
ROW_LAYOUT = getattr(plgpu.Layout, "WGMMA_ROW", None) or plgpu.Layout.WGMMA.reduce(1)  # type: ignore[attr-defined]


def swizzled() -> tuple[plgpu.TilingTransform, plgpu.SwizzleTransform]:
    """The shared-memory tiling of 2-byte WGMMA operands: (8, 64) tiles, 128-byte swizzle."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)
