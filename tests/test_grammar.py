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

#: Constrained rows a decode loop takes here (below the engine's default, so small batches pass it).
GRAMMAR_LOOP_ROWS = 8


@pytest.fixture(autouse=True)
def _grammar_loop_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("zgen.runtime.engine.GRAMMAR_LOOP_ROWS", GRAMMAR_LOOP_ROWS)


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
    # A constrained row draws the same tokens alone (in the decode loop, its grammar advanced by the
    # loop's host callback) as in the batch (more rows than GRAMMAR_LOOP_ROWS: one engine step a token).
    assert len(constrained) > GRAMMAR_LOOP_ROWS
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
    assert len(configs) - 1 <= GRAMMAR_LOOP_ROWS
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


def test_cli_generates_within_a_regex_and_a_schema_file(tmp_path: Path, small_chat_checkpoint: tuple[Path, Any]) -> None:
    """On the two-layer chat model (the grammar decides what may follow, whatever the weights)."""
    model = ["--model", str(small_chat_checkpoint[0])]
    result = runner.invoke(app, ["generate", *model, "-p", "The year the war ended:", "--temperature", "0", "-n", "8", "--regex", r" ?[12][0-9]{3}"])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r" ?[12][0-9]{3}\n", result.stdout)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS["enum"]))
    result = runner.invoke(app, ["generate", *model, "--chat", "-p", "Pick a colour.", "--temperature", "0", "-n", "8", "--json-schema", str(schema), "--json"])
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


def test_decode_loop_draws_on_while_the_host_computes_the_next_masks(tiny: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar work of a draw runs on the host while the loop goes on to the next forward pass:
    each worker turn holds back until the loop has reached its next wait (after that forward pass),
    which a loop that waited for the host after every draw could never do. Same tokens as without."""
    import threading

    from zgen.runtime.grammar import GrammarLoop

    config = json_config(SCHEMAS["nested"], 1.0, seed=3)
    expected = Generator(tiny).generate("hello", config)

    waits = 0
    reached = threading.Condition()
    submitted: list[int] = []  # the waits entered when each turn was handed over
    held, missed = [], []
    wait, submit, advance = GrammarLoop.wait, GrammarLoop.submit, GrammarLoop._advance

    def counted_wait(self: GrammarLoop, after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nonlocal waits
        with reached:
            waits += 1
            reached.notify_all()
        return wait(self, after)

    def counted_submit(self: GrammarLoop, drawn: np.ndarray, live: np.ndarray, masks_wanted: np.ndarray) -> None:
        with reached:
            submitted.append(waits)
        submit(self, drawn, live, masks_wanted)

    def held_advance(self: GrammarLoop, drawn: np.ndarray, live: np.ndarray, masks_wanted: np.ndarray) -> Any:
        with reached:
            before = submitted.pop(0)
            if masks_wanted.any():  # the loop goes on: it will wait again, after its next forward pass
                (held if reached.wait_for(lambda: waits > before, timeout=20) else missed).append(before)
        return advance(self, drawn, live, masks_wanted)

    # the callbacks' overlap (on a GPU the loop takes the exchange instead: test_exchange.py)
    monkeypatch.setattr(GrammarLoop, "exchanges", property(lambda self: False))
    monkeypatch.setattr(GrammarLoop, "wait", counted_wait)
    monkeypatch.setattr(GrammarLoop, "submit", counted_submit)
    monkeypatch.setattr(GrammarLoop, "_advance", held_advance)
    result = Generator(tiny).generate("hello", config)
    assert result.token_ids == expected.token_ids and result.finish_reason == "stop"
    assert not missed and len(held) >= len(result.token_ids) - 1
