"""SmolLM2-135M-Instruct (the real GGUF) against HF transformers on CPU, float32."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.hf_reference import hf_greedy, hf_logits, hf_teacher_forced
from zgen import Generator, SamplingConfig
from zgen.model import Model

LONG_PROMPT = " ".join(
    f"Chapter {i}: the river town kept its records in a ledger of {i * 7} pages, and every spring the "
    f"keeper, a patient woman named Ada, copied the names of the boats, the weight of their cargo and "
    f"the weather of each morning into a fresh volume before the floods."
    for i in range(1, 14)
)
PROMPTS: dict[str, Any] = {
    "digits": "Order 66 shipped 1200 units on 2024-03-15, and 3 more arrived at 9 am. Total: ",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "chat": [{"role": "user", "content": "Name three primary colors."}],
    "long": LONG_PROMPT + "\nSummary of the ledger:",
    "non_english": "La ville de Paris est la capitale de la France. Elle est connue pour",
    "cjk": "北京是中国的首都，它有",
}


@pytest.fixture(scope="module")
def model(smollm2: Model) -> Model:
    return smollm2


@pytest.fixture(scope="module")
def hf_model(hf_smollm2: Any) -> Any:
    return hf_smollm2


def test_long_prompt_is_long(model: Model) -> None:
    assert len(model.tokenizer.encode(PROMPTS["long"])) >= 600


def test_prefill_logits_match_hf(model: Model, hf_model: Any) -> None:
    gen = Generator(model)
    ids = gen.encode_prompt(PROMPTS["digits"])
    ours = gen.logits(ids)
    ref = hf_logits(hf_model, ids)
    assert np.abs(ours - ref).max() < 5e-4


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_hf(model: Model, hf_model: Any, name: str) -> None:
    gen = Generator(model)
    prompt = PROMPTS[name]
    ids = gen.encode_prompt(prompt)
    result = gen.generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=64))
    assert result.prompt_token_ids == ids
    assert result.text  # it must also decode to text
    ref_tokens, ref_logprobs = hf_teacher_forced(hf_model, ids, result.token_ids)
    assert ref_tokens == result.token_ids
    np.testing.assert_allclose(result.logprobs, ref_logprobs, atol=1e-3)
    if result.finish_reason == "length":
        assert len(result.token_ids) == 64
    else:  # stopped at EOS: HF's greedy choice there is EOS too, checked above
        assert result.token_ids[-1] in model.eos_token_ids


def test_greedy_matches_hf_generate(model: Model, hf_model: Any) -> None:
    """One prompt through HF's own generate() loop as well, end to end."""
    gen = Generator(model)
    ids = gen.encode_prompt(PROMPTS["chat"])
    result = gen.generate(PROMPTS["chat"], SamplingConfig(temperature=0.0, max_new_tokens=64))
    ref_tokens, ref_logprobs = hf_greedy(hf_model, ids, 64, list(model.eos_token_ids))
    assert result.token_ids == ref_tokens
    np.testing.assert_allclose(result.logprobs, ref_logprobs, atol=1e-3)
