"""zgen: LLM text generation in JAX.

The path of one token: tokenizer (``zgen.tokenizer``) → typed graph compiled to an execution plan
(``zgen.graph``) → prefill and on-device decode loop over a KV cache (``zgen.cache``, ``zgen.pallas``)
→ sampler (``zgen.sampling``) → detokenizer and stop conditions (``zgen.stopping``).
"""

from zgen.config import ModelConfig
from zgen.errors import ZgenError
from zgen.generator import GenerationResult, Generator, Request, Session, TokenUsage
from zgen.model import Model, load_model
from zgen.sampling import SamplingConfig
from zgen.stopping import MaxNewTokens, StopStrings, StopTokens

__all__ = [
    "GenerationResult",
    "Generator",
    "MaxNewTokens",
    "Model",
    "ModelConfig",
    "Request",
    "SamplingConfig",
    "Session",
    "StopStrings",
    "StopTokens",
    "TokenUsage",
    "ZgenError",
    "load_model",
]
