"""Persisting and sharing contexts: ``save``/``open`` through orbax, ``export``/``import`` in memory.

A snapshot is a directory ``$ZGEN_STORE_DIR/<name>/`` (default store: ``~/.cache/zgen/contexts``)
holding ``meta.json`` (tokens, masks, chat turns, the page layout, and a fingerprint of the model) and
an orbax checkpoint ``kv/`` of the context's pages in their stored format (quantized pages stay
quantized). It is written to a temporary directory and renamed into place, so a crash never leaves a
half-written snapshot under the name. Opening checks the fingerprint and the page format and refuses a
snapshot of another model or format with :class:`~zgen.errors.SnapshotError`; the pool is touched only
once the snapshot has been read and checked.

Exports are the in-memory form (Pie's ``export_kv_pages``): the engine keeps a reference on the pages
under a name, and contexts created from the import share them copy-on-write.
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
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from zgen.cache.paged import KVPages
from zgen.errors import InputError, SnapshotError
from zgen.pallas.paged_attention.layouts import take_pages

if TYPE_CHECKING:
    from zgen.engine.context import Context
    from zgen.engine.engine import Engine
    from zgen.model import Model

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


def _context_state(ctx: Context) -> ImportedKVState:
    ps = ctx.engine.store.config.page_size
    pages = -(-ctx.kv_len // ps)
    blocks = tuple(int(b) for b in ctx.cache.block_table[0, :pages])
    messages = tuple((m["role"], m["content"]) for m in ctx.messages)
    return ImportedKVState(
        tuple(ctx.token_ids), ctx.masked_flags, messages, ctx.awaiting_reply, ctx.kv_len, blocks
    )


def _layout(engine: Engine) -> dict[str, Any]:
    c = engine.store.config
    return {"kv_dtype": c.kv_dtype, "page_size": c.page_size, "num_layers": c.num_layers, "kv_heads": c.kv_heads, "head_dim": c.head_dim}


# -- save / open ---------------------------------------------------------------------------------


def save_context(ctx: Context, name: str) -> Path:
    """Write ``ctx`` to the store under ``name`` (replacing an older snapshot of that name)."""
    _check_name(name)
    state = _context_state(ctx)
    present = [b for b in state.blocks if b >= 0]
    index = jnp.asarray(present, jnp.int32)
    store = ctx.engine.store

    def pick(pages: tuple[KVPages, ...]) -> list[list[np.ndarray]]:
        return [[np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(take_pages(p, index))] for p in pages]

    meta = {
        "format": FORMAT_VERSION,
        "model": model_fingerprint(ctx.engine.model),
        "layout": _layout(ctx.engine),
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


def open_context(engine: Engine, name: str, *, seed: int | None = None) -> Context:
    """A live context on ``engine`` from the snapshot ``name`` (see the module docstring)."""
    from zgen.engine.context import Context

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
            "open it with an Engine whose EngineConfig has the same kv_dtype and page_size"
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
    blocks = engine.pool.allocate(sum(present))  # PoolExhaustedError here changes nothing
    if blocks:
        store = engine.store
        store.k, store.v = _put_pages(
            store.k, store.v, jnp.asarray(blocks, jnp.int32), _as_pages(store.k, k_data), _as_pages(store.v, v_data)
        )
    it = iter(blocks)
    table = [next(it) if p else -1 for p in present]
    ctx = Context(engine, seed=seed)
    ctx.cache.inject_blocks([table], int(meta["kv_len"]))
    engine.pool.free(blocks)  # the context's reference is now the only one
    masked = np.zeros(len(meta["token_ids"]), bool)
    masked[meta["masked"]] = True
    ctx.restore(meta["token_ids"], masked, [(r, c) for r, c in meta["messages"]], bool(meta["awaiting_reply"]))
    return ctx


def _check_pages(engine: Engine, name: str, k_data: Any, v_data: Any, count: int) -> None:
    expected = [
        (tuple(leaf.shape[:1]) + (count,) + tuple(leaf.shape[2:]), leaf.dtype)
        for leaf in jax.tree_util.tree_leaves(engine.store.k[0])
    ]
    for data in (k_data, v_data):
        if len(data) != engine.store.config.num_layers:
            raise SnapshotError(f"snapshot {name!r} holds {len(data)} layers of pages, the model has {engine.store.config.num_layers}")
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


def export_pages(ctx: Context, name: str) -> None:
    """Publish ``ctx``'s pages under ``name`` in its engine; the engine holds a reference on them."""
    state = _context_state(ctx)
    engine = ctx.engine
    engine.pool.share([b for b in state.blocks if b >= 0])
    engine.drop_export(name)
    engine.exports[name] = state


def context_from_import(engine: Engine, state: ImportedKVState, *, seed: int | None = None) -> Context:
    from zgen.engine.context import Context

    ctx = Context(engine, seed=seed)
    ctx.cache.inject_blocks([list(state.blocks)], state.kv_len)  # shares: the export keeps its own reference
    ctx.restore(state.token_ids, state.masked, list(state.messages), state.awaiting_reply)
    return ctx
