"""Speculators: cheap guesses of the next tokens that the target model checks in one forward pass.

* :class:`PromptLookup` — n-gram drafts from the prompt and the generated text;
* :class:`DraftModel` — a smaller model with the same vocabulary (``DraftModel.early_exit``: the
  target's own first layers, its final norm and LM head), with an adaptive draft length;
* :class:`Jacobi` — Jacobi (lookahead) decoding: drafts from the target's own predictions of earlier
  passes and an n-gram pool they fill, no draft model.

A draft model drafts chains, or EAGLE-2 dynamic token trees (``DraftModel(..., tree=TreeShape(...))``,
:mod:`zgen.speculative.tree`) that the target verifies in one pass.

Every speculator implements :class:`~zgen.runtime.speculation.Speculator`; the runtime runs the
draft–verify–accept loop on the device (:mod:`zgen.runtime.speculation`). Give one to
``Generator(model, speculative=...)``, to a context's ``generate_result(..., speculative=...)`` or to
``zgen generate --prompt-lookup / --draft-model / --early-exit / --jacobi``.
"""

from zgen.runtime.speculation import Speculator, SpeculativeStats
from zgen.speculative.draft_model import DraftModel
from zgen.speculative.host_drafter import Drafter, HostDrafter
from zgen.speculative.jacobi import Jacobi
from zgen.speculative.prompt_lookup import PromptLookup
from zgen.speculative.tree import TreeShape

__all__ = ["DraftModel", "Drafter", "HostDrafter", "Jacobi", "PromptLookup", "SpeculativeStats", "Speculator", "TreeShape"]
