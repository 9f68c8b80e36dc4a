"""Text <-> token ids, chat templates and streaming detokenization, on top of HF ``tokenizers``.

A :class:`Tokenizer` is built either from a GGUF file's metadata (:meth:`Tokenizer.from_gguf`) or
from a Hugging Face tokenizer directory (:meth:`Tokenizer.from_hf_dir`). The BPE itself is always run
by the ``tokenizers`` library; this module only decides how to configure it so that ids match the
model's own tokenizer, and adds what generation needs on top: BOS handling, EOS ids, chat-template
rendering and an :class:`IncrementalDecoder` for streaming.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import gguf
import jinja2
import jinja2.ext
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, normalizers, pre_tokenizers

from zgen.errors import (
    CheckpointError,
    InputError,
    ModelNotFoundError,
    TemplateError,
    TokenIdError,
    UnsupportedModelError,
)

__all__ = ["IncrementalDecoder", "Tokenizer"]

# The replacement character that lossy UTF-8 decoding produces for an incomplete byte sequence.
_REPLACEMENT = "\ufffd"


# --------------------------------------------------------------------------------------------------
# Pre-tokenizers, by the name llama.cpp writes to ``tokenizer.ggml.pre``


@dataclass(frozen=True)
class _PreTokenizerSpec:
    """How one GGUF pre-tokenizer name maps onto ``tokenizers`` components."""

    # Regex that splits text before byte-level encoding; None means GPT-2's own regex.
    split_regex: str | None = None
    # Split every digit into its own piece before the regex (StarCoder/SmolLM tokenizers do).
    individual_digits: bool = False
    # Llama 3 looks a whole pre-token up in the vocabulary before applying merges.
    ignore_merges: bool = False
    # Qwen2 normalizes text to NFC before tokenizing.
    nfc: bool = False


_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's pattern is Llama 3's with single digits instead of runs of up to three.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

_PRE_TOKENIZERS: dict[str, _PreTokenizerSpec] = {
    "default": _PreTokenizerSpec(),
    "gpt2": _PreTokenizerSpec(),
    "smollm": _PreTokenizerSpec(individual_digits=True),
    "starcoder": _PreTokenizerSpec(individual_digits=True),
    "llama-bpe": _PreTokenizerSpec(split_regex=_LLAMA3_REGEX, ignore_merges=True),
    "llama3": _PreTokenizerSpec(split_regex=_LLAMA3_REGEX, ignore_merges=True),
    "llama-v3": _PreTokenizerSpec(split_regex=_LLAMA3_REGEX, ignore_merges=True),
    "qwen2": _PreTokenizerSpec(split_regex=_QWEN2_REGEX, nfc=True),
}

_SUPPORTED_GGUF_MODELS = ("gpt2",)


def _byte_level_tokenizer(
    vocab: dict[str, int], merges: list[tuple[str, str]], pre: _PreTokenizerSpec
) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.split_regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(tokenizers.Regex(pre.split_regex), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


# --------------------------------------------------------------------------------------------------
# GGUF metadata access with type checks (a wrong type means a corrupt or foreign file)


def _gguf_value(reader: gguf.GGUFReader, key: str) -> Any:
    field_ = reader.get_field(key)
    try:
        return None if field_ is None else field_.contents()
    except UnicodeDecodeError as err:  # gguf decodes a string only when it is asked for
        raise CheckpointError(f"GGUF metadata {key!r} holds a string that is not UTF-8 ({err.reason}); the file is corrupt") from err


def _gguf_typed(reader: gguf.GGUFReader, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = _gguf_value(reader, key)
    if value is not None and not isinstance(value, kind):
        found = type(value).__name__
        raise CheckpointError(f"GGUF metadata {key!r} should be {what}, found {found}; the file is corrupt")
    return value


def _gguf_list(reader: gguf.GGUFReader, key: str, item: type, what: str) -> list[Any] | None:
    value = _gguf_typed(reader, key, list, f"a list of {what}")
    if value is not None and not all(isinstance(v, item) for v in value):
        raise CheckpointError(f"GGUF metadata {key!r} should be a list of {what}; the file is corrupt")
    return value


def _gguf_int(reader: gguf.GGUFReader, key: str) -> int | None:
    return _gguf_typed(reader, key, int, "an integer")


# --------------------------------------------------------------------------------------------------
# Chat templates


class _TemplateRaised(jinja2.TemplateError):
    """What a template's ``raise_exception(...)`` call raises."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson HTML-escapes its output, which chat templates must not do.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # The same environment settings as transformers, so rendered prompts match it byte for byte.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateError(f"the chat template has a syntax error at line {err.lineno}: {err.message}") from err


# --------------------------------------------------------------------------------------------------
# Hugging Face directory helpers


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not readable JSON ({err}); re-download or re-save the tokenizer") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} should hold a JSON object; re-download or re-save the tokenizer")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken-like object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _config_chat_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}, ...]
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
    return None


# --------------------------------------------------------------------------------------------------


def plain_ints(values: Sequence[object]) -> bool:
    """Whether every value is a Python ``int`` (a ``bool`` is not), checked at C speed: per-value
    ``isinstance`` checks of its prompts cost a 1,000-request batch job seconds before its first step."""
    return set(map(type, values)) <= {int}


def plain_token_ids(ids: Sequence[object], vocab_size: int) -> bool:
    """Whether ``ids`` are Python ints in ``[0, vocab_size)``: the common case, checked at C speed
    (anything else goes through the per-id check that says what is wrong)."""
    return plain_ints(ids) and (not ids or (0 <= min(cast(Sequence[int], ids)) and max(cast(Sequence[int], ids)) < vocab_size))


def _checked_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    if plain_token_ids(ids, vocab_size):
        return list(ids)
    checked: list[int] = []
    for i in ids:
        # Integers only (numpy/jax integer scalars too): 1.5, "5" and True are not token ids.
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or not 0 <= i < vocab_size:
            raise TokenIdError(f"token id {i!r} is not an integer in [0, {vocab_size})")
        checked.append(int(i))
    return checked


# UTF-16 surrogate code points: in a Python str they stand alone (bytes decoded with
# errors="surrogateescape", as sys.argv is), which is not Unicode text and cannot be encoded.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _checked_text(text: object, what: str = "text") -> str:
    """``text`` if it is a ``str`` of valid Unicode, else :class:`InputError` saying how to fix it."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        raise InputError(f"{what} is {type(text).__name__}, not str: decode it first (data.decode('utf-8'))")
    if not isinstance(text, str):
        raise InputError(f"{what} must be a str, got {type(text).__name__}")
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise InputError(
            f"{what} is not valid Unicode: a lone surrogate {bad.group()!r} at character {bad.start()} (what bytes "
            "that are not UTF-8 become when decoded with errors='surrogateescape', as on a command line); "
            "pass UTF-8 text, or decode the bytes with errors='replace'"
        )
    return text


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A model's tokenizer: encoding, decoding, chat templates and streaming detokenization.

    ``backend`` is the configured ``tokenizers.Tokenizer``; it never adds BOS/EOS itself — ``encode``
    adds BOS when ``add_bos`` says so. Change settings with ``dataclasses.replace`` (for example a
    ``chat_template`` for a model that ships none).
    """

    backend: tokenizers.Tokenizer = field(repr=False)
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: str | None = field(default=None, repr=False)
    add_bos: bool = False

    @functools.cached_property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ---------------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """The tokenizer described by a GGUF file's ``tokenizer.*`` metadata."""
        keys = gguf.Keys.Tokenizer
        model = _gguf_typed(reader, keys.MODEL, str, "a string")
        if model is None:
            raise CheckpointError(f"the GGUF file has no {keys.MODEL!r} metadata, so it carries no tokenizer")
        if model not in _SUPPORTED_GGUF_MODELS:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported; zgen supports: {', '.join(_SUPPORTED_GGUF_MODELS)} "
                "(byte-level BPE)"
            )
        # llama.cpp reads a missing pre-tokenizer name as its default.
        pre_name = _gguf_typed(reader, keys.PRE, str, "a string") or "default"
        pre = _PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise UnsupportedModelError(
                f"GGUF pre-tokenizer {pre_name!r} is not supported; zgen supports: {', '.join(sorted(_PRE_TOKENIZERS))}"
            )

        tokens = _gguf_list(reader, keys.LIST, str, "strings")
        merges = _gguf_list(reader, keys.MERGES, str, "strings")
        if tokens is None or merges is None:
            raise CheckpointError(f"the GGUF file lacks {keys.LIST!r} or {keys.MERGES!r}, which a BPE tokenizer needs")
        token_types = _gguf_list(reader, keys.TOKEN_TYPE, int, "integers") or [gguf.TokenType.NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise CheckpointError(
                f"GGUF has {len(tokens)} tokens but {len(token_types)} token types; the file is corrupt"
            )
        vocab = {token: i for i, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise UnsupportedModelError(
                "the GGUF token list has duplicate entries, which zgen's tokenizer cannot represent"
            )
        merge_pairs: list[tuple[str, str]] = []
        for merge in merges:
            # Byte-level tokens never contain a plain space (it is encoded as "Ġ"), so one space separates a pair.
            left, sep, right = merge.partition(" ")
            if not sep:
                raise CheckpointError(f"GGUF merge {merge!r} is not a space-separated pair; the file is corrupt")
            merge_pairs.append((left, right))

        try:
            backend = _byte_level_tokenizer(vocab, merge_pairs, pre)
        except Exception as err:  # tokenizers reports inconsistent vocab/merges as a bare Exception
            raise CheckpointError(
                f"the GGUF tokenizer's vocabulary and merges disagree ({err}); the file is corrupt"
            ) from err

        # Control and user-defined tokens are matched whole in text; only control tokens count as special
        # (skipped by decode(skip_special_tokens=True)), as llama.cpp renders user-defined ones as text.
        def added(kind: gguf.TokenType, special: bool) -> list[tokenizers.AddedToken]:
            return [
                tokenizers.AddedToken(tokens[i], special=special, normalized=False)
                for i, t in enumerate(token_types)
                if t == kind
            ]

        backend.add_special_tokens(added(gguf.TokenType.CONTROL, special=True))
        backend.add_tokens(added(gguf.TokenType.USER_DEFINED, special=False))

        def token_id(key: str) -> int | None:
            value = _gguf_int(reader, key)
            if value is not None and not 0 <= value < len(tokens):
                raise CheckpointError(
                    f"GGUF metadata {key!r} = {value} is outside the vocabulary of {len(tokens)} tokens"
                )
            return value

        # End-of-turn/-message tokens end generation just as EOS does (llama.cpp's "end of generation" set).
        eos_ids: list[int] = []
        for key in (keys.EOS_ID, keys.EOT_ID, keys.EOM_ID):
            value = token_id(key)
            if value is not None and value not in eos_ids:
                eos_ids.append(value)
        return cls(
            backend=backend,
            bos_id=token_id(keys.BOS_ID),
            eos_ids=tuple(eos_ids),
            chat_template=_gguf_typed(reader, keys.CHAT_TEMPLATE, str, "a string"),
            add_bos=bool(_gguf_typed(reader, keys.ADD_BOS, bool, "a boolean")),
        )

    @classmethod
    def from_hf_dir(cls, path: Path | str) -> Tokenizer:
        """The tokenizer in a Hugging Face model directory.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` and ``special_tokens_map.json``
        (optional; BOS/EOS tokens, ``add_bos_token``, ``chat_template``) and ``chat_template.jinja``
        (optional; preferred over the config's template, as transformers does).
        """
        path = Path(path)
        if not path.is_dir():
            raise ModelNotFoundError(f"tokenizer directory {path} does not exist")
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelNotFoundError(
                f"{tokenizer_file} is missing; zgen needs the fast-tokenizer file: download it with the model, or "
                "write it with transformers' AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # tokenizers reports every parse failure as a bare Exception
            raise CheckpointError(
                f"{tokenizer_file} is not a valid tokenizers file ({err}); re-download or re-save the tokenizer"
            ) from err

        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
            if (path / name).is_file():
                config |= _read_json_object(path / name)

        def token_id(key: str) -> int | None:
            content = _token_content(config.get(key))
            if content is None:
                return None
            found = backend.token_to_id(content)
            if found is None:
                raise CheckpointError(f"{key} {content!r} in {path} is not in the vocabulary of {tokenizer_file}")
            return found

        bos_id = token_id("bos_token")
        eos_id = token_id("eos_token")
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # No explicit setting: follow what tokenizer.json's post-processor does.
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]

        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _config_chat_template(config.get("chat_template"))
        return cls(
            backend=backend,
            bos_id=bos_id,
            eos_ids=() if eos_id is None else (eos_id,),
            chat_template=chat_template,
            add_bos=add_bos,
        )

    # ---------------------------------------------------------------------------------------------
    # Encoding and decoding

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        Special tokens written in the text (``"<|im_start|>"``) become their ids; ``add_special_tokens``
        only controls the BOS that ``add_bos`` asks for. Characters with a UTF-8 byte the vocabulary has
        no token for are dropped, as the model's own tokenizer does (it has no unknown token).
        """
        ids = self.backend.encode(_checked_text(text), add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.backend.decode(_checked_ids(ids, self.vocab_size), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, *, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A streaming decoder whose outputs concatenate to ``decode`` of all pushed ids."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------------------------------------
    # Chat

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered with the model's chat template.

        Raises :class:`TemplateError` if the model has no template, the template does not parse, or
        rendering fails (including the template's own ``raise_exception`` calls).
        """
        if self.chat_template is None:
            raise TemplateError(
                "this tokenizer has no chat template; set one with dataclasses.replace(tokenizer, chat_template=...) "
                "or format the prompt yourself"
            )
        template = _compile_template(self.chat_template)
        messages = _checked_messages(messages)
        # Unset tokens are left undefined (rendering as ""), as transformers does.
        special: dict[str, str | None] = {}
        if self.bos_id is not None:
            special["bos_token"] = self.backend.id_to_token(self.bos_id)
        if self.eos_ids:
            special["eos_token"] = self.backend.id_to_token(self.eos_ids[0])
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **special,
            )
        except _TemplateRaised as err:
            raise TemplateError(f"the chat template rejected the messages: {err.message}") from err
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as err:
            raise TemplateError(f"the chat template failed to render: {type(err).__name__}: {err}") from err


def _checked_messages(messages: object) -> list[dict[str, str]]:
    """Chat messages as fresh dicts, each with string ``role`` and ``content`` (other keys: strings too)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InputError(f"chat messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}")
    checked: list[dict[str, str]] = []
    for i, message in enumerate(cast(Sequence[object], messages)):
        if not isinstance(message, Mapping):
            raise InputError(f"chat message {i} is a {type(message).__name__}, not a {{'role': ..., 'content': ...}} dict")
        items = cast(Mapping[object, object], message)
        for key in ("role", "content"):
            if not isinstance(items.get(key), str):
                raise InputError(f"chat message {i} needs a string {key!r}, got {items.get(key)!r}")
        for key, value in items.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise InputError(f"chat message {i} has a non-string entry {key!r}: {value!r}; messages map strings to strings")
        checked.append({str(k): str(v) for k, v in items.items()})
    return checked


class IncrementalDecoder:
    """Streaming detokenizer: ``push`` ids one at a time, get back only newly completed text.

    It decodes a small window — the tokens emitted last step (as context) plus the tokens not yet
    emitted — and holds text back while it ends in U+FFFD, which is how an incomplete multi-byte
    character looks before its remaining byte tokens arrive. The concatenation of every ``push``
    and the final ``flush`` equals ``Tokenizer.decode`` of all pushed ids.
    """

    __slots__ = ("_tokenizer", "_skip", "_window", "_read", "_prefix_text")

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = []  # ids from the context tokens onward
        self._read = 0  # _window[:_read] is already-emitted context
        self._prefix_text = ""  # decode(_window[:_read])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.backend.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._window.extend(_checked_ids((token_id,), self._tokenizer.vocab_size))
        text = self._decode(self._window)
        new = text[len(self._prefix_text) :]
        if new.endswith(_REPLACEMENT):
            return ""
        # Everything is emitted: the unread tokens become the next step's context.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new

    def flush(self) -> str:
        """The held-back text (incomplete bytes decode to U+FFFD); the decoder then starts afresh."""
        new = self._decode(self._window)[len(self._prefix_text) :]
        self._window = []
        self._read = 0
        self._prefix_text = ""
        return new
