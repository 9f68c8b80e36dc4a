"""zgen: LLM text generation in JAX.

The path of one token (``docs/architecture.md``): tokenizer (``zgen.tokenizer``) → a front end
(``Generator``, ``Context``, the CLI) → the runtime's engine (``zgen.runtime``: scheduler, one compiled
step, sampler, stop rules) → the model's typed graph (``zgen.graph``) over a KV cache (``zgen.cache``)
and attention kernels (``zgen.pallas``) → text.
"""

from zgen.config import ModelConfig
from zgen.contexts import Context
from zgen.embeddings import embed
from zgen.errors import ZgenError
from zgen.generator import Generator, Request, Session
from zgen.lora import LoraAdapter, load_adapter
from zgen.model import Model, load_model
from zgen.runtime import (
    Engine,
    EngineConfig,
    GenerationResult,
    Grammar,
    Sampler,
    SamplingConfig,
    StopCondition,
    TokenUsage,
    stop,
)

__all__ = [
    "Context",
    "Engine",
    "EngineConfig",
    "GenerationResult",
    "Generator",
    "Grammar",
    "LoraAdapter",
    "Model",
    "ModelConfig",
    "Request",
    "Sampler",
    "SamplingConfig",
    "Session",
    "StopCondition",
    "TokenUsage",
    "ZgenError",
    "embed",
    "load_adapter",
    "load_model",
    "stop",
]
