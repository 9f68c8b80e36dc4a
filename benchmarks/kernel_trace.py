"""Where a decode step's device time goes, kernel by kernel (``jax.profiler``).

``decode_step_kernels(generate, new_tokens)`` traces ``generate(new_tokens)`` and ``generate(1)`` and
takes the second from the first, so what is left is the ``new_tokens - 1`` decode steps: per kernel
(an XLA fusion, a Pallas kernel, a library GEMM) its launches and its time per step, from the GPU's
stream events. (On a CPU the profile's host events mix XLA's operations with the runtime's own, and
one generation's differ from the next by more than a step; it is not offered there.)
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import tempfile
from collections.abc import Callable
from typing import Any

def _kernel_times(run: Callable[[], Any]) -> collections.Counter[str]:
    """Microseconds per GPU kernel name over one call of ``run``, and ``#name`` launch counts."""
    import jax

    with tempfile.TemporaryDirectory() as out:
        jax.profiler.start_trace(out)
        run()
        jax.profiler.stop_trace()
        trace = json.load(gzip.open(glob.glob(out + "/**/*.trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    totals: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("ph") != "X":  # complete events only (metadata and counters may lack a pid or tid)
            continue
        if "/device:GPU" not in processes.get(e.get("pid"), "") or "Stream" not in threads.get((e.get("pid"), e.get("tid")), ""):
            continue
        totals[e["name"]] += e["dur"]
        totals["#" + e["name"]] += 1
    return totals


def decode_step_kernels(generate: Callable[[int], Any], new_tokens: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` kernels by time per decode step: name, launches per step, µs per step."""
    from zgen.pallas.common import platform

    if platform() != "gpu":
        raise SystemExit("kernel traces read a GPU's stream events; run this on a GPU")
    full = _kernel_times(lambda: generate(new_tokens))
    full.subtract(_kernel_times(lambda: generate(1)))
    steps = new_tokens - 1
    rows = [
        {"kernel": name, "per_step": full["#" + name] / steps, "us_per_step": us / steps}
        for name, us in full.items()
        if not name.startswith("#") and us > 0
    ]
    rows.sort(key=lambda row: -row["us_per_step"])
    return rows[:top]
