"""Structured output: every constrained generation parses and validates, through every front end,
alone or batched beside unconstrained rows (which are unaffected); malformed grammars are typed errors
raised before anything runs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from typer.testing import CliRunner

from zgen import Context, Engine, Generator, Grammar, ModelConfig, Request, Sampler, SamplingConfig
from zgen.cache.factory import paged_kv
from zgen.cli import app
from zgen.errors import ConfigError, GrammarError, InputError
from zgen.loading.builtin import builtin_model_path
from zgen.loading.gguf_file import open_gguf
from zgen.model import Model, random_model
from zgen.tokenizer import Tokenizer

runner = CliRunner()

SCHEMAS: dict[str, dict[str, Any]] = {
    "object_required": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", "blue", 7]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}, "tag": {"enum": ["a", "b"]}},
                "required": ["x", "tag"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    "number_range": {"type": "integer", "minimum": 10, "maximum": 99},
}

@pytest.fixture(scope="module")
def tiny() -> Model:
    """Random weights of a tiny Llama with SmolLM2's real byte-level vocabulary (JSON needs one)."""
    tokenizer = Tokenizer.from_gguf(open_gguf(builtin_model_path("smollm2")))
    config = ModelConfig.from_hf(dict(
        model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        eos_token_id=2, tie_word_embeddings=True,
    ))
    return dataclasses.replace(random_model(config, dtype="float32", seed=1), tokenizer=tokenizer)


def json_config(schema: dict[str, Any], temperature: float, seed: int = 0) -> SamplingConfig:
    return SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=48, grammar=Grammar.json_schema(schema, compact=True))


def assert_valid(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schemas_batched_beside_unconstrained_rows(tiny: Model, temperature: float) -> None:
    gen = Generator(tiny, max_batch_size=16)
    free = SamplingConfig(temperature=temperature, seed=5, max_new_tokens=12, ignore_eos=True)
    requests = [Request("w x y", free)]
    for seed in range(2):
        requests += [Request("hello", json_config(schema, temperature, seed)) for schema in SCHEMAS.values()]
    requests.append(Request("a b c", free))
    results = gen.batch_generate(requests)
    constrained = results[1:-1]
    for result, schema in zip(constrained, [*SCHEMAS.values()] * 2, strict=True):
        assert result.finish_reason == "stop", result.text  # the grammar ended it, complete
        assert_valid(result.text, schema)
    for request, result in ((requests[0], results[0]), (requests[-1], results[-1])):  # unaffected by the grammar rows
        assert result.token_ids == gen.generate(request.prompt, request.sampling).token_ids
    # A constrained row draws the same tokens alone as in the batch, in a decode loop (not one engine step a token).
    steps = gen.engine.stats.steps
    alone = gen.generate("hello", requests[1].sampling)
    assert alone.token_ids == constrained[0].token_ids
    assert gen.engine.stats.steps - steps < len(alone.token_ids) / 2


def test_rows_ending_apart_in_one_decode_loop(tiny: Model) -> None:
    """Constrained rows whose grammars complete at different draws share decode loops (a host stop
    rule ends each loop every few tokens) beside an unconstrained row: each draws what it draws alone,
    and only the loops' steps ran (never one engine step a token)."""
    gen = Generator(tiny, sync_interval=4)
    configs = [json_config(schema, 1.0, seed) for seed, schema in enumerate(SCHEMAS.values())]
    configs.append(SamplingConfig(temperature=1.0, seed=9, max_new_tokens=20, ignore_eos=True, stop=("<never>",)))
    steps = gen.engine.stats.steps
    together = gen.batch_generate([Request("hello", config) for config in configs])
    assert gen.engine.stats.steps - steps <= 1 + 20 // 4 + len(configs)  # prefill, then loops of 4 draws
    for config, result, schema in zip(configs, together, [*SCHEMAS.values(), None], strict=True):
        assert result.token_ids == gen.generate("hello", config).token_ids
        if schema is not None:
            assert result.finish_reason == "stop"
            assert_valid(result.text, schema)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)!", r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5}){0,2}\."])
def test_regex_outputs_fullmatch(tiny: Model, pattern: str) -> None:
    gen = Generator(tiny)
    for config in (Sampler.greedy(), Sampler.top_p(1.0, 0.95, seed=3)):
        result = gen.generate("go", dataclasses.replace(config, max_new_tokens=24, grammar=Grammar.regex(pattern)))
        assert re.fullmatch(pattern, result.text), result.text
        assert result.finish_reason == "stop"


def test_lark_grammar_and_a_host_sampler_within_it(tiny: Model) -> None:
    grammar = Grammar.lark('start: "(" item ("," item)* ")"\nitem: /[a-c]/ | NUMBER\nNUMBER: /[1-9]/')
    shape = r"\((?:[a-c1-9])(?:,[a-c1-9])*\)"
    gen = Generator(tiny)
    stream = gen.generate_stream("go", SamplingConfig(temperature=0.7, seed=1, max_new_tokens=40, grammar=grammar))
    assert re.fullmatch(shape, "".join(stream))
    # A host sampler chooses among the grammar's tokens only (it sees the masked distribution).
    picked = gen.generate("go", Sampler.custom(lambda ids, probs: int(ids[0]), max_new_tokens=40, grammar=grammar))
    assert re.fullmatch(shape, picked.text), picked.text


def test_context_generation_with_a_grammar(tiny: Model) -> None:
    engine = Engine(tiny, paged_kv(8))
    ctx = Context(engine, seed=4)
    ctx.fill("hello there")
    schema = SCHEMAS["object_required"]
    result = ctx.generate_result(json_config(schema, 1.0))
    assert result.finish_reason == "stop"
    assert_valid(result.text, schema)
    assert ctx.token_ids[-len(result.token_ids) :] == result.token_ids  # the reply joined the context
    fork = ctx.fork(seed=9)
    fork.fill(" more")
    assert re.fullmatch(r"[xyz]{2,3}", fork.generate(SamplingConfig(temperature=1.0, max_new_tokens=8, grammar=Grammar.regex("[xyz]{2,3}"))))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Grammar.json_schema({"type": "foo"}),
        lambda: Grammar.json_schema("{not json"),
        lambda: Grammar.json_schema([1]),  # type: ignore[arg-type]
        lambda: Grammar.json_schema({"properties": {"a": {"$ref": "#/nowhere"}}}),
        lambda: Grammar.regex("a(b"),
        lambda: Grammar.regex("x{3,1}"),
        lambda: Grammar.regex(""),
        lambda: Grammar.lark("start: undefined_rule"),
        lambda: Grammar.lark('start: "a" ('),
    ],
    ids=["schema-type", "schema-json", "schema-array", "schema-ref", "regex-group", "regex-range", "regex-empty",
         "lark-name", "lark-syntax"],
)
def test_malformed_grammars_are_typed_errors(make: Any) -> None:
    with pytest.raises(GrammarError):
        make()


def test_bad_grammar_requests_fail_before_any_compute(tiny: Model) -> None:
    with pytest.raises(ConfigError):
        SamplingConfig(grammar="[0-9]+")  # type: ignore[arg-type]
    engine = Engine(tiny, paged_kv(8))
    ctx = Context(engine)
    ctx.fill("hello")
    steps = engine.stats.steps
    with pytest.raises(InputError, match="grammar"):  # a forward pass samples, it does not generate
        ctx.forward().sample([0], SamplingConfig(grammar=Grammar.regex("[0-9]"))).execute()
    assert engine.stats.steps == steps and ctx.token_ids == tiny.tokenizer.encode("hello")


def test_smollm2_answers_in_json_through_generator_and_context(smollm2: Model) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    question = [{"role": "user", "content": "Reply in JSON: a person named Bob who is 42 years old."}]
    config = SamplingConfig(temperature=0.0, max_new_tokens=40, grammar=Grammar.json_schema(schema))
    gen = Generator(smollm2)
    result = gen.generate(question, config)
    assert result.finish_reason == "stop"
    assert json.loads(result.text) == {"name": "Bob", "age": 42}
    sampled = gen.generate(question, dataclasses.replace(config, temperature=0.8, seed=2))
    assert_valid(sampled.text, schema)

    ctx = Context(Engine(smollm2, paged_kv(16)))
    ctx.fill_user(question[0]["content"])
    assert ctx.generate(config) == result.text


def test_cli_generates_within_a_regex_and_a_schema_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["generate", "-p", "The year the war ended:", "--temperature", "0", "-n", "8", "--regex", r" ?[12][0-9]{3}"])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r" ?[12][0-9]{3}\n", result.stdout)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS["enum"]))
    result = runner.invoke(app, ["generate", "--chat", "-p", "Pick a colour.", "--temperature", "0", "-n", "8", "--json-schema", str(schema), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["finish_reason"] == "stop" and json.loads(out["text"]) in SCHEMAS["enum"]["enum"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--regex", "a(b"], "'--regex'"),
        (["--regex", "[0-9]", "--lark", __file__], "'--lark'"),
        (["--json-schema", "/no/such/schema.json"], "'--json-schema'"),
        (["--lark", __file__], "'--lark'"),  # a Python file is no Lark grammar
    ],
)
def test_cli_grammar_flags_are_checked_before_loading(args: list[str], flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_load(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("zgen.cli.load_model", must_not_load)
    monkeypatch.setenv("COLUMNS", "200")  # the whole message on one line
    result = runner.invoke(app, ["generate", *args])
    assert result.exit_code == 2, result.output
    assert flag in result.stderr and "Traceback" not in result.output


def test_end_tokens_are_allowed_only_where_the_grammar_may_end(tiny: Model) -> None:
    from zgen.runtime.grammar import GrammarMatcher, fill_masks, mask_words

    eos, stop_id = tiny.eos_token_ids[0], 5

    def allowed(matcher: GrammarMatcher) -> np.ndarray:
        masks = np.zeros((1, mask_words(tiny.config.vocab_size)), np.int32)
        assert not fill_masks([(matcher, 0)], masks)
        return np.unpackbits(masks.view(np.uint8), bitorder="little")[: tiny.config.vocab_size].astype(bool)

    (a,) = tiny.tokenizer.encode("a")
    matcher = GrammarMatcher(Grammar.regex("a+"), tiny, (stop_id,))  # ends where the generation's stop id is drawn
    start = allowed(matcher)
    assert start[a] and not start[stop_id] and not start[eos]  # "" does not match a+
    matcher.consume(a)
    after = allowed(matcher)
    assert after[a] and after[stop_id] and not after[eos]  # the model's EOS is no stop of this generation
    matcher.consume(stop_id)  # ends the generation; the grammar took "a"
    with pytest.raises(GrammarError):
        GrammarMatcher(Grammar.regex("b"), tiny, (eos,)).consume(a)


def test_host_computes_each_draws_masks_while_the_forward_pass_before_it_runs(
    tiny: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The constrained loop dispatches each forward pass, then takes its host turn (the grammars
    advanced by the last draw, then the masks of the draw after that forward pass) while the device
    runs it, and dispatches that draw only after the turn. The forward pass is made long here (a
    computation of a few hundred milliseconds joins its logits) so that "still running" is plain:
    each host turn but the last finds its forward pass dispatched and not yet done."""
    import jax
    import jax.numpy as jnp

    import zgen.runtime.runner as runner_module
    from zgen.runtime.constrained import ConstrainedRows
    from zgen.runtime.runner import DecodeSteps, Runner
    from zgen.runtime.step import decode_feed

    config = json_config(SCHEMAS["nested"], 1.0, seed=3)
    expected = Generator(tiny).generate("hello", config)

    events: list[str] = []
    forwards: list[jax.Array] = []  # each dispatched forward pass's logits

    def long_feed(model: Any, params: Any, kv: Any, token: Any, position: Any, adapter_slots: Any = None) -> Any:
        logits, kv = decode_feed(model, params, kv, token, position, adapter_slots)
        x = jnp.full((384, 384), 1e-3) * token[0].astype(jnp.float32)
        x = jax.lax.fori_loop(0, 40, lambda _, x: jnp.tanh(x @ x), x)
        return logits + 0.0 * x[0, 0], kv

    def host_turn(method: Any) -> Any:
        def turn(self: ConstrainedRows, *args: Any) -> Any:
            events.append("turn while its forward runs" if forwards and not forwards[-1].is_ready() else "turn")
            return method(self, *args)

        return turn

    decode_steps = Runner.decode_steps

    def recorded_steps(self: Runner, *args: Any, **kwargs: Any) -> DecodeSteps:
        steps = decode_steps(self, *args, **kwargs)

        def feed(kv: Any, loop: Any) -> Any:
            logits, kv = steps.feed(kv, loop)
            forwards.append(logits)
            events.append("forward")
            return logits, kv

        def draw(logits: Any, loop: Any, mask: Any) -> Any:
            events.append("draw")
            return steps.draw(logits, loop, mask)

        return DecodeSteps(feed, draw)

    monkeypatch.setattr(runner_module, "decode_feed", long_feed)
    monkeypatch.setattr(Runner, "decode_steps", recorded_steps)
    monkeypatch.setattr(ConstrainedRows, "first_masks", host_turn(ConstrainedRows.first_masks))
    monkeypatch.setattr(ConstrainedRows, "take", host_turn(ConstrainedRows.take))
    fresh = dataclasses.replace(tiny, attachments={})  # its own runner, compiled with the long forward pass
    result = Generator(fresh).generate("hello", config)
    assert result.token_ids == expected.token_ids and result.finish_reason == "stop"
    # forward 1, turn 1 (the first masks), draw 1, forward 2, turn 2 (draw 1 taken, masks 2), draw 2, ...
    draws = (len(events) - 1) // 3
    assert draws >= len(result.token_ids) - 1  # (the first token came from the prefill step)
    assert events[: 3 * draws] == ["forward", "turn while its forward runs", "draw"] * draws, events
    # After the last draw: its turn alone, or (the loop not knowing yet that the row ended) one more
    # forward pass beside it, whose K/V write is rolled back.
    assert events[3 * draws :] in (["turn"], ["forward", "turn while its forward runs"]), events


def test_a_grammar_failing_in_the_loop_fails_its_job_alone(tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar that breaks mid-generation (llguidance refusing a drawn token) fails its own job, whose
    sequence goes back to what it was; the rows beside it draw what they draw alone, and the engine goes on."""
    import zgen.runtime.constrained as constrained
    from zgen.runtime.engine import ForwardRequest
    from zgen.runtime.grammar import GrammarMatcher
    from zgen.runtime.stop import StopCondition

    configs = [
        json_config(SCHEMAS["nested"], 1.0, seed=3),
        json_config(SCHEMAS["object_required"], 0.0),
        SamplingConfig(temperature=1.0, seed=9, max_new_tokens=16, ignore_eos=True),
    ]
    gen = Generator(tiny)
    expected = [gen.generate("hello", config).token_ids for config in configs]

    doomed: list[GrammarMatcher] = []
    taken = 0
    consume_all = constrained.consume_all

    def refusing(draws: list[tuple[GrammarMatcher, int, int]]) -> dict[int, GrammarError]:
        nonlocal taken
        refused = consume_all(draws)
        for matcher, _, i in draws:
            if doomed and matcher is doomed[0]:
                taken += 1
                if taken == 3:
                    refused[i] = GrammarError("refused here")
        return refused

    monkeypatch.setattr(constrained, "consume_all", refusing)
    engine = gen.engine
    ids = tiny.tokenizer.encode("hello")
    seqs = [engine.new_sequence(ids, seed=0) for _ in configs]
    jobs = [
        engine.submit(seq, ForwardRequest(end=len(ids), sample_at=(len(ids) - 1,), sampling=config,
                                          generate=StopCondition.from_sampling(config, tiny.eos_token_ids)))
        for seq, config in zip(seqs, configs, strict=True)
    ]
    assert jobs[0].grammar is not None
    doomed.append(jobs[0].grammar)
    with pytest.raises(GrammarError, match="refused here"):
        engine.wait(jobs[0])
    assert seqs[0].tokens == ids and seqs[0].kv_len == 0  # as it was at submission
    assert [engine.wait(job).tokens for job in jobs[1:]] == expected[1:]
    assert gen.generate("hello", configs[0]).token_ids == expected[0]  # (no longer refused: `taken` is past 3)


def test_constrained_loops_compile_once(tiny: Model) -> None:
    """The host-driven loop calls two executables per token, compiled once per shape: a second
    constrained generation of the same budget and sampling kind compiles no loop step again."""
    gen = Generator(tiny)

    def loop_steps() -> set[Any]:
        return {key for key in gen.engine.runner._executables if key[0] in ("decode_feed", "decode_draw")}

    first = gen.generate("hello", json_config(SCHEMAS["nested"], 1.0, seed=1))
    compiled = loop_steps()
    assert {key[0] for key in compiled} == {"decode_feed", "decode_draw"}
    second = gen.generate("hi there", json_config(SCHEMAS["object_required"], 1.0, seed=2))
    assert first.finish_reason == second.finish_reason == "stop"
    assert loop_steps() == compiled


def test_a_context_goes_on_exactly_after_a_constrained_reply(tiny: Model) -> None:
    """The loop may have fed a reply's last token before it knew the grammar was complete: the
    context keeps exactly the reply's tokens, and goes on as a fresh context fed the same tokens."""
    from zgen import stop

    engine = Engine(tiny, paged_kv(8))
    ctx = Context(engine, seed=4)
    ctx.fill("hello there")
    prompt = list(ctx.token_ids)
    reply = ctx.generate_result(json_config(SCHEMAS["nested"], 1.0, seed=3))
    assert reply.finish_reason == "stop"
    assert ctx.token_ids == prompt + reply.token_ids
    fresh = Context(engine)
    fresh.fill_tokens(ctx.token_ids)
    assert ctx.generate_result(Sampler.greedy(), stop.max_len(12)).token_ids == fresh.generate_result(Sampler.greedy(), stop.max_len(12)).token_ids


def test_per_token_streams_of_constrained_rows(tiny: Model) -> None:
    """A constrained stream with ``per_token`` gets each token as it is drawn (one host-driven draw
    per engine step), the same tokens as without, and a text that matches its schema."""
    gen = Generator(tiny)
    config = json_config(SCHEMAS["object_required"], 1.0, seed=2)
    whole = gen.generate("hello", config)
    steps = gen.engine.stats.steps
    pieces = list(gen.generate_stream("hello", config, per_token=True))
    assert "".join(pieces) == whole.text
    assert_valid(whole.text, SCHEMAS["object_required"])
    assert gen.engine.stats.steps - steps >= len(whole.token_ids)  # a step (and a chance to deliver) per token


def test_forty_constrained_rows_decode_in_one_loop(tiny: Model) -> None:
    """No limit on the constrained rows of a decode loop: 40 of them prefill in one step and decode
    in one host-driven loop (not a step per token), each matching its pattern, as they do alone."""
    pattern = r"[a-c]{2}-[0-9]{2,3}"
    configs = [SamplingConfig(temperature=1.0, seed=seed, max_new_tokens=12, grammar=Grammar.regex(pattern)) for seed in range(40)]
    gen = Generator(tiny, max_batch_size=64)
    results = gen.batch_generate([Request("go", config) for config in configs])
    assert gen.engine.stats.steps <= 3  # a prefill step, then the loop (cut where a row finishes, at most once more)
    assert all(re.fullmatch(pattern, r.text) and r.finish_reason == "stop" for r in results), [r.text for r in results]
    assert gen.generate("go", configs[7]).token_ids == results[7].token_ids
