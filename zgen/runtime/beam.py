"""Beam search on an engine's sequences: every beam is a sequence, and a beam that continues forks
its parent, sharing its KV pages copy-on-write (:meth:`~zgen.runtime.engine.Engine.fork`).

Each step submits one logits request per live beam, so the engine runs them as one batch, then
chooses on the host the way HF transformers' beam search does (``generate(num_beams=...,
do_sample=False)``), so both give the same beams and scores:

* the ``max(2, 1 + number of EOS ids) * num_beams`` best continuations of all beams by summed
  log-probability; those that end (an EOS id, or ``max_new_tokens`` reached) and rank among the first
  ``num_beams`` become finished hypotheses scored ``sum / generated_length ** length_penalty``; the
  ``num_beams`` best that do not end go on;
* ``num_beams`` finished hypotheses are kept, best first. The search stops when the best live beam
  can no longer beat the worst kept one (``early_stopping=False`` measures it at the current length,
  ``"never"`` at the longest possible one when ``length_penalty > 0``), when every slot is full and
  ``early_stopping=True``, or when every continuation ended.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Literal

import numpy as np

from zgen.errors import ConfigError
from zgen.lora.adapter import LoraAdapter
from zgen.runtime.engine import Engine, ForwardRequest
from zgen.runtime.results import FinishReason
from zgen.runtime.sequence import Sequence

EarlyStopping = bool | Literal["never"]
_MASKED = np.float32(-1.0e9)  # the score of a candidate that cannot be chosen (HF's value, kept for parity)


@dataclass(frozen=True)
class Beam:
    """One finished hypothesis: generated tokens (an ending EOS included), their text, and the score
    ``sum of log-probs / len(token_ids) ** length_penalty``."""

    token_ids: list[int]
    text: str
    score: float
    finish_reason: FinishReason


def check_beam_options(num_beams: int, max_new_tokens: int, length_penalty: float, early_stopping: EarlyStopping) -> None:
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ConfigError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or not np.isfinite(length_penalty):
        raise ConfigError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if early_stopping not in (True, False, "never"):
        raise ConfigError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")


def beam_search(
    engine: Engine,
    prompt: Seq[int],
    *,
    num_beams: int,
    max_new_tokens: int,
    eos_token_ids: Seq[int],
    length_penalty: float = 1.0,
    early_stopping: EarlyStopping = False,
    adapters: tuple[tuple[LoraAdapter, float], ...] = (),
) -> list[Beam]:
    """The ``num_beams`` best hypotheses after ``prompt``, best first (see the module docstring).
    ``engine`` must have a paged cache (beams fork)."""
    check_beam_options(num_beams, max_new_tokens, length_penalty, early_stopping)
    if not engine.kv.pages:
        raise ConfigError(f"beam search forks sequences and needs a paged cache; this engine uses {engine.kv.kind}")
    prompt = engine.check_ids(prompt)
    eos = set(eos_token_ids)
    keep = max(2, 1 + len(eos)) * num_beams
    first = np.arange(keep) < num_beams  # only these candidates may finish (the rest are spares)
    root = engine.new_sequence(prompt)
    live: list[Sequence] = [root] * num_beams  # before the first step every beam is the prompt
    live_tokens: list[list[int]] = [[] for _ in range(num_beams)]
    live_scores = np.full(num_beams, _MASKED, np.float32)
    live_scores[0] = 0.0  # the copies of the prompt must not all expand the same tokens
    done_tokens: list[list[int]] = [[] for _ in range(num_beams)]
    done_scores = np.full(num_beams, _MASKED, np.float32)
    done = np.zeros(num_beams, bool)
    improvable = True
    try:
        for step in range(max_new_tokens):
            logprobs = _next_logprobs(engine, live, adapters)
            total = (logprobs + live_scores[:, None]).reshape(-1)
            vocab = logprobs.shape[1]
            best = np.argsort(-total, kind="stable")[:keep]
            parents, tokens, scores = best // vocab, best % vocab, total[best]
            length = step + 1
            ends = np.array([t in eos for t in tokens.tolist()]) | (length >= max_new_tokens)

            # Finished hypotheses: the new ones that may finish, merged with those kept so far.
            finished = scores / np.float32(length**length_penalty)
            finished = finished + (done.all() and early_stopping is True) * _MASKED
            finished = finished + (not improvable) * _MASKED
            finished = finished + (~(ends & first)) * _MASKED
            candidates = [*done_tokens, *(live_tokens[p] + [t] for p, t in zip(parents.tolist(), tokens.tolist(), strict=True))]
            merged_scores = np.concatenate([done_scores, finished.astype(np.float32)])
            merged_done = np.concatenate([done, ends & first])
            chosen = np.argsort(-merged_scores, kind="stable")[:num_beams]
            done_tokens = [list(candidates[i]) for i in chosen]
            done_scores, done = merged_scores[chosen], merged_done[chosen]

            # Live beams: the best continuations that did not end, each forking its parent's pages.
            going = (scores + ends * _MASKED).astype(np.float32)
            nxt = np.argsort(-going, kind="stable")[:num_beams]
            if step + 1 == max_new_tokens or ends.all():
                break
            children = []
            for i in nxt.tolist():
                child = engine.fork(live[parents[i]])
                child.append([int(tokens[i])])
                children.append(child)
            for seq in {id(s): s for s in live}.values():
                engine.release(seq)
            live = children
            live_tokens = [live_tokens[parents[i]] + [int(tokens[i])] for i in nxt.tolist()]
            live_scores = going[nxt]

            if early_stopping == "never" and length_penalty > 0:
                reach = max_new_tokens
            else:
                reach = length
            best_possible = live_scores[0] / np.float32(reach**length_penalty)
            worst_kept = np.where(done, done_scores.min(), _MASKED)
            improvable = improvable and bool(np.any(best_possible > worst_kept))
            if not improvable or (done.all() and early_stopping is True):
                break
    finally:
        for seq in {id(s): s for s in live}.values():
            engine.release(seq)
    tokenizer = engine.model.tokenizer
    beams = []
    for ids, score in zip(done_tokens, done_scores.tolist(), strict=True):
        stopped = bool(ids) and ids[-1] in eos
        text = tokenizer.decode(ids[:-1] if stopped else ids)
        beams.append(Beam(ids, text, float(score), "stop" if stopped else "length"))
    return beams


def _next_logprobs(engine: Engine, live: list[Sequence], adapters: tuple[tuple[LoraAdapter, float], ...]) -> np.ndarray:
    """Float32 next-token log-probabilities of every live beam ``[beams, vocab]``, one engine request
    per distinct sequence, all in the same steps."""
    distinct = {id(seq): seq for seq in live}
    jobs = {}
    for key, seq in distinct.items():
        end = seq.num_tokens
        jobs[key] = engine.submit(seq, ForwardRequest(end=end, logits_at=(end - 1,), adapters=adapters))
    rows = {}
    for key, job in jobs.items():
        result = engine.wait(job)
        rows[key] = next(iter(result.logits.values()))
    logits = np.stack([rows[id(seq)] for seq in live]).astype(np.float32)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))).astype(np.float32)
