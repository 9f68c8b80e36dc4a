from __future__ import annotations

from collections.abc import Iterator

import jax
import pytest


@pytest.fixture(autouse=True)
def _exact_f32_matmuls() -> Iterator[None]:
    """On GPUs XLA may run f32 matmuls in TF32; the f32 tolerances assume real f32 (a no-op on CPU)."""
    with jax.default_matmul_precision("highest"):
        yield
