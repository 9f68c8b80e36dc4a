"""Loading (converted-weight cache, dtypes) and what a compiled plan reports about itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from zgen import Generator, SamplingConfig, load_model
from zgen.model import Model


def test_second_load_reads_the_converted_cache(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    first = load_model(smollm2_gguf_path, cache_dir=tmp_path)
    second = load_model(smollm2_gguf_path, cache_dir=tmp_path)
    assert first.load_timings.source == "gguf"
    assert second.load_timings.source == "converted-cache"
    assert not list(tmp_path.rglob("*.partial-*"))
    for name, value in first.params.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(second.params[name]))


def test_damaged_converted_cache_is_rebuilt(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    load_model(smollm2_gguf_path, cache_dir=tmp_path)
    (cached,) = tmp_path.rglob("*.safetensors")
    cached.write_bytes(b"garbage")
    again = load_model(smollm2_gguf_path, cache_dir=tmp_path)
    assert again.load_timings.source == "gguf"
    assert cached.stat().st_size > 1000


def test_half_precision_dtypes_track_float32(smollm2: Model, small_chat_checkpoint: tuple[Path, Any]) -> None:
    ids = Generator(smollm2).encode_prompt("The quick brown fox jumps over the lazy dog because")
    reference = Generator(smollm2).logits(ids)
    for dtype in ("bfloat16", "float16"):
        model = load_model("smollm2", dtype=dtype)
        assert all(v.dtype == model.dtype for v in model.params.values())
        logits = Generator(model).logits(ids)
        agreement = np.mean(logits.argmax(-1) == reference.argmax(-1))
        assert agreement >= 0.8, (dtype, agreement)
    # The GPU default also decodes: a two-layer model's bf16 decode loop compiles in a fraction of the real one's.
    small = load_model(small_chat_checkpoint[0], dtype="bfloat16")
    result = Generator(small).generate(ids, SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    assert len(result.token_ids) == 8 and result.text


def test_runner_reports_cost_and_memory(smollm2: Model) -> None:
    from zgen.runtime.runner import runner_for

    Generator(smollm2).generate("Hi", SamplingConfig(temperature=0.0, max_new_tokens=2, ignore_eos=True))
    report = runner_for(smollm2).analysis()
    prefill = [v for k, v in report.items() if "mixed" in k]
    decode = [v for k, v in report.items() if "decode" in k]
    assert prefill and decode
    assert all(r["flops"] > 0 and r["argument_bytes"] for r in prefill)
