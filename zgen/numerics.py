"""Matmul precision by input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


def matmul_precision(*dtypes: DTypeLike) -> jax.lax.Precision:
    """HIGHEST when any input is float32 or wider, so f32 does not silently drop to TF32 on GPUs."""
    wide = any(jnp.issubdtype(d, jnp.floating) and jnp.dtype(d).itemsize >= 4 for d in dtypes)
    return jax.lax.Precision.HIGHEST if wide else jax.lax.Precision.DEFAULT
