"""Best-of-N: sample N answers from forks of one prompt, keep the one the model finds most likely."""

from __future__ import annotations

from dataclasses import dataclass

from zgen import Context, GenerationResult, Model, Sampler, load_model, stop
from zgen.contexts import gather


@dataclass
class BestOfNResult:
    candidates: list[GenerationResult]
    best: GenerationResult


def mean_logprob(result: GenerationResult) -> float:
    return sum(result.logprobs) / max(len(result.logprobs), 1)


def main(model: Model | None = None, n: int = 4) -> BestOfNResult:
    model = model or load_model("smollm2")
    prompt = Context(model, seed=7)
    prompt.fill_user("Suggest a name for a small coffee shop. Reply with the name only.")
    limit = stop.max_len(16) | stop.ends_with_any(model.eos_token_ids)
    forks = [prompt.fork() for _ in range(n)]  # each fork samples with its own seed
    candidates = gather(*(f.generate_result_async(Sampler.top_p(0.9, 0.95), limit) for f in forks))
    best = max(candidates, key=mean_logprob)
    for c in candidates:
        print(f"{mean_logprob(c):7.3f}  {c.text.strip()!r}")
    print(f"best: {best.text.strip()!r}")
    return BestOfNResult(candidates, best)


if __name__ == "__main__":
    main()
