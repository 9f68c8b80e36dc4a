"""Prefix caching: prefill a long system prompt once, save it, and open it for every new question.

The second and later questions feed only their own tokens: the system prompt's K/V come from the
snapshot (which also survives a restart of the process).
"""

from __future__ import annotations

from dataclasses import dataclass

from zgen import Model, load_model
from zgen.engine import Context, Sampler, stop

SYSTEM = (
    "You are the help desk of the Riverside public library. Opening hours: Monday to Friday 9:00-20:00, "
    "Saturday 10:00-16:00, closed on Sunday. Members may borrow up to 12 items for three weeks and renew "
    "them twice online. Late returns cost 20 cents per item per day. The reading room on the second floor "
    "is silent; group study rooms can be booked at the front desk for two hours at a time. Answer briefly."
)
QUESTIONS = ("When are you open on Saturday?", "How many books can I borrow?")


@dataclass
class PrefixCachingResult:
    answers: list[str]
    system_tokens: int
    fed_per_question: list[int]  # prompt tokens each question had to feed after opening the snapshot


def main(model: Model | None = None) -> PrefixCachingResult:
    model = model or load_model("smollm2")
    engine = model.engine
    system = engine.create_context()
    system.fill_system(SYSTEM)
    system.flush()
    system.save("library-help-desk")
    system.release()

    answers, fed = [], []
    for question in QUESTIONS:
        ctx = Context.open(model, "library-help-desk")
        before = engine.stats.prefill_tokens
        ctx.fill_user(question)
        answers.append(ctx.generate(Sampler.greedy(), stop.max_len(32) | stop.ends_with_any(model.eos_token_ids)))
        fed.append(engine.stats.prefill_tokens - before)
        ctx.release()
        print(f"Q: {question}\nA: {answers[-1].strip()}\n   (fed {fed[-1]} prompt tokens; the system prompt was not re-fed)")
    return PrefixCachingResult(answers, system.num_tokens, fed)


if __name__ == "__main__":
    main()
