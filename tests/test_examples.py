"""Every top-level example script runs to completion (the context examples and their claims:
tests/contexts/test_context_examples.py). Each takes the model its ``main`` is given: the quickstart the
two-layer chat model (SmolLM2's tokenizer and chat template, random weights; the real model's
generation is the command-line tests'), the custom KV format SmolLM2, whose 64-dim heads its groups of
32 need."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
MODEL = {"quickstart": "small_chat", "custom_kv_format": "smollm2"}


def test_every_example_is_run() -> None:
    assert sorted(MODEL) == sorted(p.stem for p in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(path))["main"](request.getfixturevalue(MODEL[path.stem]))
    assert capsys.readouterr().out.strip()
