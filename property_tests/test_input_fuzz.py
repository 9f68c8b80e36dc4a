"""Fuzzing what users and files hand zgen: the only outcomes are a result or a typed zgen error.

Loader inputs: config.json values replaced by arbitrary JSON, safetensors and GGUF files truncated or
with bits flipped (mostly in their headers, where sizes and shapes live). API arguments: sampling
configs, cache options, prompts of every shape (text with lone surrogates, bytes, mixed lists, chat
messages), context fills, perplexity windows.

Every example runs under a memory limit (``RLIMIT_AS``: the process's current size plus
:data:`MEMORY_HEADROOM`) and a time limit (:data:`TIME_LIMIT_S`, by ``SIGALRM``): growing memory
without bound fails as a ``MemoryError``, a hang as :class:`Hang`, and any exception that is not a
:class:`~zgen.errors.ZgenError` fails the test. Failing examples are reported as drawn, not shrunk
(:data:`NO_SHRINKING`): shrinking retries an example over and over, and a hang costs the time limit
on every try (a damaged GGUF that hung the loader once kept a suite run busy for over 20 minutes).
"""

from __future__ import annotations

import json
import math
import resource
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import Phase, event, example, given, settings, strategies as st

from tests import tiny_gguf
from tests.hf_reference import save_random_checkpoint, small_configs
from zgen import Context, Engine, Generator, SamplingConfig, load_model
from zgen.cache.factory import compressed_kv, paged_kv, prefix_cache
from zgen.errors import ZgenError
from zgen.evaluation import perplexity
from zgen.model import Model

MEMORY_HEADROOM = 3 * 2**30
TIME_LIMIT_S = 20
NO_SHRINKING = settings(phases=[phase for phase in Phase if phase is not Phase.shrink])
T = TypeVar("T")


class Hang(Exception):
    """An example ran past TIME_LIMIT_S."""


@contextmanager
def bounded() -> Iterator[None]:
    """Run the body under the memory limit and the time limit (restored after)."""
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + MEMORY_HEADROOM if hard == resource.RLIM_INFINITY else min(size + MEMORY_HEADROOM, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    timed = threading.current_thread() is threading.main_thread()  # signals reach the main thread only

    def hang(signum: int, frame: object) -> None:
        raise Hang(f"still running after {TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, hang) if timed else None
    if timed:
        signal.alarm(TIME_LIMIT_S)
    try:
        yield
    finally:
        if timed:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def outcome(call: Callable[[], T]) -> T | ZgenError:
    """``call()``'s result or the ZgenError it raised; anything else fails the test."""
    with bounded():
        try:
            result = call()
        except ZgenError as err:
            assert str(err), "a typed error says what was wrong"
            event(type(err).__name__)
            return err
    event("result")
    return result


# ------------------------------------------------------------------------------------------------
# Loader inputs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    save_random_checkpoint(small_configs()["llama"], directory)  # llama3 rope scaling: more to corrupt
    return directory


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, 2, 3, 16, 96, 2**31, 10**9, 4 * 10**9]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
CONFIG_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "attention_bias", "sliding_window", "use_sliding_window",
    "bos_token_id", "eos_token_id", "model_type", "architectures",
]


def _mutated_copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _json_dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=True)  # NaN/Infinity as Python writes them (and HF configs can hold)


@NO_SHRINKING
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, min_size=1, max_size=3))
def test_mutated_config_json_loads_or_is_refused(checkpoint: Path, changes: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        directory = _mutated_copy(checkpoint, Path(scratch) / "model")
        config = json.loads((directory / "config.json").read_text()) | changes
        (directory / "config.json").write_text(_json_dumps(config))
        result = outcome(lambda: load_model(directory))
        if isinstance(result, Model):  # whatever loads is consistent with its weights
            assert result.config.num_layers == 2


def _damaged(data: bytes, cut: int | None, flips: list[int], header: int) -> bytes:
    damaged = bytearray(data if cut is None else data[: cut % len(data)])
    for bit in flips:
        where = bit % (8 * min(header, len(damaged)) or 1)
        if damaged:
            damaged[where // 8] ^= 1 << (where % 8)
    return bytes(damaged)


DAMAGE = dict(
    cut=st.none() | st.integers(min_value=0),
    flips=st.lists(st.integers(min_value=0), max_size=6),
    header=st.sampled_from([64, 1024, 2**62]),  # flips within the first bytes (the header) or anywhere
)


@NO_SHRINKING
@given(**DAMAGE)
def test_damaged_safetensors_load_or_are_refused(checkpoint: Path, cut: int | None, flips: list[int], header: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        directory = _mutated_copy(checkpoint, Path(scratch) / "model")
        weights = directory / "model.safetensors"
        weights.write_bytes(_damaged(weights.read_bytes(), cut, flips, header))
        outcome(lambda: load_model(directory))


@NO_SHRINKING
@given(**DAMAGE)
@example(cut=None, flips=[6359], header=1024)  # a token string that is no longer UTF-8 (found by this test)
def test_damaged_gguf_loads_or_is_refused(gguf_file: Path, cut: int | None, flips: list[int], header: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "damaged.gguf"
        path.write_bytes(_damaged(gguf_file.read_bytes(), cut, flips, header))
        outcome(lambda: load_model(path, cache_dir=Path(scratch) / "cache"))


# ------------------------------------------------------------------------------------------------
# API arguments


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> Model:
    return load_model(checkpoint)


ANY_VALUE = st.one_of(
    JSON_SCALARS,
    st.sampled_from([math.nan, 1e-39, -0.0, 1e308, b"5", 5 + 0j, object(), [], (1,), {"a": 1}]),
)
SAMPLING_FIELDS = [
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
    "max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "choose",
]
TEXT = st.text(alphabet=st.characters(codec=None), max_size=12) | st.sampled_from(["w3 w4", "abc\udcff", "\ud800", ""])
TOKEN = st.integers(min_value=-3, max_value=100) | st.sampled_from([2**31, 2**40, 1.5, "5", True, None, b"x"])
PROMPTS = st.one_of(
    TEXT,
    st.binary(max_size=6),
    st.lists(TOKEN, max_size=6),
    st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]), TEXT | ANY_VALUE, max_size=3), max_size=3),
    st.lists(st.one_of(TOKEN, st.fixed_dictionaries({"role": st.just("user"), "content": TEXT})), max_size=3),
    ANY_VALUE,
)


@NO_SHRINKING
@given(fields=st.dictionaries(st.sampled_from(SAMPLING_FIELDS), ANY_VALUE | st.floats(), max_size=4))
def test_sampling_configs_are_built_or_refused(fields: dict[str, Any]) -> None:
    outcome(lambda: SamplingConfig(**fields))


@NO_SHRINKING
@given(
    budget=st.floats(max_value=64.0) | ANY_VALUE,
    page_size=st.integers(max_value=2**40) | ANY_VALUE,
    chunk=st.integers(max_value=2**40) | ANY_VALUE,
    blocks=st.integers(min_value=-2, max_value=64) | ANY_VALUE,
)
@example(budget=2**31, page_size=1, chunk=None, blocks=0)  # 2 PiB of pages: refused, not allocated
def test_cache_options_build_an_engine_or_are_refused(model: Model, budget: Any, page_size: Any, chunk: Any, blocks: Any) -> None:
    outcome(lambda: Engine(model, paged_kv(budget, page_size=page_size), prefix_cache(blocks)))
    outcome(lambda: Engine(model, compressed_kv(chunk)))


@NO_SHRINKING
@given(prompt=PROMPTS, new_tokens=st.integers(min_value=1, max_value=3))
def test_prompts_generate_or_are_refused(model: Model, prompt: Any, new_tokens: int) -> None:
    with Generator(model) as gen:
        ids = outcome(lambda: gen.encode_prompt(prompt))
        if isinstance(ids, list):
            assert all(isinstance(i, int) and 0 <= i < model.config.vocab_size for i in ids)
            outcome(lambda: gen.generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=new_tokens)))


@NO_SHRINKING
@given(text=TEXT | ANY_VALUE, ids=st.lists(TOKEN, max_size=4) | st.binary(max_size=3) | TEXT)  # iterables: see README
def test_context_fills_append_or_are_refused(model: Model, text: Any, ids: Any) -> None:
    ctx = Context(Engine(model, paged_kv(1)))
    for fill in (lambda: ctx.fill(text), lambda: ctx.fill_tokens(ids)):
        before = ctx.token_ids
        if isinstance(outcome(fill), ZgenError):
            assert ctx.token_ids == before, "a refused fill leaves the context as it was"
    assert all(0 <= i < model.config.vocab_size for i in ctx.token_ids)


@NO_SHRINKING
@given(window=st.integers(min_value=-1, max_value=20) | ANY_VALUE, chunk=st.integers(min_value=-1, max_value=20) | ANY_VALUE)
def test_perplexity_windows_score_or_are_refused(model: Model, window: Any, chunk: Any) -> None:
    result = outcome(lambda: perplexity(model, list(range(3, 30)), window=window, chunk=chunk, batch_size=4))
    if not isinstance(result, ZgenError):
        assert math.isfinite(result.ppl) and result.tokens_scored > 0
