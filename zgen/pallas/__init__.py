"""Kernels, one folder per op: ``api.py`` picks a backend for the platform.

See ``zgen/pallas/STATUS.md`` for which backends exist and where each is tested.
"""

from zgen.pallas.flash_attention import append_and_attend, flash_attention
from zgen.pallas.page_write import store_tokens
from zgen.pallas.paged_attention import paged_attention, paged_decode_attention
from zgen.pallas.rms_norm import add_rms_norm

__all__ = ["add_rms_norm", "append_and_attend", "flash_attention", "paged_attention", "paged_decode_attention", "store_tokens"]
