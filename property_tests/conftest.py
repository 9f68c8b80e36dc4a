"""Hypothesis profiles for the property tests.

* ``ci`` (default): enough examples to matter; every property test together stays under ~4 minutes on
  2 cores. Derandomized: every run draws the same examples, so a red CI run is the change's doing and
  repeats on any machine (a failure prints its reproduction blob as well).
* ``thorough``: many more examples and longer stateful runs, freshly random each time (where new bugs
  are hunted); select with ``pytest property_tests --hypothesis-profile=thorough``.

Tests here set no ``max_examples`` of their own, so the profile decides. Tests elsewhere that pin their
own settings keep them.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("ci", max_examples=40, stateful_step_count=30, derandomize=True, print_blob=True, **_COMMON)  # type: ignore[arg-type]
settings.register_profile("thorough", max_examples=400, stateful_step_count=80, print_blob=True, **_COMMON)  # type: ignore[arg-type]


def pytest_configure(config: pytest.Config) -> None:
    # The hypothesis plugin has already loaded an explicitly chosen profile; default to "ci".
    if not config.getoption("hypothesis_profile", default=None):
        settings.load_profile("ci")
