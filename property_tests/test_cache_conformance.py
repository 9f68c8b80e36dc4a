"""The shipped conformance suite (zgen.testing.cache_conformance) on zgen's own caches and on the
worked example format of examples/custom_kv_format.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from zgen.cache.factory import cache_kind, kv_dtype, paged_kv, prefix_cache
from zgen.errors import ConfigError
from zgen.testing.cache_conformance import CacheConformance


def _load_example_format() -> None:
    path = Path(__file__).parent.parent / "examples" / "custom_kv_format.py"
    spec = importlib.util.spec_from_file_location("custom_kv_format", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)


_load_example_format()


class PagedFp32WithPrefixCache(CacheConformance):
    options = (paged_kv(page_size=2), prefix_cache(64))


class PagedQ4(CacheConformance):
    options = (paged_kv(page_size=4), kv_dtype("q4"))


class Tensor(CacheConformance):
    options = (cache_kind("tensor"),)


class ExampleQ2(CacheConformance):
    options = (paged_kv(page_size=2), kv_dtype("q2"), prefix_cache(64))
    head_dim = 32  # one group of the format


# zgen's own caches have their own, longer state machines here; these runs show the suite at work.
SHORT = settings(max_examples=15, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestPagedFp32WithPrefixCache = PagedFp32WithPrefixCache.TestCase
TestPagedQ4 = PagedQ4.TestCase
TestTensor = Tensor.TestCase
TestExampleQ2 = ExampleQ2.TestCase
for case in (TestPagedFp32WithPrefixCache, TestPagedQ4, TestTensor, TestExampleQ2):
    case.settings = SHORT


def test_the_compressed_cache_is_refused() -> None:
    class Compressed(CacheConformance):
        options = (cache_kind("compressed"),)

    with pytest.raises(ConfigError, match="pools old tokens"):
        Compressed()


@settings(max_examples=1, deadline=None)
@given(st.just(None))
def test_paged_q4_codes_a_token_the_same_alone_or_in_a_chunk(_: None) -> None:
    """A case this suite found: with the Hadamard rotation as one dot (whose summation order may
    depend on how many rows it takes), tokens [2] then [2] were coded one q4 step apart from [2, 2]
    written together. The coding of stored tokens is exact per row."""
    machine = PagedQ4()
    live = machine.start(tokens=[2], base=0, repeat=False)
    machine.extend(live, tokens=[2], pieces=1)
    machine.every_sequence_reads_its_own_tokens()
    machine.teardown()
