"""Flash (prefill) attention."""

from zgen.pallas.flash_attention.api import flash_attention

__all__ = ["flash_attention"]
