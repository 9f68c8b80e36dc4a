"""KV caches: device states used inside compiled steps, and the managers that hand them to sequences.

Start with :mod:`zgen.cache.base` (the contract), :mod:`zgen.cache.formats` (the table of storage
formats) and :mod:`zgen.cache.factory` (the one place a cache is made from options). Kinds: dense rows
(:mod:`~zgen.cache.slots` over :mod:`~zgen.cache.tensor` or :mod:`~zgen.cache.compressed` states),
pages of a shared pool (:mod:`~zgen.cache.paged_manager`, :mod:`~zgen.cache.paged`,
:mod:`~zgen.cache.page_store`, :mod:`~zgen.cache.paged_state`, :mod:`~zgen.cache.block_pool`), the
radix prefix cache (:mod:`~zgen.cache.radix`) and the host RAM / disk tiers below it
(:mod:`~zgen.cache.tiered`).
"""
