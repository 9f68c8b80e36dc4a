from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf_reference import save_random_checkpoint, small_configs
from zgen import Engine, EngineConfig
from zgen.cache.factory import paged_kv
from zgen.model import load_model


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A two-layer random Llama (saved by transformers) on a pool of 8 pages of 16 tokens."""
    directory: Path = tmp_path_factory.mktemp("tiny_llama")
    save_random_checkpoint(small_configs()["llama_tied"], directory)
    model = load_model(directory, dtype="float32")
    page_mb = 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim * 4 * 16 / 2**20
    return Engine(model, paged_kv(8 * page_mb), config=EngineConfig(steps_per_sync=4))
