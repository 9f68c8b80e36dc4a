"""Prefix caching: a second request sharing a long system prompt skips that prompt's prefill.

Cold: the first request (empty prefix cache). Warm: a second request with the same system prompt and
another question. Reports prompt tokens, tokens taken from the cache, tokens actually prefilled and
time to first token (the prefill call), with the same paged cache with and without the prefix cache.

    python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import json
import platform

from zgen import Generator, SamplingConfig, load_model
from zgen.cache.factory import paged_kv, prefix_cache

SYSTEM = " ".join(
    f"Policy {i}: the assistant answers questions about the city's tram network, quotes timetables "
    f"exactly, and says so plainly when line {i} is closed for repairs."
    for i in range(1, 40)
)
QUESTIONS = ["When does the first tram leave the depot?", "Is line 7 running on Sundays?"]


def main() -> None:
    model = load_model("smollm2")
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=1)
    rows = []
    for label, options in (("paged", (paged_kv(512),)), ("paged + prefix cache", (paged_kv(512), prefix_cache(4096)))):
        gen = Generator(model, *options)
        # Compile every shape once, outside the timings, with another system prompt of the same
        # power-of-two length bucket (so the timed calls reuse the executables).
        for question in QUESTIONS:
            gen.generate([{"role": "system", "content": SYSTEM.replace("tram", "ferry")}, {"role": "user", "content": question}], sampling)
        for turn, question in zip(("cold", "warm"), QUESTIONS, strict=True):
            result = gen.generate([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], sampling)
            usage = result.usage
            rows.append({
                "cache": label, "request": turn, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_prompt_tokens,
                "prefilled_tokens": usage.prompt_tokens - usage.cached_prompt_tokens,
                "ttft_ms": 1e3 * result.timings.prefill_s,
            })
            print(json.dumps(rows[-1]), flush=True)
    print(f"device: CPU ({platform.machine()})")


if __name__ == "__main__":
    main()
