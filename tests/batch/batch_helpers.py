"""A tiny random model with a chat template, random LoRA adapters for it, request lines, and the OpenAI
client's types for records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import peft
import pydantic
import torch
import transformers
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion

from hf_reference import save_random_checkpoint, small_configs

CHAT_TEMPLATE = "{% for m in messages %}w3 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}"


def save_tiny_chat_model(directory: Path) -> Path:
    """The tiny random Llama of the parity tests (vocabulary w0..w95), with a chat template."""
    save_random_checkpoint(small_configs()["llama_tied"], directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return directory


def save_random_adapter(base_dir: Path, out: Path, seed: int, **lora: Any) -> Path:
    """A PEFT LoRA adapter of the model in ``base_dir`` with random A and B (B nonzero), saved to ``out``."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora)).save_pretrained(out)
    return out


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def completion_line(custom_id: str, prompt: object, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": prompt, **body}})


def chat_line(custom_id: str, content: str, **body: Any) -> str:
    messages = [{"role": "user", "content": content}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny", "messages": messages, **body}})


class Response(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchOutputRecord(pydantic.BaseModel):
    """A line of an OpenAI Batch API output file."""

    model_config = pydantic.ConfigDict(extra="forbid")
    id: str
    custom_id: str | None
    response: Response | None
    error: BatchError | None


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every line of a results file, each checked against the OpenAI client's types."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = BatchOutputRecord.model_validate_json(line)
        assert (record.response is None) != (record.error is None)
        if record.response is not None:
            assert record.response.status_code == 200
            body = record.response.body
            kind = ChatCompletion if body["object"] == "chat.completion" else Completion
            kind.model_validate(body, strict=True)
        records.append(json.loads(line))
    return records


def by_id(records: list[dict[str, Any]]) -> dict[str | None, dict[str, Any]]:
    return {r["custom_id"]: r for r in records}
