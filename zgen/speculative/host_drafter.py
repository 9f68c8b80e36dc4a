"""Drafters written in Python: asked on the host once per pass, from inside the device loop."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from zgen.model import Model
from zgen.runtime.speculation import DraftInput, Proposal
from zgen.speculative.prompt_lookup import check_num_tokens


class Drafter(Protocol):
    """Pie's drafter interface: see the context's tokens, propose a continuation."""

    def update(self, context_ids: Sequence[int]) -> None:
        """Every token of the context so far (called before each ``draft``)."""
        ...

    def draft(self) -> tuple[list[int], list[int]]:
        """Proposed tokens and their positions: ``positions[i] == len(context_ids) + i`` (a chain)."""
        ...


class HostDrafter:
    """A :class:`Drafter` as a speculator: each pass calls it on the host (``jax.pure_callback``, one
    round trip per pass, for research drafters); up to ``num_tokens`` of its tokens are verified.
    Proposals are cut at the first token whose position does not continue the chain, or that is not
    a token id of the model."""

    def __init__(self, drafter: Drafter, num_tokens: int = 8) -> None:
        self.drafter = drafter
        self._num_tokens = check_num_tokens("HostDrafter", num_tokens)
        self._vocab = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def adaptive(self) -> bool:
        return False

    def cache_key(self) -> Hashable:
        return ("host-drafter", id(self.drafter), self._num_tokens)

    def check_target(self, model: Model) -> None:
        self._vocab = model.config.vocab_size

    def device_params(self) -> Any:
        return ()

    def start(self, params: Any, history: Int[Array, "B L"], length: Int[Array, " B"]) -> Any:
        del params, history, length
        return ()

    def advance(self, state: Any, kept: Int[Array, " B"]) -> Any:
        del kept
        return state

    def _ask(self, history: np.ndarray, length: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b, k = history.shape[0], self._num_tokens
        tokens, count = np.zeros((b, k), np.int32), np.zeros(b, np.int32)
        for row in range(b):
            if wanted[row] <= 0:
                continue
            n = int(length[row])
            self.drafter.update([int(t) for t in history[row, :n]])
            draft, positions = self.drafter.draft()
            for i, (token, position) in enumerate(zip(draft[: int(wanted[row])], positions, strict=False)):
                if position != n + i or not 0 <= token < max(self._vocab, 1):
                    break
                tokens[row, i], count[row] = token, i + 1
        return tokens, count

    def propose(self, params: Any, state: Any, draft: DraftInput) -> tuple[Proposal, Any]:
        del params
        b, k = draft.history.shape[0], self._num_tokens
        shapes = (jax.ShapeDtypeStruct((b, k), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
        wanted = jnp.where(draft.active, draft.num_tokens, 0)
        tokens, count = jax.pure_callback(self._ask, shapes, draft.history, draft.length, wanted)
        return Proposal(tokens, count, None), state
