"""Speculative rollback is exact in every cache kind and KV format zgen speculates on.

Writing a prefix, then ``k`` drafted tokens (the first ``a`` of them the accepted ones, the rest
rejected garbage), truncating to the prefix plus the ``a`` accepted tokens and writing what comes
next leaves the cache reading exactly (bit for bit, every layer) as writing the prefix, the accepted
tokens and what comes next would: quantized formats store each token on its own, so a rejected
token leaves nothing behind in its page.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

import jax.numpy as jnp

from zgen.cache.base import CacheProvider
from zgen.cache.factory import CacheOptions, make_kv
from zgen.cache.formats import KV_DTYPES
from zgen.cache.paged import PagedKVCache
from zgen.config import ModelConfig

LAYERS, KVH, D, PAGE, MAX_LEN = 2, 2, 16, 4, 32
CONFIG = ModelConfig(
    architecture="llama", vocab_size=32, hidden_size=32, intermediate_size=32, num_layers=LAYERS,
    num_heads=4, num_kv_heads=KVH, head_dim=D, max_position_embeddings=MAX_LEN,
)
KINDS = ("tensor", "flat", *(f"paged-{name}" for name in KV_DTYPES))


def _cache(kind: str) -> CacheProvider:
    if kind.startswith("paged-"):
        return PagedKVCache.create(LAYERS, 1, MAX_LEN, KVH, D, page_size=PAGE, kv_dtype=kind.removeprefix("paged-"))
    return make_kv(CacheOptions(kind=kind), CONFIG, jnp.dtype(jnp.float32), max_rows=1, max_write=16).new_handle()


def _write(cache: CacheProvider, kv: np.ndarray) -> None:
    """Append tokens ``kv [2, layers, T, KVH, D]`` (keys and values) to every layer."""
    if kv.shape[2] == 0:
        return
    for layer in range(LAYERS):
        cache.update(layer, jnp.asarray(kv[0, layer][None]), jnp.asarray(kv[1, layer][None]))


@given(
    kind=st.sampled_from(KINDS),
    prefix=st.sampled_from([0, 1, 3, 4, 6]),
    drafted=st.integers(1, 6),
    continuation=st.sampled_from([0, 1, 2, 5]),
    data=st.data(),
)
def test_truncating_rejected_drafts_equals_never_writing_them(kind: str, prefix: int, drafted: int, continuation: int, data: st.DataObject) -> None:
    accepted = data.draw(st.integers(0, drafted), label="accepted")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    kept = rng.normal(size=(2, LAYERS, prefix + accepted + continuation, KVH, D)).astype(np.float32)
    rejected = rng.normal(size=(2, LAYERS, drafted - accepted, KVH, D)).astype(np.float32) * 3.0

    speculated, direct = _cache(kind), _cache(kind)
    _write(speculated, kept[:, :, :prefix])
    _write(speculated, np.concatenate([kept[:, :, prefix : prefix + accepted], rejected], axis=2))
    speculated.truncate(prefix + accepted)
    _write(speculated, kept[:, :, prefix + accepted :])
    _write(direct, kept)

    assert speculated.seq_len == direct.seq_len == prefix + accepted + continuation
    if direct.seq_len == 0:
        return
    for layer in range(LAYERS):
        a, b = speculated.get(layer), direct.get(layer)
        np.testing.assert_array_equal(np.asarray(a.k), np.asarray(b.k))
        np.testing.assert_array_equal(np.asarray(a.v), np.asarray(b.v))
