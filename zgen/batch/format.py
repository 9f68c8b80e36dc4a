"""The OpenAI Batch API file format: request lines in, result records out.

An input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``: text, token ids,
or a list of either). :func:`parse_line` turns it into a :class:`BatchRequest` (a
:class:`~zgen.runtime.sampling.SamplingConfig` per request, ``n`` choices, log-probs wanted) or a
:class:`LineError` naming what was wrong. :func:`success_record` and :func:`error_record` build the
output lines: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` with a
``ChatCompletion`` or ``Completion`` body, or ``response: null`` and an ``error`` (``code``,
``message``, ``param``, ``line``).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from zgen.errors import ConfigError, ZgenError
from zgen.runtime.grammar import Grammar
from zgen.runtime.results import GenerationResult
from zgen.runtime.sampling import SamplingConfig
from zgen.tokenizer import Tokenizer, plain_ints

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]

#: ``max_tokens`` when a completions request gives none (the API's documented default); a chat request
#: without one may generate up to the model's context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 128  # n, as the API bounds it
MAX_TOP_LOGPROBS = 20

# Body keys accepted and ignored: they describe the API call, not the generation.
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
_SAMPLING_KEYS = {
    "temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty", "top_k", "min_p",
    "repetition_penalty", "max_tokens", "logprobs", "stream", "lora",
}
_CHAT_KEYS = _SAMPLING_KEYS | {"messages", "max_completion_tokens", "top_logprobs", "response_format"}
_COMPLETIONS_KEYS = _SAMPLING_KEYS | {"prompt", "echo", "best_of", "suffix"}

Message = dict[str, str]
Prompt = str | list[int] | list[Message]


@dataclass(frozen=True)
class LineError:
    """A request that will not run: its line (1-based), custom_id when readable, and why."""

    line: int
    custom_id: str | None
    code: str  # invalid_json, invalid_request, invalid_url, invalid_parameter, model_not_found, duplicate_custom_id, prompt_too_long, generation_failed
    message: str
    param: str | None = None


@dataclass(frozen=True)
class BatchRequest:
    """One valid input line: ``prompts`` (one for chat, one or more for completions), each generated
    ``n`` times with ``sampling`` (choice ``i`` of a seeded request uses ``seed + i``)."""

    line: int
    custom_id: str
    url: Endpoint
    model: str | None
    prompts: tuple[Prompt, ...]
    sampling: SamplingConfig
    n: int = 1
    top_logprobs: int | None = None  # None: no log-probs; k >= 0: each token's log-prob and its k best alternatives
    max_tokens_given: bool = True  # False: a chat request may use the rest of the context
    lora: str | None = None  # the LoRA module the body names with zgen's "lora" field (resolved by the job)


def choice_sampling(sampling: SamplingConfig, index: int) -> SamplingConfig:
    """Choice ``index`` of a seeded request samples with ``seed + index``: the n choices differ, and
    each is repeatable."""
    if sampling.seed is None or index == 0:
        return sampling
    return replace(sampling, seed=sampling.seed + index)


class _Invalid(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def read_custom_id(text: str) -> str | None:
    """The line's ``custom_id`` if it is readable JSON with a string one (for resuming and duplicates)."""
    try:
        raw: object = json.loads(text)
    except ValueError:
        return None
    if isinstance(raw, dict):
        value = cast(dict[str, object], raw).get("custom_id")
        if isinstance(value, str) and value:
            return value
    return None


def parse_line(text: str, line: int) -> BatchRequest | LineError:
    """A request line checked for everything but its prompt length (which needs the tokenizer)."""
    try:
        raw: object = json.loads(text)
    except ValueError as err:
        return LineError(line, None, "invalid_json", f"line {line} is not JSON: {err}")
    if not isinstance(raw, dict):
        return LineError(line, None, "invalid_json", f"line {line} is a JSON {type(raw).__name__}, not an object")
    record = cast(dict[str, object], raw)
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line, None, "invalid_request", f"line {line} needs a non-empty string custom_id", "custom_id")
    try:
        return _parse_request(record, custom_id, line)
    except _Invalid as err:
        return LineError(line, custom_id, err.code, err.message, err.param)


def _parse_request(record: dict[str, object], custom_id: str, line: int) -> BatchRequest:
    method = record.get("method", "POST")
    if method != "POST":
        raise _Invalid("invalid_request", f"method must be POST, got {method!r}", "method")
    url = record.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise _Invalid("invalid_url", f"url {url!r} is not served; use {CHAT_URL} or {COMPLETIONS_URL}", "url")
    body = record.get("body")
    if not isinstance(body, dict):
        raise _Invalid("invalid_request", "body must be a JSON object", "body")
    body = cast(dict[str, object], body)
    chat = url == CHAT_URL
    allowed = _CHAT_KEYS if chat else _COMPLETIONS_KEYS
    unknown = sorted(k for k in body if k not in allowed and k not in _IGNORED)
    if unknown:
        raise _Invalid("invalid_parameter", f"unsupported parameter {unknown[0]!r} for {url}", unknown[0])
    if body.get("stream", False) is not False:
        raise _Invalid("invalid_parameter", "stream is not available in a batch job; leave it out", "stream")
    if not chat:
        _require_default(body, "echo", False)
        _require_default(body, "best_of", 1)
        _require_default(body, "suffix", None)
    prompts = (_messages(body.get("messages")),) if chat else _completion_prompts(body.get("prompt"))
    max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, max_key, 1, None)
    n = _integer(body, "n", 1, MAX_CHOICES)
    top = _logprobs(body, chat)
    model = body.get("model")
    lora = body.get("lora")
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise _Invalid("invalid_parameter", f"lora must name a LoRA module registered for the job, got {lora!r}", "lora")
    sampling = _sampling(body, max_tokens if max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS)
    if chat and (grammar := _response_format(body.get("response_format"))) is not None:
        sampling = replace(sampling, grammar=grammar)
    return BatchRequest(
        line, custom_id, cast(Endpoint, url), model if isinstance(model, str) else None, prompts, sampling,
        n=1 if n is None else n, top_logprobs=top, max_tokens_given=max_tokens is not None or not chat, lora=lora,
    )


def _require_default(body: dict[str, object], key: str, default: object) -> None:
    if key in body and body[key] != default:
        raise _Invalid("invalid_parameter", f"{key}={body[key]!r} is not supported; leave it out", key)


def _integer(body: dict[str, object], key: str, low: int, high: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _Invalid("invalid_parameter", f"{key} must be an integer {bound}, got {value!r}", key)
    return value


def _number(body: dict[str, object], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Invalid("invalid_parameter", f"{key} must be a finite number, got {value!r}", key)
    return float(value)


def _messages(value: object) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise _Invalid("invalid_parameter", "messages must be a non-empty list of {role, content} objects", "messages")
    messages: list[Message] = []
    for i, item in enumerate(cast(list[object], value)):
        if not isinstance(item, dict):
            raise _Invalid("invalid_parameter", f"messages[{i}] is not an object", "messages")
        message = cast(dict[str, object], item)
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise _Invalid("invalid_parameter", f"messages[{i}].role must be a non-empty string", "messages")
        messages.append({"role": role, "content": _content(content, i)})
    return messages


def _content(content: object, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in cast(list[object], content):
            if not isinstance(part, dict) or cast(dict[str, object], part).get("type") != "text":
                raise _Invalid("invalid_parameter", f"messages[{i}].content may hold text parts only", "messages")
            text = cast(dict[str, object], part).get("text")
            if not isinstance(text, str):
                raise _Invalid("invalid_parameter", f"messages[{i}].content has a text part without a string text", "messages")
            parts.append(text)
        return "".join(parts)
    raise _Invalid("invalid_parameter", f"messages[{i}].content must be a string or a list of text parts", "messages")


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and plain_ints(cast(list[object], value))


def _completion_prompts(value: object) -> tuple[Prompt, ...]:
    """``prompt``: text, token ids, or a non-empty list of texts or of token-id lists."""
    if isinstance(value, str) and value:
        return (value,)
    if _is_ids(value):
        return (cast(list[int], value),)
    if isinstance(value, list) and value:
        items = cast(list[object], value)
        if all(isinstance(p, str) and p for p in items):
            return tuple(cast(list[str], items))
        if all(_is_ids(p) for p in items):
            return tuple(cast(list[list[int]], items))
    raise _Invalid(
        "invalid_parameter", "prompt must be non-empty text, a list of token ids, or a list of either", "prompt"
    )


def _response_format(value: object) -> Grammar | None:
    """``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, as a :class:`Grammar`."""
    if value is None:
        return None
    kind = cast(dict[str, object], value).get("type") if isinstance(value, dict) else None
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar.json_schema({"type": "object"})
        if kind == "json_schema":
            spec = cast(dict[str, object], value).get("json_schema")
            schema = cast(dict[str, object], spec).get("schema", True) if isinstance(spec, dict) else None
            if isinstance(schema, (dict, bool)):
                return Grammar.json_schema(cast(dict[str, object] | bool, schema))
    except ZgenError as err:  # a malformed schema, or structured output not installed
        raise _Invalid("invalid_parameter", f"response_format: {err}", "response_format") from None
    raise _Invalid(
        "invalid_parameter",
        'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}',
        "response_format",
    )


def _logprobs(body: dict[str, object], chat: bool) -> int | None:
    if chat:
        wanted = body.get("logprobs", False)
        if not isinstance(wanted, bool):
            raise _Invalid("invalid_parameter", f"logprobs must be true or false for {CHAT_URL}", "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not wanted:
            raise _Invalid("invalid_parameter", "top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if wanted else None
    return _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def _sampling(body: dict[str, object], max_tokens: int) -> SamplingConfig:
    values: dict[str, Any] = {"max_new_tokens": max_tokens}
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        number = _number(body, key)
        if number is not None:
            values[key] = number
    if (temperature := values.get("temperature")) is not None and temperature > 2.0:
        raise _Invalid("invalid_parameter", f"temperature must be in [0, 2], got {temperature}", "temperature")
    for key in ("top_k", "seed"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise _Invalid("invalid_parameter", f"{key} must be an integer, got {value!r}", key)
            values[key] = value
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in cast(list[object], stops)):
            raise _Invalid("invalid_parameter", "stop must be a non-empty string or a list of them", "stop")
        values["stop"] = tuple(cast(list[str], stops))
    try:
        return SamplingConfig(**values)
    except ConfigError as err:  # "SamplingConfig.<field>=<value>: <why>"
        message = str(err).removeprefix("SamplingConfig.").replace("max_new_tokens", "max_tokens")
        raise _Invalid("invalid_parameter", message, message.split("=")[0]) from None


# -- output records ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-prob and its best alternatives (most probable first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Choice:
    prompt_index: int
    result: GenerationResult
    logprobs: list[TokenLogprobs] | None = None


RecordKey = str | int  # a custom_id, or the line number of a line whose custom_id could not be read


def record_key(record: Mapping[str, object]) -> RecordKey | None:
    """What identifies an output record when resuming: its custom_id, or for a line that had none
    readable, its line number. None for something that is not a record."""
    custom_id = record.get("custom_id")
    if isinstance(custom_id, str):
        return custom_id
    error = record.get("error")
    if custom_id is None and isinstance(error, dict):
        line = cast(dict[str, object], error).get("line")
        if isinstance(line, int) and not isinstance(line, bool):
            return line
    return None


def error_record(error: LineError) -> dict[str, object]:
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": error.custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message, "param": error.param, "line": error.line},
    }


def success_record(request: BatchRequest, choices: Sequence[Choice], tokenizer: Tokenizer, model: str) -> dict[str, object]:
    """The record of a request whose every choice finished, with the ChatCompletion or Completion body
    reporting ``model`` as the model that answered."""
    chat = request.url == CHAT_URL
    first = {c.prompt_index: c.result for c in reversed(choices)}  # each prompt counted once, as the API does
    prompt_tokens = sum(r.usage.prompt_tokens for r in first.values())
    cached = sum(r.usage.cached_prompt_tokens for r in first.values())
    completion_tokens = sum(c.result.usage.completion_tokens for c in choices)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    body: dict[str, object] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [(_chat_choice if chat else _completion_choice)(i, c, tokenizer) for i, c in enumerate(choices)],
        "usage": usage,
    }
    return {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": request.custom_id,
        "response": {"status_code": 200, "request_id": f"req_{secrets.token_hex(12)}", "body": body},
        "error": None,
    }


def _token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int] | None]:
    text = tokenizer.decode([token])
    return text, (None if "\ufffd" in text else list(text.encode("utf-8")))


def _chat_choice(index: int, choice: Choice, tokenizer: Tokenizer) -> dict[str, object]:
    logprobs: dict[str, object] | None = None
    if choice.logprobs is not None:
        content: list[dict[str, object]] = []
        for entry in choice.logprobs:
            text, raw = _token_text(tokenizer, entry.token)
            top = []
            for token, logprob in entry.top:
                alt, alt_raw = _token_text(tokenizer, token)
                top.append({"token": alt, "bytes": alt_raw, "logprob": logprob})
            content.append({"token": text, "bytes": raw, "logprob": entry.logprob, "top_logprobs": top})
        logprobs = {"content": content, "refusal": None}
    return {
        "index": index,
        "message": {"role": "assistant", "content": choice.result.text, "refusal": None},
        "logprobs": logprobs,
        "finish_reason": choice.result.finish_reason,
    }


def _completion_choice(index: int, choice: Choice, tokenizer: Tokenizer) -> dict[str, object]:
    logprobs: dict[str, object] | None = None
    if choice.logprobs is not None:
        decoder = tokenizer.incremental_decoder()
        offsets, offset = [], 0
        for entry in choice.logprobs:
            offsets.append(offset)
            offset += len(decoder.push(entry.token))
        logprobs = {
            "tokens": [_token_text(tokenizer, e.token)[0] for e in choice.logprobs],
            "token_logprobs": [e.logprob for e in choice.logprobs],
            "top_logprobs": [{_token_text(tokenizer, t)[0]: lp for t, lp in e.top} for e in choice.logprobs],
            "text_offset": offsets,
        }
    return {"index": index, "text": choice.result.text, "logprobs": logprobs, "finish_reason": choice.result.finish_reason}
