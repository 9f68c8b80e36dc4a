"""Flash (prefill) attention."""

from zgen.pallas.flash_attention.api import append_and_attend, flash_attention

__all__ = ["append_and_attend", "flash_attention"]
