"""HF transformers on CPU as the independent reference: random small checkpoints and greedy runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer as RawTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def small_configs() -> dict[str, Any]:
    """One random-weight config per supported architecture, exercising its distinctive switches."""
    return {
        "llama": transformers.LlamaConfig(
            **SMALL,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        ),
        "llama_tied": transformers.LlamaConfig(**SMALL, tie_word_embeddings=True),
        "mistral": transformers.MistralConfig(**SMALL, sliding_window=8, tie_word_embeddings=False),
        "qwen2": transformers.Qwen2Config(**SMALL, tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True),
    }


def save_random_checkpoint(config: Any, directory: Path, seed: int = 0) -> Any:
    """Build a random model with transformers, save it as safetensors plus a word-level tokenizer."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # make biases and norm weights non-trivial so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model = model.float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    raw = RawTokenizer(WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = WhitespaceSplit()  # type: ignore[assignment]
    raw.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w1", "eos_token": "w2"}))
    return model


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model: Any, ids: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], list[float]]:
    """Greedy continuation and each chosen token's log-prob under the raw distribution."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, len(ids) :].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[tok]) for step, tok in zip(out.logits, new, strict=True)]
    return new, logprobs


def hf_teacher_forced(model: Any, prompt: list[int], continuation: list[int]) -> tuple[list[int], list[float]]:
    """HF's greedy choice after every prefix of ``continuation``, and the log-prob of each given token.

    If the greedy choices equal ``continuation``, HF's own greedy generation would produce exactly
    those tokens (each step sees the same prefix), so one forward pass checks a whole generation.
    """
    ids = prompt + continuation
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1 : len(ids) - 1].float()
    logprobs = torch.log_softmax(logits, -1)
    chosen = torch.tensor(continuation)
    return logits.argmax(-1).tolist(), logprobs[torch.arange(len(continuation)), chosen].tolist()
