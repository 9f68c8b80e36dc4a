"""EngineConfig.refill_rows (queued requests wait for that many free rows and prefill together) and
prefill_apart (decoding rows sit out prefill steps): the tokens are the same either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_reference import save_random_checkpoint, small_configs
from zgen import Generator, Request, SamplingConfig, load_model
from zgen.cache.factory import paged_kv
from zgen.errors import ConfigError
from zgen.runtime.engine import EngineConfig


def test_grouped_refills_give_the_same_tokens_in_fewer_steps(tmp_path: Path) -> None:
    save_random_checkpoint(small_configs()["llama"], tmp_path)
    model = load_model(tmp_path)
    requests = [
        Request(list(range(5 + i, 9 + 2 * i)), SamplingConfig(temperature=0.0, max_new_tokens=3 + 4 * (i % 3), ignore_eos=True))
        for i in range(10)
    ]
    outputs, steps = [], []
    for refill in (1, 4):
        generator = Generator(model, max_batch_size=4, refill_rows=refill)
        outputs.append([r.token_ids for r in generator.batch_generate(requests)])
        steps.append(generator.engine.stats.steps)
    assert outputs[0] == outputs[1]
    assert steps[1] < steps[0]
    rows = []
    for apart in (False, True):  # decoding rows sit out the prefill steps of a paged cache
        paged = Generator(model, paged_kv(max_memory_mb=4), max_batch_size=4, refill_rows=2, prefill_apart=apart)
        assert [r.token_ids for r in paged.batch_generate(requests)] == outputs[0]
        rows.append(paged.engine.stats.rows)
    assert rows[1] < rows[0]


def test_refill_rows_is_checked() -> None:
    with pytest.raises(ConfigError, match="refill_rows"):
        EngineConfig(refill_rows=0)
