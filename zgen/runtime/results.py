"""What a generation returns, the same through every front end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V were already there (prefix cache, a context's KV)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    prefill_s: float  # from the first step that served the request to its first token
    decode_s: float  # from the first token to the last
    host_syncs: int  # compiled steps that served it


@dataclass(frozen=True)
class SpeculativeStats:
    """How speculation went for one request."""

    draft_tokens: int  # tokens the speculator proposed and the target checked
    accepted_tokens: int  # of those, the ones kept
    steps: int  # verification passes that checked a draft

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.accepted_tokens / self.steps if self.steps else 0.0

    def __add__(self, other: SpeculativeStats) -> SpeculativeStats:
        return SpeculativeStats(
            self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens, self.steps + other.steps
        )

    def as_dict(self) -> dict[str, float | int]:
        return {
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_per_step": self.mean_accepted_per_step,
        }


@dataclass(frozen=True)
class GenerationResult:
    """``token_ids`` include a matched stop sequence or stop token; ``text`` leaves the stop out."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    logprobs: list[float]  # log-softmax of each chosen token under the unmodified distribution
    finish_reason: FinishReason  # "stop" (a stop id, sequence or string) or "length"
    usage: TokenUsage
    timings: Timings
    speculative: SpeculativeStats | None = None  # with a speculator: what it drafted and the target kept
