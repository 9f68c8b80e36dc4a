"""Parsing OpenAI Batch API request lines into zgen's sampling configs (no model needed)."""

from __future__ import annotations

import json

import pytest

from batch_helpers import chat_line, completion_line
from zgen.batch import BatchRequest, LineError, parse_line
from zgen.batch.format import COMPLETIONS_DEFAULT_MAX_TOKENS, choice_sampling


def parsed(line: str) -> BatchRequest:
    request = parse_line(line, 1)
    assert isinstance(request, BatchRequest), request
    return request


def test_every_sampling_parameter_reaches_the_config() -> None:
    request = parsed(completion_line(
        "a", "w5", max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="w9", n=2, presence_penalty=0.5,
        frequency_penalty=-0.5, top_k=40, min_p=0.05, repetition_penalty=1.1, logprobs=3,
    ))
    s = request.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.seed, s.stop) == (7, 0.5, 0.9, 3, ("w9",))
    assert (s.presence_penalty, s.frequency_penalty, s.top_k, s.min_p, s.repetition_penalty) == (0.5, -0.5, 40, 0.05, 1.1)
    assert (request.n, request.top_logprobs, request.prompts) == (2, 3, ("w5",))
    assert choice_sampling(s, 1).seed == 4  # the n choices of a seeded request differ, repeatably


def test_chat_defaults_and_content_parts() -> None:
    line = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "w5 "}, {"type": "text", "text": "w6"}]}],
    }})
    request = parsed(line)
    assert request.prompts == ([{"role": "user", "content": "w5 w6"}],)
    assert not request.max_tokens_given and request.top_logprobs is None and request.model == "m"
    assert parsed(chat_line("c", "w5", logprobs=True)).top_logprobs == 0
    assert parsed(chat_line("c", "w5", max_completion_tokens=9)).sampling.max_new_tokens == 9
    assert parsed(completion_line("p", "w5")).sampling.max_new_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert parsed(completion_line("p", ["w5", "w6"])).prompts == ("w5", "w6")
    assert parsed(completion_line("p", [[1, 2], [3]])).prompts == ([1, 2], [3])


@pytest.mark.parametrize(
    ("line", "param"),
    [
        (completion_line("x", "w5", top_p=0), "top_p"),
        (completion_line("x", "w5", presence_penalty=3), "presence_penalty"),
        (completion_line("x", "w5", n=0), "n"),
        (completion_line("x", "w5", seed=1.5), "seed"),
        (completion_line("x", "w5", stop=[""]), "stop"),
        (completion_line("x", "w5", logprobs=21), "logprobs"),
        (completion_line("x", "w5", echo=True), "echo"),
        (completion_line("x", [1, True]), "prompt"),
        (chat_line("x", "w5", temperature=float("nan")), "temperature"),
        (chat_line("x", "w5", top_logprobs=2), "top_logprobs"),
        (json.dumps({"custom_id": "x", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user"}]}}), "messages"),
        (json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {"prompt": "w5"}}), "method"),
    ],
)
def test_invalid_parameters_name_themselves(line: str, param: str) -> None:
    error = parse_line(line, 4)
    assert isinstance(error, LineError) and error.param == param and error.custom_id == "x" and error.line == 4, error


def test_response_format_becomes_a_grammar() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    request = parsed(chat_line("j", "w5", response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
    grammar = request.sampling.grammar
    assert grammar is not None and grammar.kind == "json_schema" and json.loads(grammar.source) == schema
    assert parsed(chat_line("o", "w5", response_format={"type": "json_object"})).sampling.grammar is not None
    assert parsed(chat_line("t", "w5", response_format={"type": "text"})).sampling.grammar is None
    for bad in ({"type": "yaml"}, {"type": "json_schema", "json_schema": {"schema": 3}}, {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}):
        error = parse_line(chat_line("b", "w5", response_format=bad), 1)
        assert isinstance(error, LineError) and error.param == "response_format", error
