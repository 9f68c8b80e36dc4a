"""Persisting and sharing contexts: ``save``/``open`` through orbax, ``export``/``import`` in memory.

A snapshot is a directory ``$ZGEN_STORE_DIR/<name>/`` (default store: ``~/.cache/zgen/contexts``)
holding ``meta.json`` (tokens, masks, chat turns, the page layout, and a fingerprint of the model) and
an orbax checkpoint ``kv/`` of the context's pages in their stored format (quantized pages stay
quantized). It is written to a temporary directory and renamed into place, so a crash never leaves a
half-written snapshot under the name. Opening checks the fingerprint and the page format and refuses a
snapshot of another model or format with :class:`~zgen.errors.SnapshotError`; the pool is touched only
once the snapshot has been read and checked.

Exports are the in-memory form (Pie's ``export_kv_pages``): the engine's exports keep a reference on
the pages under a name (:func:`import_kv_pages` finds them), and contexts created from the import
share them copy-on-write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from zgen.cache.page_store import PageStore
from zgen.cache.paged import PagedKVCache
from zgen.errors import InputError, SnapshotError
from zgen.model import Model
from zgen.pallas.paged_attention.layouts import KVPages, take_pages
from zgen.runtime.engine import Engine
from zgen.runtime.sequence import Sequence

# 2: q4/q3 pages hold keys coded after RoPE (centred on the rotated calibration means).
FORMAT_VERSION = 2
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class ImportedKVState:
    """A context's tokens and the pages holding their K/V, as an export publishes them."""

    token_ids: tuple[int, ...]
    masked: np.ndarray  # bool per token
    messages: tuple[tuple[str, str], ...]
    awaiting_reply: bool  # the last chat turn still needs the assistant header
    kv_len: int
    blocks: tuple[int, ...]  # one per page of the first kv_len tokens; -1 = dropped


def store_dir() -> Path:
    """Where named snapshots live: ``$ZGEN_STORE_DIR``, else ``<cache>/zgen/contexts``."""
    configured = os.environ.get("ZGEN_STORE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zgen" / "contexts"


def model_fingerprint(model: Model) -> str:
    """A digest of the architecture, the dtype and some weights: snapshots of another model differ."""
    digest = hashlib.sha256()
    digest.update(json.dumps(asdict(model.config), sort_keys=True, default=str).encode())
    digest.update(str(jnp.dtype(model.dtype)).encode())
    for name in sorted(model.params):
        digest.update(f"{name}{tuple(model.params[name].shape)}".encode())
    digest.update(np.asarray(jax.device_get(model.params["embed"][:4]), np.float32).tobytes())
    return digest.hexdigest()


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InputError(f"snapshot name {name!r} must be 1-128 letters, digits, '.', '_' or '-', not starting with a symbol")
    return name


_EXPORTS: weakref.WeakKeyDictionary[Engine, dict[str, ImportedKVState]] = weakref.WeakKeyDictionary()


def _store(engine: Engine) -> PageStore:
    store = getattr(engine.kv, "store", None)
    if not isinstance(store, PageStore):
        raise SnapshotError(f"snapshots hold pages; the {engine.kv.kind} cache has none (use paged or tiered)")
    return store


def capture(seq: Sequence, messages: tuple[tuple[str, str], ...], awaiting_reply: bool) -> ImportedKVState:
    """A context's state: its tokens, masks, chat turns and the pages of its first ``kv_len`` tokens."""
    cache = _paged(seq)
    pages = -(-seq.kv_len // cache.store.config.page_size)
    blocks = tuple(int(b) for b in cache.block_table[0, :pages])
    return ImportedKVState(tuple(seq.tokens), seq.masked.copy(), messages, awaiting_reply, seq.kv_len, blocks)


def _inject(state: ImportedKVState, seq: Sequence) -> None:
    """Give an empty sequence the state's tokens and (shared) pages."""
    _paged(seq).inject_blocks([list(state.blocks)], state.kv_len)
    seq.tokens, seq.masked = list(state.token_ids), np.asarray(state.masked, bool).copy()
    seq.custom_attention = True  # its K/V came from elsewhere: never offered to the prefix cache


def _paged(seq: Sequence) -> PagedKVCache:
    if not isinstance(seq.kv, PagedKVCache):
        raise SnapshotError("snapshots hold pages; this sequence's cache has none (use paged or tiered)")
    return seq.kv


def _layout(engine: Engine) -> dict[str, Any]:
    c = _store(engine).config
    return {"kv_dtype": c.kv_dtype, "page_size": c.page_size, "num_layers": c.num_layers, "kv_heads": c.kv_heads, "head_dim": c.head_dim}


# -- save / open ---------------------------------------------------------------------------------


def save_state(engine: Engine, state: ImportedKVState, name: str) -> Path:
    """Write a context's state to the store under ``name`` (replacing an older snapshot of that name)."""
    _check_name(name)
    present = [b for b in state.blocks if b >= 0]
    index = jnp.asarray(present, jnp.int32)
    store = _store(engine)

    def pick(pages: tuple[KVPages, ...]) -> list[list[np.ndarray]]:
        return [[np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(take_pages(p, index))] for p in pages]

    meta = {
        "format": FORMAT_VERSION,
        "model": model_fingerprint(engine.model),
        "layout": _layout(engine),
        "token_ids": list(state.token_ids),
        "masked": np.flatnonzero(state.masked).tolist(),
        "messages": [list(m) for m in state.messages],
        "awaiting_reply": state.awaiting_reply,
        "kv_len": state.kv_len,
        "present": [b >= 0 for b in state.blocks],
    }
    root = store_dir()
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{name}.{uuid.uuid4().hex}"
    try:
        staging.mkdir()
        if present:
            ocp.PyTreeCheckpointer().save((staging / "kv").absolute(), {"k": pick(store.k), "v": pick(store.v)})
        (staging / "meta.json").write_text(json.dumps(meta))
        target = root / name
        old = root / f".{name}.old-{uuid.uuid4().hex}"
        if target.exists():
            target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root / name


def _read_meta(path: Path, name: str) -> dict[str, Any]:
    if not (path / "meta.json").is_file():
        raise SnapshotError(f"no snapshot named {name!r} in {path.parent}; save one with ctx.save({name!r}) (or set ZGEN_STORE_DIR)")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise SnapshotError(f"snapshot {name!r} has an unreadable meta.json ({err}); save it again") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise SnapshotError(f"snapshot {name!r} is not a zgen context snapshot of format {FORMAT_VERSION}")
    return meta  # pyright: ignore[reportUnknownVariableType]


def open_into(engine: Engine, name: str, seq: Sequence) -> ImportedKVState:
    """Load the snapshot ``name`` into the empty ``seq`` (see the module docstring); its state."""
    path = store_dir() / _check_name(name)
    meta = _read_meta(path, name)
    if meta["model"] != model_fingerprint(engine.model):
        raise SnapshotError(
            f"snapshot {name!r} was saved from a different model (or dtype) than this engine's; "
            "open it with the model that saved it"
        )
    if meta["layout"] != _layout(engine):
        raise SnapshotError(
            f"snapshot {name!r} stores pages as {meta['layout']}, this engine uses {_layout(engine)}; "
            "open it with an Engine made with the same kv_dtype(...) and paged_kv(page_size=...) options"
        )
    present: list[bool] = meta["present"]
    k_data: list[list[np.ndarray]] = []
    v_data: list[list[np.ndarray]] = []
    if any(present):
        try:
            tree = ocp.PyTreeCheckpointer().restore((path / "kv").absolute())
            k_data, v_data = tree["k"], tree["v"]
        except Exception as err:  # orbax raises many types for a damaged checkpoint
            raise SnapshotError(f"snapshot {name!r} has unreadable K/V pages ({type(err).__name__}: {err}); save it again") from err
        _check_pages(engine, name, k_data, v_data, sum(present))
    store = _store(engine)
    blocks = store.pool.allocate(sum(present))  # PoolExhaustedError here changes nothing
    if blocks:
        store.k, store.v = _put_pages(
            store.k, store.v, jnp.asarray(blocks, jnp.int32), _as_pages(store.k, k_data), _as_pages(store.v, v_data)
        )
    it = iter(blocks)
    masked = np.zeros(len(meta["token_ids"]), bool)
    masked[meta["masked"]] = True
    state = ImportedKVState(
        tuple(meta["token_ids"]), masked, tuple((r, c) for r, c in meta["messages"]), bool(meta["awaiting_reply"]),
        int(meta["kv_len"]), tuple(next(it) if p else -1 for p in present),
    )
    try:
        _inject(state, seq)
    finally:
        store.pool.free(blocks)  # the sequence's reference is now the only one
    return state


def _check_pages(engine: Engine, name: str, k_data: Any, v_data: Any, count: int) -> None:
    store = _store(engine)
    expected = [
        (tuple(leaf.shape[:1]) + (count,) + tuple(leaf.shape[2:]), leaf.dtype)
        for leaf in jax.tree_util.tree_leaves(store.k[0])
    ]
    for data in (k_data, v_data):
        if len(data) != store.config.num_layers:
            raise SnapshotError(f"snapshot {name!r} holds {len(data)} layers of pages, the model has {store.config.num_layers}")
        for layer in data:
            got = [(tuple(np.shape(x)), np.asarray(x).dtype) for x in layer]
            if got != expected:
                raise SnapshotError(f"snapshot {name!r} has pages shaped {got}, expected {expected}; it is damaged or foreign")


def _as_pages(like: tuple[KVPages, ...], data: list[list[np.ndarray]]) -> tuple[KVPages, ...]:
    treedef = jax.tree_util.tree_structure(like[0])
    return tuple(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in layer]) for layer in data)


@partial(jax.jit, donate_argnums=(0, 1))
def _put_pages(
    k: tuple[KVPages, ...], v: tuple[KVPages, ...], blocks: jax.Array, k_new: tuple[KVPages, ...], v_new: tuple[KVPages, ...]
) -> tuple[tuple[KVPages, ...], tuple[KVPages, ...]]:
    def put(leaf: jax.Array, new: jax.Array) -> jax.Array:
        return leaf.at[:, blocks].set(new.astype(leaf.dtype))

    return jax.tree_util.tree_map(put, k, k_new), jax.tree_util.tree_map(put, v, v_new)


# -- export / import ------------------------------------------------------------------------------


def export_state(engine: Engine, state: ImportedKVState, name: str) -> None:
    """Publish a context's state under ``name`` in the engine's exports, which hold a reference on its pages."""
    _store(engine).pool.share([b for b in state.blocks if b >= 0])
    drop_export(engine, name)
    _EXPORTS.setdefault(engine, {})[name] = state


def import_kv_pages(engine: Engine, name: str) -> ImportedKVState:
    """The pages a context exported under ``name`` (pass to ``Context.from_imported_state``)."""
    exports = _EXPORTS.get(engine, {})
    if name not in exports:
        raise InputError(f"nothing was exported as {name!r}; exports: {sorted(exports)}")
    return exports[name]


def drop_export(engine: Engine, name: str) -> None:
    """Forget an export and release its page references (contexts made from it keep theirs)."""
    state = _EXPORTS.get(engine, {}).pop(name, None)
    if state is not None:
        _store(engine).pool.free([b for b in state.blocks if b >= 0])


def inject(state: ImportedKVState, seq: Sequence) -> None:
    """Give an empty sequence an export's tokens and pages (shared: the export keeps its reference)."""
    _inject(state, seq)
