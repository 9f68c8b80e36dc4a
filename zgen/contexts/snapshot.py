"""Persisting and sharing contexts: ``save``/``open`` through orbax, ``export``/``import`` in memory.

A snapshot is a directory ``$ZGEN_STORE_DIR/<name>/`` (default store: ``~/.cache/zgen/contexts``)::

    <name>/.lock          held exclusively by a save, shared by an open (flock; the OS drops it if a
                          process dies), so saves of one name run one at a time and never under a reader
    <name>/CURRENT        the name of the complete version, replaced by an atomic rename
    <name>/v-<uuid>/      a version: meta.json (tokens, masks, chat turns, the page layout, a
                          fingerprint of the model, the context's LoRA adapter stack, SHA-256
                          checksums of the pages and of meta.json itself) and an orbax checkpoint
                          kv/ of the pages in their stored format

A save writes a new version beside the old one, flushes it to disk, then renames a new ``CURRENT``
into place, and only then deletes the old version: whenever a save is interrupted (an exception, a
``kill -9``, a power loss on a file system that honours fsync), the name opens as the old snapshot or
the new one, never as neither. What an interrupted save leaves behind is deleted by the next save of
that name, or by an open that finds no one else using it.

Opening checks meta.json's checksum and every field's type, the fingerprint (:func:`model_fingerprint`)
and the page format, then the pages' checksums, and refuses anything else with
:class:`~zgen.errors.SnapshotError`; the pool is touched only once the snapshot has been read and checked.

A context's adapter stack (``Context.push_adapter``) is saved as, per adapter in stack order, its
name, the directory it was loaded from (absolute; none for an adapter built in memory), a SHA-256
fingerprint of its weights (:func:`~zgen.lora.adapter.adapter_fingerprint`) and its scale. Opening
restores the stack: each adapter is the one the caller passes (``Context.open(..., adapters=[...])``,
matched by fingerprint; others passed are ignored), else reloaded from its recorded directory. One
that is neither, or whose reloaded files have other weights, is refused with
:class:`~zgen.errors.SnapshotError` naming it, before the pool is touched. Snapshots of format 3
(before adapter stacks were saved) open with an empty stack.

Exports are the in-memory form (Pie's ``export_kv_pages``): the engine's exports keep a reference on
the pages under a name (:func:`import_kv_pages` finds them), and contexts created from the import
share them copy-on-write.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import uuid
import weakref
from collections.abc import Iterator, Sequence as Seq
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from zgen.cache.page_store import PageStore
from zgen.cache.paged import PagedKVCache
from zgen.errors import AdapterError, InputError, SnapshotError, TokenIdError
from zgen.lora.adapter import LoraAdapter, adapter_fingerprint, load_adapter
from zgen.model import Model
from zgen.pallas.paged_attention.layouts import KVPages, float_pages, stored_like, take_pages
from zgen.runtime.engine import Engine
from zgen.runtime.sequence import Sequence

# 2: q4/q3 pages hold keys coded after RoPE (centred on the rotated calibration means).
# 3: versioned directories behind an atomically replaced CURRENT file; checksums; every tensor fingerprinted.
# 4: the context's LoRA adapter stack ("adapters"); a format 3 snapshot opens with none.
FORMAT_VERSION = 4
_READABLE_FORMATS = (3, 4)
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
    adapters: tuple[tuple[LoraAdapter, float], ...] = ()  # the context's LoRA stack, (adapter, scale) in order


def store_dir() -> Path:
    """Where named snapshots live: ``$ZGEN_STORE_DIR``, else ``<cache>/zgen/contexts``."""
    configured = os.environ.get("ZGEN_STORE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zgen" / "contexts"


# Values hashed per tensor by the fingerprint, evenly strided over its flattened elements.
FINGERPRINT_SAMPLES = 4096
_FINGERPRINTS: weakref.WeakKeyDictionary[Model, str] = weakref.WeakKeyDictionary()


def model_fingerprint(model: Model) -> str:
    """A digest of the config, the dtype and every parameter: its name, shape and up to
    :data:`FINGERPRINT_SAMPLES` of its values, evenly strided over the whole tensor (all of them for
    smaller tensors). Snapshots of another model of the same shape differ: a changed layer (another
    fine-tune, another initialization) changes nearly every value, so its samples. Not detected: an
    edit confined to values between the samples (a single weight, say). Computed once per Model
    object (a model whose params are later replaced in place keeps its first fingerprint)."""
    if model not in _FINGERPRINTS:
        digest = hashlib.sha256()
        digest.update(json.dumps(asdict(model.config), sort_keys=True, default=str).encode())
        digest.update(str(jnp.dtype(model.dtype)).encode())
        for name in sorted(model.params):
            # A quantized weight contributes each of its arrays (codes, scales, offsets).
            for value in jax.tree.leaves(model.params[name]):
                flat = value.reshape(-1)
                sample = flat[:: max(flat.size // FINGERPRINT_SAMPLES, 1)]
                digest.update(f"{name}{tuple(value.shape)}".encode())
                digest.update(np.asarray(jax.device_get(sample)).tobytes())
        _FINGERPRINTS[model] = digest.hexdigest()
    return _FINGERPRINTS[model]


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


def capture(
    seq: Sequence, messages: tuple[tuple[str, str], ...], awaiting_reply: bool,
    adapters: tuple[tuple[LoraAdapter, float], ...] = (),
) -> ImportedKVState:
    """A context's state: its tokens, masks, chat turns, the pages of its first ``kv_len`` tokens and
    its adapter stack."""
    cache = _paged(seq)
    pages = -(-seq.kv_len // cache.store.config.page_size)
    blocks = tuple(int(b) for b in cache.block_table[0, :pages])
    return ImportedKVState(tuple(seq.tokens), seq.masked.copy(), messages, awaiting_reply, seq.kv_len, blocks, adapters)


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

_CURRENT, _LOCK = "CURRENT", ".lock"
_VERSION = re.compile(r"v-[0-9a-f]{32}")


def _damaged(name: str, what: str) -> SnapshotError:
    return SnapshotError(f"snapshot {name!r} is damaged: {what}; save it again")


def save_state(engine: Engine, state: ImportedKVState, name: str) -> Path:
    """Write a context's state to the store under ``name``, replacing an older snapshot of that name
    atomically (see the module docstring); its directory."""
    _check_name(name)
    present = [b for b in state.blocks if b >= 0]
    index = jnp.asarray(present, jnp.int32)
    store = _store(engine)

    def pick(pages: tuple[KVPages, ...]) -> list[list[np.ndarray]]:
        # Float leaves as every platform stores them (a CPU pool keeps some in integer containers).
        return [[np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(float_pages(take_pages(p, index)))] for p in pages]

    k, v = pick(store.k), pick(store.v)
    meta: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "model": model_fingerprint(engine.model),
        "layout": _layout(engine),
        "token_ids": list(state.token_ids),
        "masked": np.flatnonzero(state.masked).tolist(),
        "messages": [list(m) for m in state.messages],
        "awaiting_reply": state.awaiting_reply,
        "kv_len": state.kv_len,
        "present": [b >= 0 for b in state.blocks],
        "pages_sha256": {"k": [_digest(layer) for layer in k], "v": [_digest(layer) for layer in v]},
        "adapters": [_adapter_record(adapter, scale) for adapter, scale in state.adapters],
    }
    meta["meta_sha256"] = _meta_digest(meta)
    directory = store_dir() / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _locked(directory, exclusive=True):
            try:
                current = _current_version(directory)
            except SnapshotError:
                current = None  # a damaged pointer: this save replaces it
            _remove_leftovers(directory, keep=current)
            version = f"v-{uuid.uuid4().hex}"
            try:
                _write_version(directory / version, meta, k, v)
                # The one step that switches versions: an atomic rename of a file naming the new one.
                pointer = directory / f"{_CURRENT}.{version}"
                pointer.write_text(version, encoding="ascii")
                _fsync(pointer)
                os.replace(pointer, directory / _CURRENT)
                _fsync(directory)
            except BaseException:
                with contextlib.suppress(Exception):  # free the disk now; the next save would anyway
                    _remove_leftovers(directory, keep=_current_version(directory))
                raise
            _remove_leftovers(directory, keep=version)
    except Exception as err:  # OSError, or whatever orbax raises for a full or failing disk
        raise SnapshotError(
            f"could not save snapshot {name!r} in {directory} ({type(err).__name__}: {err}); an older snapshot of "
            "that name is unchanged"
        ) from err
    return directory


def _write_version(path: Path, meta: dict[str, Any], k: list[list[np.ndarray]], v: list[list[np.ndarray]]) -> None:
    """A complete version directory: the pages (orbax), then meta.json, all flushed to disk."""
    path.mkdir()
    if any(meta["present"]):
        ocp.PyTreeCheckpointer().save((path / "kv").absolute(), {"k": k, "v": v})
    (path / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    _fsync_tree(path)


def open_into(engine: Engine, name: str, seq: Sequence, adapters: Seq[LoraAdapter] = ()) -> ImportedKVState:
    """Load the snapshot ``name`` into the empty ``seq`` (see the module docstring); its state. The
    saved adapter stack is made of ``adapters`` (matched by fingerprint) or reloaded from disk."""
    directory = store_dir() / _check_name(name)
    meta, k_data, v_data = _read(engine, directory, name)
    stack = _restore_adapters(meta["adapters"], name, adapters)
    store = _store(engine)
    present: list[bool] = meta["present"]
    blocks = store.pool.allocate(sum(present))  # PoolExhaustedError here changes nothing
    if blocks:
        store.k, store.v = _put_pages(
            store.k, store.v, jnp.asarray(blocks, jnp.int32), _as_pages(store.k, k_data), _as_pages(store.v, v_data)
        )
    it = iter(blocks)
    masked = np.zeros(len(meta["token_ids"]), bool)
    masked[meta["masked"]] = True
    state = ImportedKVState(
        tuple(meta["token_ids"]), masked, tuple((r, c) for r, c in meta["messages"]), meta["awaiting_reply"],
        meta["kv_len"], tuple(next(it) if p else -1 for p in present), stack,
    )
    try:
        _inject(state, seq)
    finally:
        store.pool.free(blocks)  # the sequence's reference is now the only one
    return state


def _read(engine: Engine, directory: Path, name: str) -> tuple[dict[str, Any], list[list[np.ndarray]], list[list[np.ndarray]]]:
    """The checked meta and the verified K/V pages of the snapshot in ``directory``."""
    try:
        lock = os.open(directory / _LOCK, os.O_RDONLY)
    except FileNotFoundError:
        if (directory / "meta.json").is_file():
            raise SnapshotError(
                f"snapshot {name!r} was written by an older zgen (before format {_READABLE_FORMATS[0]}); open it with that "
                "version, or save the context again"
            ) from None
        raise SnapshotError(
            f"no snapshot named {name!r} in {directory.parent}; save one with ctx.save({name!r}) (or set ZGEN_STORE_DIR)"
        ) from None
    except OSError as err:
        raise SnapshotError(f"cannot read snapshot {name!r} in {directory} ({err})") from err
    try:
        try:  # a crashed save's leftovers are removed when no one else holds the lock
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _remove_leftovers(directory, keep=_current_version(directory))
        except OSError:
            pass  # in use (or read-only): readers leave the leftovers to the next save
        fcntl.flock(lock, fcntl.LOCK_SH)  # a save in progress finishes first
        version = _current_version(directory)
        if version is None:
            raise SnapshotError(f"no snapshot named {name!r} in {directory.parent} (its first save never completed)")
        path = directory / version
        try:
            meta: object = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise _damaged(name, f"its meta.json is unreadable ({err})") from err
        checked = _checked_meta(meta, name, engine)
        k_data: list[list[np.ndarray]] = []
        v_data: list[list[np.ndarray]] = []
        if any(checked["present"]):
            try:
                tree = ocp.PyTreeCheckpointer().restore((path / "kv").absolute())
                k_data, v_data = tree["k"], tree["v"]
            except Exception as err:  # orbax raises many types for a damaged checkpoint
                raise _damaged(name, f"its K/V pages are unreadable ({type(err).__name__}: {err})") from err
            _check_pages(engine, name, k_data, v_data, sum(checked["present"]))
            for kind, data in (("k", k_data), ("v", v_data)):
                for layer, (pages, expected) in enumerate(zip(data, checked["pages_sha256"][kind], strict=True)):
                    if _digest(pages) != expected:
                        raise _damaged(name, f"the {kind.upper()} pages of layer {layer} do not match their checksum")
        return checked, k_data, v_data
    finally:
        os.close(lock)


def _checked_meta(meta: object, name: str, engine: Engine) -> dict[str, Any]:
    """``meta`` if it is an intact snapshot of this engine's model and page layout, else SnapshotError."""
    if not isinstance(meta, dict):
        raise _damaged(name, "its meta.json holds no object")
    fields = cast(dict[str, Any], meta)
    if fields.get("format") not in _READABLE_FORMATS:
        raise SnapshotError(
            f"snapshot {name!r} is not a zgen context snapshot of format {' or '.join(map(str, _READABLE_FORMATS))}; save it again"
        )
    recorded = fields.pop("meta_sha256", None)
    if recorded != _meta_digest(fields):
        raise _damaged(name, "its meta.json does not match its checksum")

    def need(key: str, kind: type, what: str) -> Any:
        value = fields.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise _damaged(name, f"meta.json field {key!r} should be {what}, found {value!r}"[:300])
        return value

    if need("model", str, "a string") != model_fingerprint(engine.model):
        raise SnapshotError(
            f"snapshot {name!r} was saved from a different model (or dtype) than this engine's; "
            "open it with the model that saved it"
        )
    if need("layout", dict, "an object") != _layout(engine):
        raise SnapshotError(
            f"snapshot {name!r} stores pages as {fields['layout']}, this engine uses {_layout(engine)}; "
            "open it with an Engine made with the same kv_dtype(...) and paged_kv(page_size=...) options"
        )
    tokens = need("token_ids", list, "a list of token ids")
    try:
        engine.check_ids(tokens)
    except TokenIdError as err:
        raise _damaged(name, f"meta.json field 'token_ids': {err}") from None
    if len(tokens) > engine.max_len:
        raise _damaged(name, f"it holds {len(tokens)} tokens, more than the model's context of {engine.max_len}")
    kv_len = need("kv_len", int, "an integer")
    if not 0 <= kv_len <= len(tokens):
        raise _damaged(name, f"kv_len {kv_len} is outside [0, {len(tokens)}]")
    masked = need("masked", list, "a list of positions")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens) for i in masked):
        raise _damaged(name, "meta.json field 'masked' names positions outside the tokens")
    messages = need("messages", list, "a list of [role, content] pairs")
    if not all(isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m) for m in messages):
        raise _damaged(name, "meta.json field 'messages' should be a list of [role, content] string pairs")
    need("awaiting_reply", bool, "true or false")
    present = need("present", list, "a list of booleans")
    pages = -(-kv_len // _store(engine).config.page_size)
    if len(present) != pages or not all(isinstance(p, bool) for p in present):
        raise _damaged(name, f"meta.json field 'present' should hold {pages} booleans, one per page")
    digests = need("pages_sha256", dict, "an object")
    layers = _store(engine).config.num_layers
    for kind in ("k", "v"):
        listed = digests.get(kind)
        if not isinstance(listed, list) or len(listed) != layers or not all(isinstance(d, str) for d in listed):
            raise _damaged(name, f"meta.json should hold {layers} {kind.upper()} page checksums")
    if fields["format"] == 3:
        fields["adapters"] = []  # saved before adapter stacks were
    for record in need("adapters", list, "a list of adapters"):
        if not _is_adapter_record(record):
            raise _damaged(name, f"meta.json field 'adapters' holds {record!r}, not a name, source, sha256 and scale"[:300])
    return fields


# -- adapter stacks ----------------------------------------------------------------------------------


def _adapter_record(adapter: LoraAdapter, scale: float) -> dict[str, Any]:
    source = None if adapter.source is None else str(adapter.source.resolve())
    return {"name": adapter.name, "source": source, "sha256": adapter_fingerprint(adapter), "scale": scale}


def _is_adapter_record(record: object) -> bool:
    if not isinstance(record, dict) or set(cast(dict[str, Any], record)) != {"name", "source", "sha256", "scale"}:
        return False
    fields = cast(dict[str, Any], record)
    scale = fields["scale"]
    return (
        isinstance(fields["name"], str) and isinstance(fields["source"], (str, type(None)))
        and isinstance(fields["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", fields["sha256"]) is not None
        and isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
    )


def _restore_adapters(
    records: list[dict[str, Any]], name: str, available: Seq[LoraAdapter]
) -> tuple[tuple[LoraAdapter, float], ...]:
    """The saved stack, each adapter the one of ``available`` with its fingerprint or else reloaded
    from its recorded directory; SnapshotError naming the first that is neither."""
    for adapter in available:
        if not isinstance(adapter, LoraAdapter):
            raise InputError(f"adapters= takes loaded adapters (zgen.load_adapter), got {type(adapter).__name__}")
    by_fingerprint = {adapter_fingerprint(a): a for a in available}
    stack: list[tuple[LoraAdapter, float]] = []
    for record in records:
        given = by_fingerprint.get(record["sha256"])
        stack.append((given if given is not None else _reload(record, name, available), float(record["scale"])))
    return tuple(stack)


def _reload(record: dict[str, Any], name: str, available: Seq[LoraAdapter]) -> LoraAdapter:
    what = f"snapshot {name!r} was saved with LoRA adapter {record['name']!r} (scale {record['scale']:g}) on its stack"
    fix = f"pass the adapter it was saved with: Context.open(model, {name!r}, adapters=[zgen.load_adapter(DIR)])"
    if any(a.name == record["name"] for a in available):
        raise SnapshotError(f"{what}, but the adapter given as {record['name']!r} has other weights (another fingerprint); {fix}")
    source = record["source"]
    if source is None:
        raise SnapshotError(f"{what}; it was not loaded from a directory, so it cannot be reloaded; {fix}")
    try:
        adapter = load_adapter(source, name=record["name"])
    except AdapterError as err:
        raise SnapshotError(f"{what}, loaded from {source}, which cannot be loaded now ({err}); {fix}") from None
    if adapter_fingerprint(adapter) != record["sha256"]:
        raise SnapshotError(f"{what}, loaded from {source}, but the files there now hold other weights; {fix}")
    return adapter


def _check_pages(engine: Engine, name: str, k_data: Any, v_data: Any, count: int) -> None:
    store = _store(engine)
    expected = [
        (tuple(leaf.shape[:1]) + (count,) + tuple(leaf.shape[2:]), leaf.dtype)
        for leaf in jax.tree_util.tree_leaves(jax.eval_shape(float_pages, store.k[0]))
    ]
    for data in (k_data, v_data):
        if not isinstance(data, list) or len(data) != store.config.num_layers:
            raise _damaged(name, f"it does not hold {store.config.num_layers} layers of pages")
        for layer in data:
            got = [(tuple(np.shape(x)), np.asarray(x).dtype) for x in layer]
            if got != expected:
                raise _damaged(name, f"its pages are shaped {got}, expected {expected}")


def _digest(arrays: list[np.ndarray]) -> str:
    """SHA-256 of the arrays' bytes, in order (one layer's K or V pages)."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _meta_digest(meta: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _locked(directory: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold the snapshot's lock file: writers exclusively (one save of a name at a time, threads of one
    process included), readers shared. The OS drops it if the process dies."""
    lock = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(lock)


def _current_version(directory: Path) -> str | None:
    try:
        version = (directory / _CURRENT).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        version = ""
    if not _VERSION.fullmatch(version) or not (directory / version).is_dir():
        raise _damaged(directory.name, f"its {_CURRENT} file names no saved version")
    return version


def _remove_leftovers(directory: Path, keep: str | None) -> None:
    """Delete what interrupted saves left: every version but ``keep`` and stray pointer files
    (callers hold the lock exclusively, so no save is writing them)."""
    for entry in directory.iterdir():
        if entry.name in (_LOCK, _CURRENT, keep):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` to disk, so a power loss after the switch to this
    version cannot leave it half written (a killed process needs no flush: the OS has the data)."""
    for folder, _, files in os.walk(root):
        for file in files:
            _fsync(Path(folder) / file)
        _fsync(Path(folder))


def _as_pages(like: tuple[KVPages, ...], data: list[list[np.ndarray]]) -> tuple[KVPages, ...]:
    treedef = jax.tree_util.tree_structure(jax.eval_shape(float_pages, like[0]))
    return tuple(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in layer]) for layer in data)


@partial(jax.jit, donate_argnums=(0, 1))
def _put_pages(
    k: tuple[KVPages, ...], v: tuple[KVPages, ...], blocks: jax.Array, k_new: tuple[KVPages, ...], v_new: tuple[KVPages, ...]
) -> tuple[tuple[KVPages, ...], tuple[KVPages, ...]]:
    def put(pages: KVPages, new: KVPages) -> KVPages:
        return jax.tree_util.tree_map(lambda leaf, x: leaf.at[:, blocks].set(x.astype(leaf.dtype)), pages, stored_like(pages, new))

    return tuple(map(put, k, k_new)), tuple(map(put, v, v_new))


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
