"""Samplers for contexts: how ``Context.generate`` and ``ForwardPass.sample`` pick a token.

A :class:`Sampler` is a :class:`~zgen.sampling.SamplingConfig` (validated there, run on the device by
:func:`zgen.sampling.sample`) or a Python choice function run on the host::

    Sampler.greedy()                    Sampler.top_p(0.7, 0.9)          Sampler.top_k(0.8, 40)
    Sampler.min_p(1.0, 0.05)            Sampler.top_k_top_p(0.6, 20, 0.95)
    Sampler.reasoning()                 # = top_k_top_p(0.6, 20, 0.95)
    Sampler.custom(lambda ids, probs: int(ids[0]), temperature=0.7)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zgen.sampling import HostSampler, SamplingConfig


@dataclass(frozen=True)
class Sampler:
    """A token choice rule. ``config`` holds temperature and filters; ``choose`` (optional) replaces the
    device draw with ``choose(ids, probs) -> id`` on the host, given every token sorted by probability
    under ``softmax(logits / temperature)`` — a host round trip per token."""

    config: SamplingConfig
    choose: HostSampler | None = None

    @classmethod
    def greedy(cls) -> Sampler:
        return cls(SamplingConfig(temperature=0.0))

    @classmethod
    def top_p(cls, temperature: float, p: float) -> Sampler:
        return cls(SamplingConfig(temperature=temperature, top_p=p))

    @classmethod
    def top_k(cls, temperature: float, k: int) -> Sampler:
        return cls(SamplingConfig(temperature=temperature, top_k=k))

    @classmethod
    def min_p(cls, temperature: float, p: float) -> Sampler:
        return cls(SamplingConfig(temperature=temperature, min_p=p))

    @classmethod
    def top_k_top_p(cls, temperature: float, k: int, p: float) -> Sampler:
        return cls(SamplingConfig(temperature=temperature, top_k=k, top_p=p))

    @classmethod
    def reasoning(cls) -> Sampler:
        """The sampling Qwen3 and DeepSeek recommend for reasoning: top-k 20, top-p 0.95 at 0.6."""
        return cls.top_k_top_p(0.6, 20, 0.95)

    @classmethod
    def custom(cls, fn: HostSampler, temperature: float = 1.0) -> Sampler:
        """``fn(ids, probs) -> id`` picks every token on the host (``temperature`` shapes ``probs``)."""
        return cls(SamplingConfig(temperature=temperature), choose=fn)

    @property
    def on_device(self) -> bool:
        return self.choose is None

    def choose_on_host(self, logits: np.ndarray) -> int:
        """Apply ``choose`` to one row of raw logits."""
        assert self.choose is not None
        t = self.config.temperature
        x = logits.astype(np.float64)
        if t > 0:
            x = x / t
        else:  # temperature 0: all mass on the argmax, as greedy decoding would pick
            x = np.where(x == x.max(), 0.0, -np.inf)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        return int(self.choose(order, probs[order]))
