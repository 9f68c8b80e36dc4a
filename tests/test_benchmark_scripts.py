"""The scripts in benchmarks/ start: none is named like a module installed beside zgen, and each imports
(the helpers it takes from the others exist). A script's own folder comes first on ``sys.path``, so a
script named like a module hides that module from everything the script imports (transformers 5
imports ``kernels``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# Run in a fresh interpreter from an empty folder: this process has tests/ on its path.
CHECK = """
import importlib, importlib.util, json, sys
folder, names = sys.argv[1], sys.argv[2:]
hidden = [name for name in names if importlib.util.find_spec(name) is not None]
sys.path.insert(0, folder)
for name in names:
    importlib.import_module(name)
print(json.dumps(hidden))
"""


def test_every_script_imports_and_hides_no_module(tmp_path: Path) -> None:
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert scripts, f"no scripts found in {BENCHMARKS}"
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(BENCHMARKS), *scripts], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hidden = json.loads(done.stdout.strip().splitlines()[-1])
    assert hidden == [], f"benchmarks/ scripts named like installed modules (rename them): {hidden}"
