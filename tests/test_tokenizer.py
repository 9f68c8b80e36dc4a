"""The tokenizer layer: SmolLM2's GGUF tokenizer against transformers, round trips, streaming, chat templates."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import processors
from tokenizers.pre_tokenizers import ByteLevel

from zgen.errors import CheckpointError, ModelNotFoundError, TemplateError, TokenIdError, UnsupportedModelError
from zgen.tokenizer import Tokenizer

SPECIAL_TEXTS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>", "<jupyter_code>"]
# Characters whose UTF-8 bytes SmolLM2's vocabulary has no token for: its tokenizer drops them
# (see test_uncovered_characters_are_dropped), so they cannot round-trip.
UNCOVERED = re.compile("[\x04\x06\x13\x14\x16\x1d\U00040000-\U000bffff]")
# Text that reaches every tokenizer path: ASCII, accents, CJK, RTL, 4-byte emoji, ZWJ sequences, specials.
MULTIBYTE = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8").filter(lambda c: UNCOVERED.match(c) is None),
        st.sampled_from(list("é世界🙂👩‍💻\u0301\n\t ")),
    ),
    max_size=40,
)
TEXT_WITH_SPECIALS = st.lists(st.one_of(MULTIBYTE, st.sampled_from(SPECIAL_TEXTS)), max_size=6).map("".join)


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(smollm2_gguf_path))


@pytest.fixture(scope="module")
def hf_tok(smollm2_gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)


def stream(tokenizer: Tokenizer, ids: Sequence[int], *, skip_special_tokens: bool = False) -> list[str]:
    decoder = tokenizer.incremental_decoder(skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# ------------------------------------------------------------------------------------------------
# Metadata and SmolLM2's digit handling


def test_gguf_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1
    assert tok.eos_ids == (2,)
    assert tok.add_bos is False
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def test_whitespace_before_digit(tok: Tokenizer) -> None:
    # SmolLM2's own tokenizer splits digits first, so "  " stays one token (256 = "ĠĠ").
    assert tok.encode("a  2") == [81, 256, 34]


@pytest.mark.parametrize("text", ["Call 555 1234\n2024", "x=3.14159, y= 42", "  007\t\t12\n\n 9", "v1.2.3-rc10"])
def test_every_digit_is_its_own_token(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert "".join(pieces) == text
    for piece in pieces:
        if any(c.isdigit() for c in piece):
            assert len(piece) == 1, pieces
    assert sum(len(p) == 1 and p.isdigit() for p in pieces) == sum(c.isdigit() for c in text)


REFERENCE_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 'quoted', isn't it?",
    "Hello, world!\n\nThis is a second paragraph;   with  extra   spaces.  ",
    "def fib(n):\n    if n<2:\n        return n\n    return fib(n-1) + fib(n-2)\n",
    "for (int i=0; i<n; ++i) { x[i]*=2; }  // C++",
    "Größenwahn, naïve café, Ångström, x½+¼",
    "Привет, мир! Как дела?",
    "你好，世界。今天天气很好。",
    "こんにちは世界、カタカナとひらがな",
    "مرحبا بالعالم",
    "emoji: 🙂🚀👩‍💻🇫🇷 ✨",
    "abc123 x9y8 H2O CO2-free",
    "<|im_start|>user\nCompute(2+2)?<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\r\nwindows\r\nlines\u00a0nbsp",
]


@pytest.mark.parametrize("text", REFERENCE_TEXTS)
def test_ids_match_transformers_where_no_whitespace_precedes_a_digit(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    # transformers' GGUF conversion drops the digit split; it is an independent reference everywhere else.
    # (The split, like the regex's \p{N}, covers every Unicode numeric character, not just 0-9.)
    assert not any(a.isspace() and b.isnumeric() for a, b in zip(text, text[1:]))
    assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]


def test_uncovered_characters_are_dropped(tok: Tokenizer, hf_tok: Any) -> None:
    # SmolLM2's byte-level vocabulary lacks some bytes (0x04, 0xF1, ...) and has no unknown token,
    # so characters using them vanish (only their covered continuation bytes remain), as in transformers.
    text = "a\x04b\U00040000c"
    assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode(text)) == "ab\ufffd\ufffd\ufffdc"


# ------------------------------------------------------------------------------------------------
# Encoding and decoding


@settings(max_examples=200, deadline=None)
@given(TEXT_WITH_SPECIALS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_add_bos(tok: Tokenizer) -> None:
    assert tok.encode("hi")[0] != tok.bos_id
    with_bos = dataclasses.replace(tok, add_bos=True)
    assert with_bos.encode("hi") == [1, *tok.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == tok.encode("hi")


def test_out_of_range_ids(tok: Tokenizer) -> None:
    with pytest.raises(TokenIdError, match="49152"):
        tok.decode([5, 49152])
    with pytest.raises(TokenIdError):
        tok.decode([-1])
    with pytest.raises(TokenIdError):
        tok.incremental_decoder().push(10**6)


# ------------------------------------------------------------------------------------------------
# Streaming


@pytest.fixture(scope="module")
def partial_char_ids(tok: Tokenizer) -> list[int]:
    """Ids of tokens that hold only part of a UTF-8 character (lone lead or continuation bytes)."""
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_decode_on_random_ids(
    tok: Tokenizer, partial_char_ids: list[int], data: st.DataObject, skip: bool
) -> None:
    token = st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(partial_char_ids),  # split characters and invalid byte runs
        st.integers(0, 16),  # special tokens between the bytes of a character
    )
    ids = data.draw(st.lists(token, max_size=30))
    assert "".join(stream(tok, ids, skip_special_tokens=skip)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(TEXT_WITH_SPECIALS.filter(lambda t: "\ufffd" not in t), st.booleans())
def test_stream_of_text_never_splits_a_character(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    pieces = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in piece for piece in pieces)


def test_stream_holds_back_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🙂")
    assert len(ids) > 1  # byte-level BPE splits the emoji's four bytes
    assert stream(tok, ids) == [""] * (len(ids) - 1) + ["🙂", ""]
    decoder = tok.incremental_decoder()
    decoder.push(ids[0])
    assert decoder.flush() == "\ufffd"  # an incomplete character at the end stays visible, as in decode


def test_stream_window_stays_small(tok: Tokenizer) -> None:
    decoder = tok.incremental_decoder()
    for i in tok.encode("word " * 500):
        decoder.push(i)
    assert len(decoder._window) <= 2  # pyright: ignore[reportPrivateUsage]


# ------------------------------------------------------------------------------------------------
# Chat templates

CONVERSATIONS = {
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    "default_system": [{"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a joke 🙂\nplease"},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_default_system_prompt(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_chat_template_variables_and_filters(tok: Tokenizer) -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}|{% for m in messages %}{% break %}{% endfor %}"
    messages = [{"role": "user", "content": "<a & 'b'>"}]
    rendered = dataclasses.replace(tok, chat_template=template).apply_chat_template(messages)
    assert rendered == '<|im_start|>|<|im_end|>|[{"role": "user", "content": "<a & \'b\'>"}]|'


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}{{ m.content }}", "syntax error at line 1"),
        ("{{ raise_exception('only user and assistant roles are supported') }}", "only user and assistant roles"),
        ("{{ messages[0]['content'] + 1 }}", "failed to render"),
        ("{{ messages.append({}) }}", "failed to render"),  # the sandbox is immutable
        (None, "no chat template"),
    ],
)
def test_chat_template_errors(tok: Tokenizer, template: str | None, match: str) -> None:
    with pytest.raises(TemplateError, match=match):
        dataclasses.replace(tok, chat_template=template).apply_chat_template([{"role": "user", "content": "x"}])


# ------------------------------------------------------------------------------------------------
# Hugging Face directories


def write_hf_dir(path: Path, tok: Tokenizer, config: dict[str, Any] | None) -> Path:
    path.mkdir(exist_ok=True)
    (path / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def test_from_hf_dir(tok: Tokenizer, tmp_path: Path) -> None:
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "add_bos_token": False,
        "chat_template": tok.chat_template,
    }
    loaded = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, tok, config))
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_ids, loaded.add_bos) == (49152, 1, (2,), False)
    for text in [*REFERENCE_TEXTS, "a  2", "Call 555 1234\n2024"]:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    messages = CONVERSATIONS["multi_turn"]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)

    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template(messages) == "Be kind."


def test_from_hf_dir_named_templates_and_bos_from_post_processor(tok: Tokenizer, tmp_path: Path) -> None:
    backend = Backend.from_str(tok.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    (tmp_path / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>"}), encoding="utf-8")
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.add_bos is True and loaded.eos_ids == ()
    assert loaded.encode("hi") == [1, *tok.encode("hi")]
    assert loaded.apply_chat_template([]) == "D"

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}), encoding="utf-8")
    assert Tokenizer.from_hf_dir(tmp_path).encode("hi") == tok.encode("hi")


def test_from_hf_dir_errors(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Tokenizer.from_hf_dir(tmp_path / "nowhere")
    with pytest.raises(ModelNotFoundError, match="tokenizer.json is missing"):
        Tokenizer.from_hf_dir(tmp_path)

    good = tok.backend.to_str()
    (tmp_path / "tokenizer.json").write_text(good[: len(good) // 2], encoding="utf-8")
    with pytest.raises(CheckpointError, match="tokenizer.json is not a valid tokenizers file"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": 3}', encoding="utf-8")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)

    (tmp_path / "tokenizer.json").write_text(good, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text("{oops", encoding="utf-8")
    with pytest.raises(CheckpointError, match="tokenizer_config.json is not readable JSON"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</nope>"}), encoding="utf-8")
    with pytest.raises(CheckpointError, match="eos_token '</nope>'"):
        Tokenizer.from_hf_dir(tmp_path)


# ------------------------------------------------------------------------------------------------
# Other GGUF tokenizers, on small synthetic files

BYTE_TOKENS = sorted(ByteLevel.alphabet())


def write_gguf(path: Path, *, model: str | None = "gpt2", pre: str | None = "gpt2", **extra: Any) -> gguf.GGUFReader:
    tokens = [*BYTE_TOKENS, "ab", "<s>", "</s>", "<eot>", "my word"]
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.USER_DEFINED]
    writer = gguf.GGUFWriter(path, "llama")
    if model is not None:
        writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(extra.pop("tokens", tokens))
    writer.add_token_types(types)
    writer.add_token_merges(extra.pop("merges", ["a b"]))
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_eot_token_id(259)
    writer.add_add_bos_token(extra.pop("add_bos", True))
    assert not extra
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt2", ["x", "Ġ12345", "Ġab"]),
        ("default", ["x", "Ġ12345", "Ġab"]),
        ("smollm", ["x", "Ġ", "1", "2", "3", "4", "5", "Ġab"]),
        ("llama-bpe", ["x", "Ġ", "123", "45", "Ġab"]),
        ("qwen2", ["x", "Ġ", "1", "2", "3", "4", "5", "Ġab"]),
    ],
)
def test_gguf_pre_tokenizers(tmp_path: Path, pre: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", pre=pre))
    assert tok.backend.pre_tokenizer is not None
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 12345 ab")] == pieces
    text = "x 12345 ab<s>my word</s>"
    assert tok.decode(tok.encode(text)) == "<s>" + text  # add_bos
    assert "".join(stream(tok, tok.encode(text))) == "<s>" + text


def test_gguf_special_tokens(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf"))
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (257, (258, 259), True)
    ids = tok.encode("ab<eot>my word", add_special_tokens=False)
    assert ids == [256, 259, 260]  # control and user-defined tokens are matched whole
    assert tok.decode(ids, skip_special_tokens=True) == "abmy word"  # only control tokens are skipped


def test_gguf_qwen2_normalizes_to_nfc(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", pre="qwen2"))
    assert tok.decode(tok.encode("e\u0301", add_special_tokens=False)) == "\u00e9"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pre": "mystery"}, UnsupportedModelError, "pre-tokenizer 'mystery' is not supported; zgen supports:.*smollm"),
        ({"model": "llama"}, UnsupportedModelError, "tokenizer model 'llama' is not supported; zgen supports: gpt2"),
        ({"model": None}, CheckpointError, "carries no tokenizer"),
        ({"merges": ["a c d"]}, CheckpointError, "vocabulary and merges disagree"),
        ({"merges": ["abc"]}, CheckpointError, "not a space-separated pair"),
    ],
)
def test_gguf_errors(tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", **kwargs))


def test_gguf_missing_pre_means_default(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", pre=None))
    assert tok.backend.pre_tokenizer is not None
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 12")] == ["x", "Ġ12"]
