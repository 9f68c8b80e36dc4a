"""Shared by tests/ and property_tests/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

# Tests compile hundreds of small executables and run each a few times: XLA:CPU's backend at
# optimization level 0 compiles them in about half the time, and the suite spends most of its time
# compiling. Fast-math stays off at either level (the exactness tests pass at both); benchmarks and the
# CLI keep the default level.
# Set before jax creates its CPU client (subprocesses the tests start inherit it).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# XLA:CPU's MLIR fusion emitters build an MLIR context per fused kernel; its older elemental emitters
# compile the same programs in far less time (a tiny model's speculative loop: 9.2 -> 6.8 s; the whole
# suite on 2 idle cores: 35 min 23 s -> 21 min 59 s, 3,927 -> 2,409 CPU seconds) and run them just as
# exactly. An XLA that no longer knows the flag aborts on it, so a subprocess asks first (workers
# inherit the flags and skip the question).
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {flag}", "JAX_PLATFORMS": "cpu"}
    return subprocess.run(probe, env=env, capture_output=True, check=False).returncode == 0


if _LEGACY_EMITTERS not in os.environ["XLA_FLAGS"] and _xla_accepts(_LEGACY_EMITTERS):
    os.environ["XLA_FLAGS"] += f" {_LEGACY_EMITTERS}"
# Executables that took over a second to compile are kept on disk for the rest of the run: both
# workers (they inherit the directory), the command-line tests' subprocesses and models rebuilt with
# the same shapes load them instead of compiling again (the CLI and grammar test files: 254 -> 203 s on
# 2 cores). One new directory a run, removed at its end: nothing carries over between runs. Keeping
# every executable (a threshold of 0) was not faster: 1,479 hits saved 371 s of compiling, yet the
# suite took 57 min against 50.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zgen-tests-")

import jax  # noqa: E402 - after XLA_FLAGS
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])  # jax may be imported already


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code() -> Iterator[None]:
    """Drop jitted executables when a test module ends. XLA:CPU maps every executable's code into the
    process, and one process compiling the whole suite ran past the kernel's limit on memory maps
    (``vm.max_map_count``, 65530) and aborted inside the compiler. Clearing only once a worker held
    30,000 maps did not save the small programs' compiles (1,195 eager broadcasts against 1,221: they
    differ by shape) and let a worker reach 48,000 maps."""
    yield
    jax.clear_caches()


@pytest.fixture
def host_devices_env() -> Callable[[int], dict[str, str]]:
    """The environment of a subprocess that sees ``n`` host devices: this run's XLA flags (the
    optimization level above) plus the device count, and this checkout's zgen importable."""

    def env(n: int) -> dict[str, str]:
        return {
            **os.environ,
            "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={n}",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
        }

    return env


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's compiled executables go with it (the process that made the directory removes it)."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
