"""Storing tokens' K/V into their pages: the paged cache's write, as one kernel."""

from zgen.pallas.page_write.api import store_tokens, write_kv

__all__ = ["store_tokens", "write_kv"]
