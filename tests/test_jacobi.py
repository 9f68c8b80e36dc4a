"""Jacobi (lookahead) decoding: exactly plain decoding's tokens on every front end, the Jacobi step
and the n-gram pool of guessed tokens, and typed refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from hf_reference import hf_teacher_forced
from zgen import Generator, Request, SamplingConfig
from zgen.cache.factory import CacheOption, paged_kv
from zgen.cli import app
from zgen.contexts import Context
from zgen.errors import ConfigError
from zgen.model import Model
from zgen.runtime.engine import Engine
from zgen.runtime.sampling import SamplingFlags, SamplingParams
from zgen.runtime.speculation import DraftInput, Observer, Proposal, Speculator
from zgen.runtime.stop import StopCondition
from zgen.speculative import Jacobi, PromptLookup

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)
PROMPTS = ["w5 w9 w12 w5 w9 w12 w5 w9 w3", "w7 w8 w7 w8 w7", "w20 w21 w22 w23 w24 w25 w20 w21 w22 w30 w31"]


@pytest.fixture(scope="module")
def chaotic(tiny_llama: Model) -> Model:
    """Large random weights: text that rarely repeats, so most guesses are rejected and rolled back."""
    key = jax.random.key(5)
    params = {name: jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32) for i, (name, x) in enumerate(tiny_llama.params.items())}
    return dataclasses.replace(tiny_llama, params=params, attachments={})


def _ids(generator: Generator, sampling: SamplingConfig = GREEDY) -> list[list[int]]:
    return [r.token_ids for r in generator.batch_generate([Request(p, sampling) for p in PROMPTS])]


def test_jacobi_is_a_speculator_that_observes_the_passes() -> None:
    assert isinstance(Jacobi(), Speculator) and isinstance(Jacobi(), Observer)
    assert not isinstance(PromptLookup(), Observer)


@pytest.mark.parametrize(
    ("options", "jacobi"),
    [((), Jacobi(4)), ((paged_kv(4),), Jacobi(6, ngram=2, pool_size=16, adaptive=True))],
    ids=["tensor", "paged-adaptive"],
)
def test_greedy_is_plain_decoding_on_the_tensor_and_paged_caches(chaotic: Model, options: tuple[CacheOption, ...], jacobi: Jacobi) -> None:
    plain = _ids(Generator(chaotic, *options))
    results = Generator(chaotic, *options, speculative=jacobi).batch_generate([Request(p, GREEDY) for p in PROMPTS])
    assert [r.token_ids for r in results] == plain
    stats = [r.speculative for r in results if r.speculative is not None]
    assert len(stats) == len(PROMPTS) and sum(s.draft_tokens for s in stats) > sum(s.accepted_tokens for s in stats)  # rolled back


def test_greedy_is_hf_greedy_and_accepts_on_a_repeated_phrase(tiny_llama: Model, tiny_llama_checkpoint: tuple[Path, Any]) -> None:
    prompt = "w10 w11 w12 w13 w10 w11 w12 w13 w10 w11"
    long = dataclasses.replace(GREEDY, max_new_tokens=40)
    plain = Generator(tiny_llama).generate(prompt, long)
    result = Generator(tiny_llama, speculative=Jacobi()).generate(prompt, long)
    assert result.token_ids == plain.token_ids
    assert hf_teacher_forced(tiny_llama_checkpoint[1], result.prompt_token_ids, result.token_ids)[0] == result.token_ids
    assert result.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    stats = result.speculative
    assert stats is not None and stats.accepted_tokens > 0 and stats.steps < len(result.token_ids)


def test_sampling_is_plain_sampling_and_reproducible(chaotic: Model) -> None:
    sampled = SamplingConfig(temperature=0.8, top_k=20, seed=11, max_new_tokens=24, ignore_eos=True)
    plain = _ids(Generator(chaotic), sampled)
    generator = Generator(chaotic, speculative=Jacobi(4))
    first, again = _ids(generator, sampled), _ids(generator, sampled)
    assert first == plain and again == first  # deterministic drafts: the same tokens as plain sampling
    assert all(len(ids) == 24 and all(0 <= t < chaotic.config.vocab_size for t in ids) for ids in first)
    other = dataclasses.replace(sampled, seed=12)
    assert _ids(generator, other) == _ids(Generator(chaotic), other) != first


def test_contexts_take_jacobi(chaotic: Model) -> None:
    engine = Engine(chaotic, paged_kv(4))
    limit = StopCondition.from_sampling(GREEDY, ())

    def context() -> Context:
        ctx = Context(engine, seed=1)
        ctx.fill(PROMPTS[2])
        return ctx

    plain = context().generate_result(None, limit)
    ctx = context()
    out = ctx.generate_with_drafter(Jacobi(4), None, limit)
    assert out.token_ids == plain.token_ids and out.speculative is not None
    assert ctx.kv_len == ctx.num_tokens - 1


def _draft_input(history: list[int], k: int) -> DraftInput:
    greedy = SamplingConfig(temperature=0.0)
    row = np.zeros((1, 16), np.int32)
    row[0, : len(history)] = history
    return DraftInput(
        jnp.asarray(row), jnp.asarray([len(history)]), jnp.asarray([k]), jnp.asarray([True]), jnp.zeros((1, 2), jnp.uint32),
        SamplingParams.from_configs([greedy], 96), SamplingFlags.from_configs([greedy], 96),
    )


def test_the_jacobi_step_and_the_pool_of_guessed_n_grams() -> None:
    """A pass drafts [13 13 13 13] after pending 13 (nothing known yet: the last token repeated); the
    target's draws are 20 .. 24, so 20 is produced and 13 .. 13 rejected. The next pass drafts the
    draws past the rejection, each now one position earlier (the Jacobi step), and a context seen only
    among the guesses, (13, 13), is continued by the pool with the draw that followed it."""
    jacobi = Jacobi(4, ngram=3, pool_size=16)
    history = [10, 11, 12, 13]
    first = _draft_input(history, 4)
    state = jacobi.start((), first.history, first.length)
    proposal, state = jacobi.propose((), state, first)
    assert proposal.tokens.tolist() == [[13, 13, 13, 13]] and proposal.count.tolist() == [4]
    state = jacobi.observe(state, first, proposal, jnp.asarray([4]), jnp.asarray([[20, 21, 22, 23, 24]]))
    shifted, _ = jacobi.propose((), state, _draft_input([*history, 20], 4))
    assert shifted.tokens.tolist() == [[21, 22, 23, 24]]
    pooled, _ = jacobi.propose((), state, _draft_input([*history, 13], 4))
    assert pooled.tokens.tolist()[0][0] == 24  # (13, 13) -> 24: the last of the guessed n-grams with that context
    seeded, _ = jacobi.propose((), state, _draft_input([5, 10, 11], 4))
    assert seeded.tokens.tolist()[0][:3] == [12, 13, 20]  # the context's own n-grams, then (12, 13) -> 20


def test_typed_refusals() -> None:
    for k in (0, 33, 2.5, True):
        with pytest.raises(ConfigError, match="num_tokens"):
            Jacobi(k)  # type: ignore[arg-type]
    for n in (1, 9, True):
        with pytest.raises(ConfigError, match="ngram"):
            Jacobi(ngram=n)
    with pytest.raises(ConfigError, match="pool_size must be an integer >= 18"):
        Jacobi(8, pool_size=17)
    with pytest.raises(ConfigError, match="adaptive"):
        Jacobi(adaptive=1)  # type: ignore[arg-type]


runner = CliRunner()


def test_cli_jacobi_gives_the_plain_tokens(tiny_llama_checkpoint: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZGEN_CACHE_DIR", str(tmp_path / "weights"))
    monkeypatch.setenv("ZGEN_XLA_CACHE_DIR", str(tmp_path / "xla"))
    args = ["generate", "--model", str(tiny_llama_checkpoint[0]), "-p", "w3 w4 w5 w3 w4 w5 w3", "-n", "16", "--ignore-eos", "--temperature", "0", "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    for flags in (["--jacobi"], ["--jacobi", "--num-draft-tokens", "3"]):
        result = runner.invoke(app, [*args, *flags])
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["token_ids"] == plain["token_ids"]
        assert 0 < out["speculative"]["accepted_tokens"] <= out["speculative"]["draft_tokens"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["generate", "--jacobi", "--prompt-lookup"], "'--prompt-lookup'"),
        (["generate", "--jacobi", "--num-draft-tokens", "0"], "'--num-draft-tokens'"),
        (["generate", "--jacobi", "--kv-cache", "compressed"], "'--kv-cache'"),
    ],
)
def test_bad_jacobi_flags_fail_before_anything_loads(args: list[str], flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_load(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("zgen.cli.load_model", must_not_load)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert flag in result.stderr
    assert "--jacobi" in runner.invoke(app, ["generate", "--help"]).stdout
