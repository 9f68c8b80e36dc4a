"""Typed errors. Each says what was wrong and how to fix it; raising one leaves caches and files intact."""

from __future__ import annotations


class ZgenError(Exception):
    """Base class of every error zgen raises on purpose."""


class ModelNotFoundError(ZgenError):
    """A model name or path does not resolve to loadable files."""


class CheckpointError(ZgenError):
    """A checkpoint file exists but is corrupt, truncated or inconsistent with its config."""


class UnsupportedModelError(ZgenError):
    """The architecture, tensor type or dtype is not one zgen implements."""


class ConfigError(ZgenError):
    """A configuration value is invalid (model config, sampling config, generator option)."""


class ExchangeUnavailableError(ConfigError):
    """The GPU's device-host exchange cannot be built or used here (no CUDA GPU, no C++ compiler)."""


class GraphTypeError(ZgenError):
    """A compute graph whose edges do not type-check; the message names the node."""


class InputError(ZgenError):
    """A request zgen cannot serve: out-of-range token ids, a prompt longer than the context, ..."""


class PromptTooLongError(InputError):
    """The prompt plus the requested new tokens do not fit the model's context."""


class TokenIdError(InputError):
    """A token id outside [0, vocab_size)."""


class TemplateError(InputError):
    """A chat template that cannot be rendered for the given messages."""


class CacheError(ZgenError):
    """A cache operation that cannot be carried out (bad truncate length, foreign state, ...)."""


class PoolExhaustedError(CacheError):
    """The KV block pool has no free blocks for the request; nothing was allocated."""


class SnapshotError(ZgenError):
    """A saved context that cannot be opened: missing, damaged, or from another model or page format."""


class AdapterError(ZgenError):
    """A LoRA adapter that cannot be read, or does not fit the model it is applied to."""


class GrammarError(InputError):
    """A grammar, regex or JSON schema that cannot be compiled, or a token the grammar does not allow."""
