"""Shared by tests/ and property_tests/."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code() -> Iterator[None]:
    """Drop jitted executables when a test module ends. XLA:CPU maps every executable's code into the
    process, and one process compiling the whole suite ran past the kernel's limit on memory maps
    (``vm.max_map_count``, 65530) and aborted inside the compiler."""
    yield
    jax.clear_caches()
