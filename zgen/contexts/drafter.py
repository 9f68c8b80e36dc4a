"""Drafters for a context's speculative decoding (``Context.generate_with_drafter``).

Every speculator of :mod:`zgen.speculative` works; :class:`NgramDrafter` is prompt lookup under the
names contexts have used; a Python object with ``update``/``draft`` (:class:`Drafter`) is asked on
the host each pass (:class:`~zgen.speculative.host_drafter.HostDrafter`).
"""

from __future__ import annotations

from zgen.speculative.host_drafter import Drafter, HostDrafter
from zgen.speculative.prompt_lookup import PromptLookup


class NgramDrafter(PromptLookup):
    """Prompt-lookup decoding: find the last ``n``-gram earlier in the context, propose what followed.

    Tries ``max_ngram`` down to ``min_ngram`` tokens and takes the most recent earlier match; proposes
    up to ``max_draft`` tokens (none when nothing matches). Runs on the device.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 8) -> None:
        super().__init__(max_ngram, num_tokens=max_draft, min_ngram=min_ngram)


__all__ = ["Drafter", "HostDrafter", "NgramDrafter"]
