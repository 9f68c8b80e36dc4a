"""A tiny random Llama written as a GGUF file (float32 tensors, a byte-level BPE vocabulary): loader
tests that need a GGUF without the 98 MB SmolLM2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from tokenizers.pre_tokenizers import ByteLevel

VOCAB = [*sorted(ByteLevel.alphabet()), "ab", "<s>", "</s>"]  # 256 byte tokens, one merge, BOS, EOS
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 32, 48, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS

Metadata = Callable[[gguf.GGUFWriter], None]


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array in numpy's [out, in] order."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    tensors = {"token_embd.weight": mat(len(VOCAB), HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        tensors |= {
            f"blk.{i}.attn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.attn_q.weight": mat(HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": mat(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.ffn_gate.weight": mat(INTERMEDIATE, HIDDEN),
            f"blk.{i}.ffn_up.weight": mat(INTERMEDIATE, HIDDEN),
            f"blk.{i}.ffn_down.weight": mat(HIDDEN, INTERMEDIATE),
        }
    return tensors


def default_metadata(writer: gguf.GGUFWriter) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)


def write_tiny_gguf(
    path: Path, metadata: Metadata = default_metadata, tensors: dict[str, np.ndarray] | None = None
) -> Path:
    """Write the tiny model to ``path``; ``metadata`` adds the ``llama.*`` hyperparameters (replace it
    to write corrupt or missing ones), ``tensors`` replaces the weights."""
    writer = gguf.GGUFWriter(path, "llama")
    metadata(writer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(VOCAB)
    writer.add_token_types([gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    for name, value in (tiny_tensors() if tensors is None else tensors).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
