"""Shared by tests/ and property_tests/."""

from __future__ import annotations

import os
from collections.abc import Iterator

# Tests compile hundreds of small executables and run each a few times: XLA:CPU's backend at
# optimization level 0 compiles them in about half the time, and the suite spends most of its time
# compiling. Fast-math stays off at either level (the exactness tests pass at both); benchmarks and the
# CLI keep the default level.
# Set before jax creates its CPU client (subprocesses the tests start inherit it).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402 - after XLA_FLAGS
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code() -> Iterator[None]:
    """Drop jitted executables when a test module ends. XLA:CPU maps every executable's code into the
    process, and one process compiling the whole suite ran past the kernel's limit on memory maps
    (``vm.max_map_count``, 65530) and aborted inside the compiler."""
    yield
    jax.clear_caches()
