"""Output validation with the next-token distribution: answer only with an allowed option.

Instead of sampling free text and parsing it, read ``decode_step_dist``, pick the option whose first
token is the most probable, and fill that option into the context as the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from zgen import Context, Model, load_model


@dataclass
class ValidationResult:
    answer: str
    probabilities: dict[str, float]  # probability of each option's first token


def main(model: Model | None = None) -> ValidationResult:
    model = model or load_model("smollm2")
    tokenizer = model.tokenizer
    options = ["Paris", "London", "Rome", "Madrid"]
    ctx = Context(model)
    ctx.fill_user(f"What is the capital of France? Answer with one of: {', '.join(options)}.")
    dist = ctx.decode_step_dist()
    prob_of = dict(zip(dist.ids.tolist(), dist.probs.tolist()))
    first = {o: tokenizer.encode(o, add_special_tokens=False)[0] for o in options}
    probabilities = {o: prob_of[t] for o, t in first.items()}
    answer = max(options, key=lambda o: probabilities[o])
    ctx.fill_tokens(tokenizer.encode(answer, add_special_tokens=False))
    print(f"allowed {options}: {probabilities} -> {answer}")
    return ValidationResult(answer, probabilities)


if __name__ == "__main__":
    main()
