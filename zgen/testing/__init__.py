"""Test suites zgen ships for code written outside it (see :mod:`zgen.testing.cache_conformance`)."""
