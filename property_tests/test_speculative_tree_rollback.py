"""A tree pass then its rollback is exact in every cache kind and KV format zgen speculates on.

A tree pass stores the pending token and every node in scratch slots past the row's context, then
writes the accepted path's K/V at their own positions (:func:`zgen.runtime.tree.commit_path`); the
rest is left behind, past the kept length. Followed by what comes next, the cache reads exactly (bit
for bit, every layer) as writing the prefix, the pending token, the accepted path and what comes next
would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from zgen.cache.base import KVState
from zgen.cache.formats import KV_DTYPES
from zgen.cache.paged_state import PagedKVState
from zgen.cache.tensor import DenseKVState
from zgen.runtime.tree import TreeForward, commit_path

LAYERS, KVH, D, PAGE, CAPACITY = 2, 2, 16, 4, 48
WIDTH = 24  # tokens per write, padded
KINDS = ("tensor", *(f"paged-{name}" for name in KV_DTYPES))
_commit = jax.jit(commit_path)


def _state(kind: str) -> KVState:
    if kind.startswith("paged-"):
        return PagedKVState.contiguous(LAYERS, 1, CAPACITY, KVH, D, kv_dtype=kind.removeprefix("paged-"), page_size=PAGE)
    return DenseKVState.zeros(LAYERS, 1, CAPACITY, KVH, D, jnp.float32)


@jax.jit
def _write_layers(state: KVState, kv: jax.Array, positions: jax.Array) -> KVState:
    for layer in range(LAYERS):
        state = state.write(layer, kv[0, layer][None], kv[1, layer][None], positions[None])
    return state


def _write(state: KVState, kv: np.ndarray, positions: np.ndarray) -> KVState:
    """Write tokens ``kv [2, layers, T, KVH, D]`` at ``positions [T]`` in every layer (padded to one
    shape: one compilation per cache kind)."""
    pad = WIDTH - kv.shape[2]
    kv = np.pad(kv, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
    return _write_layers(state, jnp.asarray(kv), jnp.asarray(np.pad(positions, (0, pad), constant_values=-1), jnp.int32))


@given(
    kind=st.sampled_from(KINDS),
    prefix=st.sampled_from([0, 1, 3, 4, 6]),
    nodes=st.integers(1, 8),
    continuation=st.sampled_from([0, 1, 3]),
    data=st.data(),
)
def test_a_tree_pass_then_commit_equals_writing_the_accepted_path(kind: str, prefix: int, nodes: int, continuation: int, data: st.DataObject) -> None:
    parents = [data.draw(st.integers(-1, i - 1), label=f"parent of {i}") for i in range(nodes)]
    path: list[int] = []  # accepted nodes: from the root, any child, as deep as the draw goes
    while True:
        children = [i for i in range(nodes) if parents[i] == (path[-1] if path else -1)]
        if not children or not data.draw(st.booleans(), label="go deeper"):
            break
        path.append(data.draw(st.sampled_from(children), label="child"))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    kept = rng.normal(size=(2, LAYERS, prefix, KVH, D)).astype(np.float32)
    entries = rng.normal(size=(2, LAYERS, nodes + 1, KVH, D)).astype(np.float32) * 2.0  # the pending token, then the nodes
    after = rng.normal(size=(2, LAYERS, continuation, KVH, D)).astype(np.float32)
    end = prefix + 1 + len(path)

    speculated = _write(_state(kind), kept, np.arange(prefix))
    speculated = _write(speculated, entries, prefix + np.arange(nodes + 1))  # scratch slots
    padded = np.pad(entries, ((0, 0), (0, 0), (0, 9 - nodes), (0, 0), (0, 0)))
    written = TreeForward(*(tuple(jnp.asarray(padded[i, layer][None]) for layer in range(LAYERS)) for i in (0, 1)))
    rows = np.zeros(8, np.int32)  # the path's entries (the first len(path)), written at prefix + 1 ...
    rows[: len(path)] = [i + 1 for i in path]
    positions = np.where(np.arange(8) < len(path), prefix + 1 + np.arange(8), -1)
    speculated = _commit(speculated, written, jnp.asarray(rows[None]), jnp.asarray(positions[None], jnp.int32))
    speculated = _write(speculated, after, end + np.arange(continuation))

    accepted = entries[:, :, [0, *(i + 1 for i in path)]]
    direct = _write(_state(kind), np.concatenate([kept, accepted, after], axis=2), np.arange(end + continuation))
    for layer in range(LAYERS):
        a, b = speculated.layer_view(layer), direct.layer_view(layer)
        np.testing.assert_array_equal(np.asarray(a.k)[:, : end + continuation], np.asarray(b.k)[:, : end + continuation])
        np.testing.assert_array_equal(np.asarray(a.v)[:, : end + continuation], np.asarray(b.v)[:, : end + continuation])
