"""GGUF checkpoints (llama.cpp's format), read and dequantized with the `gguf` package."""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from zgen.config import ModelConfig
from zgen.errors import CheckpointError, ConfigError, UnsupportedModelError
from zgen.loading.gguf_quantized import DIRECT_TYPES, Codes, fuse, read_codes
from zgen.loading.params import HostParams, assemble, check_layer_count, check_values, layer_tensor_name, stack_rows

# GGUF architecture name → zgen architecture. llama.cpp files Mistral under "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "o",
    "ffn_norm.weight": "post_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
# zgen's unfused names of the matmul weights a quantized load keeps in their GGUF blocks.
_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_GLOBAL_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}


# Bytes of one GGUF metadata scalar, by value type; strings and arrays carry their lengths.
_SCALAR_BYTES = {
    gguf.GGUFValueType.UINT8: 1, gguf.GGUFValueType.INT8: 1, gguf.GGUFValueType.BOOL: 1,
    gguf.GGUFValueType.UINT16: 2, gguf.GGUFValueType.INT16: 2,
    gguf.GGUFValueType.UINT32: 4, gguf.GGUFValueType.INT32: 4, gguf.GGUFValueType.FLOAT32: 4,
    gguf.GGUFValueType.UINT64: 8, gguf.GGUFValueType.INT64: 8, gguf.GGUFValueType.FLOAT64: 8,
}
_LENGTH_BYTES = 8  # a string's length, an array's count: the least any string or array element takes


def header_extent(path: Path) -> int | None:
    """Walk the lengths and counts of a GGUF file's header -- its metadata and its tensor index, not
    their values -- refusing, as a ``CheckpointError``, any that run past the end of the file, and
    return where the tensor data starts (the offset gguf's reader computes); None for files gguf
    refuses by their header (magic, version), which are left to it.

    gguf's reader trusts an array's count: with a corrupt one (found by
    ``property_tests/test_input_fuzz.py``) it loops over up to 2**64 elements, reading nothing past
    the end of the file, and never returns.
    """
    if path.stat().st_size < 24:
        return None
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            return None
        order = "<" if int.from_bytes(data[4:8], "little") & 0xFFFF else ">"  # gguf's own byte-order test
        if struct.unpack_from(order + "I", data, 4)[0] not in (2, 3):
            return None
        return _walk_header(path, data, order)


def _walk_header(path: Path, data: mmap.mmap, order: str) -> int:
    position = 8  # after the magic and the version

    def fits(count: int, size: int, what: str) -> None:
        if count * size > len(data) - position:
            raise CheckpointError(
                f"{path}: GGUF header {what} claims {count} x {size} bytes at byte {position}, past the end of the "
                f"file ({len(data)} bytes); the file is corrupt or truncated: download or copy it again"
            )

    def take(count: int, size: int, what: str) -> int:
        nonlocal position
        fits(count, size, what)
        start, position = position, position + count * size
        return start

    def number(fmt: str, what: str) -> int:
        return struct.unpack_from(order + fmt, data, take(1, struct.calcsize(fmt), what))[0]

    def value(kind: int, what: str) -> None:
        if kind in _SCALAR_BYTES:
            take(1, _SCALAR_BYTES[gguf.GGUFValueType(kind)], what)
        elif kind == gguf.GGUFValueType.STRING:
            take(number("Q", what), 1, what)
        elif kind == gguf.GGUFValueType.ARRAY:
            item, count = number("I", what), number("Q", what)
            if item in _SCALAR_BYTES:
                take(count, _SCALAR_BYTES[gguf.GGUFValueType(item)], what)
                return
            fits(count, _LENGTH_BYTES, what)  # bound the walk before walking it
            for _ in range(count):
                value(item, what)
        else:
            raise CheckpointError(f"{path}: GGUF metadata {what} has unknown value type {kind}; the file is corrupt")

    tensors, fields = number("Q", "tensor count"), number("Q", "field count")
    fits(fields, _LENGTH_BYTES + 4, "field count")  # a key's length and a value type, at least
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for index in range(fields):
        length = number("Q", f"field {index}")
        start = take(length, 1, f"field {index}")
        key = data[start : start + length].decode("utf-8", "replace")
        kind = number("I", f"field {index} ({key})")
        if key == gguf.Keys.General.ALIGNMENT and kind == gguf.GGUFValueType.UINT32:
            alignment = number("I", f"field {index} ({key})")
        else:
            value(kind, f"field {index} ({key})")
    fits(tensors, _LENGTH_BYTES + 4 + 4 + 8, "tensor count")  # a name's length, dims, type, offset at least
    for index in range(tensors):
        take(number("Q", f"tensor {index}"), 1, f"tensor {index} name")
        take(number("I", f"tensor {index}"), 8, f"tensor {index} shape")
        take(1, 4 + 8, f"tensor {index} type and offset")
    return position + (-position % alignment if alignment > 0 else 0)


def open_gguf(path: Path) -> gguf.GGUFReader:
    header_extent(path)
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # the reader raises bare ValueError/IndexError on truncated files
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); it may be truncated or "
            "corrupt: download or copy it again"
        ) from err


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The metadata value under ``key`` (``default`` if absent); a string that is not UTF-8 is a
    ``CheckpointError`` (gguf decodes strings only when they are asked for)."""
    field = reader.fields.get(key)
    try:
        return default if field is None else field.contents()
    except UnicodeDecodeError as err:
        raise CheckpointError(f"GGUF metadata {key!r} holds a string that is not UTF-8 ({err.reason}); the file is corrupt") from err


def config_from_gguf(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    """The model config the GGUF metadata describes, checked against the file's tensor index (its layer
    count) before anything is read or built."""
    arch_name = _field(reader, "general.architecture", "")
    architecture = GGUF_ARCHITECTURES.get(arch_name) if isinstance(arch_name, str) else None
    if architecture is None:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch_name!r} is not supported; zgen reads {sorted(GGUF_ARCHITECTURES)}"
        )

    def number(key: str, kind: type[int] | type[float], default: float | None = None) -> Any:
        value = _field(reader, key, default)
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise CheckpointError(f"{path}: GGUF metadata {key} should be {'an integer' if kind is int else 'a number'}, found {value!r}; the file is corrupt")
        return value

    def key(name: str, kind: type[int] | type[float], default: float | None = None) -> Any:
        return number(f"{arch_name}.{name}", kind, default)

    heads = key("attention.head_count", int)
    hidden = key("embedding_length", int)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size", int, len(tokens.data) if tokens is not None else 0)
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    window = _field(reader, f"{arch_name}.attention.sliding_window")
    try:
        config = ModelConfig(
            architecture=architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length", int),
            num_layers=key("block_count", int),
            num_heads=heads,
            num_kv_heads=key("attention.head_count_kv", int, heads),
            head_dim=key("attention.key_length", int, hidden // heads if heads > 0 else 0),
            max_position_embeddings=key("context_length", int),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", float, 1e-5)),
            rope_theta=float(key("rope.freq_base", float, 10000.0)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            sliding_window=window or None,
            bos_token_id=bos,
            eos_token_ids=() if eos is None else (eos,),
        )
    except ConfigError as err:
        raise CheckpointError(f"{path}: the GGUF metadata describes an invalid model: {err}") from None
    check_layer_count(config, [n for t in reader.tensors if (n := _zgen_name(t.name)) is not None], str(path))
    return config


def _zgen_name(gguf_name: str) -> str | None:
    if gguf_name.startswith("blk."):
        index, _, rest = gguf_name[len("blk.") :].partition(".")
        return layer_tensor_name(index, _LAYER_TENSORS.get(rest))
    return _GLOBAL_TENSORS.get(gguf_name)


def _unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs → HF's rotate-half halves)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def params_from_gguf(reader: gguf.GGUFReader, config: ModelConfig, path: Path, *, keep_quantized: bool = False) -> HostParams:
    """Dequantize every tensor to float32 and assemble zgen's parameter layout. With ``keep_quantized``
    the projections' Q8_0/Q4_0/Q4_1/Q4_K blocks are repacked into
    :class:`~zgen.quantized_weights.QuantizedWeight` values instead (embeddings and norms still
    dequantized): an :class:`UnsupportedModelError` names a projection stored in another type."""
    tensors: dict[str, np.ndarray | Codes] = {}
    for tensor in reader.tensors:
        name = _zgen_name(tensor.name)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        shape = tuple(reversed([int(n) for n in tensor.shape]))
        if keep_quantized and name.rsplit(".", 1)[-1] in _PROJECTIONS:
            type_name = tensor.tensor_type.name
            if type_name not in DIRECT_TYPES or len(shape) != 2:
                raise UnsupportedModelError(
                    f"{path}: tensor {tensor.name} is stored as {type_name}; weights='gguf' computes directly on "
                    f"{', '.join(DIRECT_TYPES)} only: load it with weights=None (dequantized) or 'int8'/'int4' (re-quantized)"
                )
            try:
                codes = read_codes(np.asarray(tensor.data), type_name, (shape[0], shape[1]))
            except ValueError as err:
                raise CheckpointError(f"{path}: tensor {tensor.name} is unreadable ({err}); the file may be truncated") from err
            for part in (codes.scales, codes.offsets):
                if part is not None:
                    check_values(part.astype(np.float32), f"{path}: tensor {tensor.name}")
            tensors[name] = codes
            continue
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as err:
            raise UnsupportedModelError(
                f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the installed "
                f"gguf package cannot dequantize ({err}); upgrade it with: pip install -U gguf"
            ) from err
        except Exception as err:
            raise CheckpointError(f"{path}: tensor {tensor.name} is unreadable ({err}); the file may be truncated") from err
        if values.size != math.prod(shape):
            raise CheckpointError(
                f"{path}: tensor {tensor.name} holds {values.size} values but its header says shape {shape}; the file is corrupt"
            )
        array = np.asarray(values, dtype=np.float32).reshape(shape)
        check_values(array, f"{path}: tensor {tensor.name}")  # before the conversion is cached
        tensors[name] = array
    # llama.cpp permutes Q/K rows only for its "llama" family converter; qwen files keep HF's layout.
    if str(_field(reader, "general.architecture")) == "llama":
        for name, value in list(tensors.items()):
            heads = config.num_heads if name.endswith((".q", ".q_bias")) else config.num_kv_heads
            if name.endswith((".q", ".q_bias", ".k", ".k_bias")):
                if isinstance(value, Codes):
                    tensors[name] = value.map_rows(lambda rows, heads=heads: _unpermute_rows(rows, heads))
                else:
                    tensors[name] = _unpermute_rows(value, heads)
    return assemble(config, tensors.get, str(path), fuse if keep_quantized else stack_rows)
