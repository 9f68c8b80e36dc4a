"""Prefix caching: prefill a long system prompt once, save it, and open it for every new question.

The second and later questions feed only their own tokens: the system prompt's K/V come from the
snapshot. Snapshots live in ``$ZGEN_STORE_DIR`` (default ``~/.cache/zgen/contexts``), where they
survive a restart of the process; this example saves into a temporary store it deletes at the end.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from zgen import Context, Model, Sampler, load_model, stop

SYSTEM = (
    "You are the help desk of the Riverside public library. Opening hours: Monday to Friday 9:00-20:00, "
    "Saturday 10:00-16:00, closed on Sunday. Members may borrow up to 12 items for three weeks and renew "
    "them twice online. Late returns cost 20 cents per item per day. The reading room on the second floor "
    "is silent; group study rooms can be booked at the front desk for two hours at a time. Answer briefly."
)
QUESTIONS = ("When are you open on Saturday?", "How many books can I borrow?")
SNAPSHOT = "library-help-desk"


@dataclass
class PrefixCachingResult:
    answers: list[str]
    system_tokens: int
    fed_per_question: list[int]  # prompt tokens each question had to feed after opening the snapshot


@contextmanager
def temporary_store() -> Iterator[str]:
    """Point ``ZGEN_STORE_DIR`` at a new temporary directory; delete it and restore the variable after."""
    previous = os.environ.get("ZGEN_STORE_DIR")
    with tempfile.TemporaryDirectory(prefix="zgen-store-") as store:
        os.environ["ZGEN_STORE_DIR"] = store
        try:
            yield store
        finally:
            if previous is None:
                del os.environ["ZGEN_STORE_DIR"]
            else:
                os.environ["ZGEN_STORE_DIR"] = previous


def main(model: Model | None = None) -> PrefixCachingResult:
    model = model or load_model("smollm2")
    with temporary_store():
        system = Context(model)
        system.fill_system(SYSTEM)
        system.flush()
        system.save(SNAPSHOT)
        system.release()

        engine = system.engine
        answers, fed = [], []
        for question in QUESTIONS:
            with Context.open(model, SNAPSHOT) as ctx:
                before = engine.stats.prefill_tokens
                ctx.fill_user(question)
                answers.append(ctx.generate(Sampler.greedy(), stop.max_len(32) | stop.ends_with_any(model.eos_token_ids)))
                fed.append(engine.stats.prefill_tokens - before)
            print(f"Q: {question}\nA: {answers[-1].strip()}\n   (fed {fed[-1]} prompt tokens; the system prompt was not re-fed)")
    return PrefixCachingResult(answers, system.num_tokens, fed)


if __name__ == "__main__":
    main()
