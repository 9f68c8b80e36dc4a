"""A loaded model: config, tokenizer, typed graph and device parameters — data, running nothing.

The runtime (:mod:`zgen.runtime`) compiles and runs it; this layer knows nothing about caches,
engines or front ends.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import mmap
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, TypeVar, cast

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from zgen.config import Llama3RopeScaling, ModelConfig
from zgen.errors import AdapterError, CheckpointError, ConfigError, ModelNotFoundError
from zgen.graph.core import Graph
from zgen.graph.decoder import build_decoder
from zgen.graph.quantize import quantize_linear_weights
from zgen.loading.builtin import BUILTIN_MODELS, builtin_model_path
from zgen.loading.gguf_file import config_from_gguf, header_extent, open_gguf, params_from_gguf
from zgen.loading.params import HostParams, check_values
from zgen.loading.safetensors_dir import config_from_dir, params_from_dir
from zgen.lora.adapter import LoraAdapter, check_adapter
from zgen.lora.merge import merged_weights
from zgen.quantized_weights import WEIGHT_FORMATS, QuantizedWeight, WeightQuantization
from zgen.sharding import check_tensor_parallel, shard_params
from zgen.tokenizer import Tokenizer

T = TypeVar("T")
DTYPES: dict[str, jnp.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
}
# `weights=` of load_model besides the WEIGHT_FORMATS: compute on a GGUF's own quantized tensors.
GGUF_WEIGHTS = "gguf"
WEIGHTS_CHOICES = (*WEIGHT_FORMATS, GGUF_WEIGHTS)
# Bump when the conversion of GGUF tensors to zgen's layout changes, so stale caches are ignored.
_CONVERSION_VERSION = 1
# Converted-weight cache keys hash this many evenly spaced blocks of a GGUF's tensor data.
_SAMPLED_BLOCKS, _SAMPLED_BLOCK_BYTES = 64, 1 << 16
# The code (under zgen/) that turns a GGUF's metadata into a config and a tokenizer: converted entries
# carry both, and are described again when this code changes.
_DESCRIPTION_SOURCES = ("config.py", "tokenizer.py", "loading/gguf_file.py")


@dataclass
class LoadTimings:
    source: str  # "gguf", "converted-cache" or "safetensors"
    read_s: float
    to_device_s: float


@dataclass(eq=False)  # compared by identity
class Model:
    config: ModelConfig
    tokenizer: Tokenizer
    graph: Graph
    params: dict[str, jax.Array | QuantizedWeight]
    dtype: jnp.dtype
    source: Path | None  # None for weights built in memory (benchmarks, tests)
    load_timings: LoadTimings
    # What higher layers derive from this model once and keep with it (its compiled steps, its key
    # calibration, the default engine of its contexts; see `attached`). The model never reads it.
    attachments: dict[str, object] = field(default_factory=lambda: {}, repr=False)
    # LoRA adapters every request of this model runs with (on top of its own), with their scales;
    # the runtime reads the stack when a request is submitted.
    adapters: list[tuple[LoraAdapter, float]] = field(default_factory=lambda: [], repr=False)
    merged_adapters: list[tuple[LoraAdapter, float]] = field(default_factory=lambda: [], repr=False)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        ids += [i for i in self.tokenizer.eos_ids if i not in ids]
        return tuple(ids)

    # The adapter stack changes this model in place rather than returning a view: the compiled
    # steps, engines and caches kept in `attachments` belong to this object, and a view would compile
    # everything again and be unseen by engines already serving the model. Requests already submitted
    # keep the stack they were submitted with.
    @property
    def split(self) -> bool:
        """Whether the weights are split over several devices (``tensor_parallel``)."""
        return any(isinstance(p, jax.Array) and len(p.sharding.device_set) > 1 for p in self.params.values())

    @property
    def mesh(self) -> Mesh | None:
        """The mesh a split model's weights lie on (:func:`zgen.sharding.tensor_parallel_mesh`); None on one device."""
        for p in self.params.values():
            sharding = p.sharding if isinstance(p, jax.Array) else None
            if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh) and len(sharding.device_set) > 1:
                return sharding.mesh
        return None

    def push_adapter(self, adapter: LoraAdapter, scale: float = 1.0) -> None:
        """Apply ``adapter`` (times ``scale``) to every later request, on top of those pushed before."""
        if self.split:  # its rows would need the shard-major layout of the split weights
            raise ConfigError("LoRA adapters on a model split with tensor_parallel are not available yet; load it on one device")
        check_adapter(adapter, self.config)
        self.adapters.append((adapter, float(scale)))

    def pop_adapter(self) -> LoraAdapter:
        """Take the last pushed adapter off the stack and return it."""
        if not self.adapters:
            raise AdapterError("no adapter was pushed on this model; nothing to pop")
        return self.adapters.pop()[0]

    def merge_adapter(self, adapter: LoraAdapter, scale: float = 1.0) -> None:
        """Add ``adapter``'s correction into the weights (no per-token cost after). K/V an engine of
        this model cached before (its prefix cache, contexts) were computed without it."""
        if self.split:
            raise ConfigError("LoRA adapters on a model split with tensor_parallel are not available yet; merge before splitting")
        self.params.update(merged_weights(self._float_params(), self.config, adapter, scale))
        self.merged_adapters.append((adapter, float(scale)))

    def unmerge_adapter(self, adapter: LoraAdapter | None = None) -> LoraAdapter:
        """Subtract a merged adapter (default: the last merged) from the weights again; exact up to
        rounding in the model's dtype."""
        index = next((i for i in reversed(range(len(self.merged_adapters))) if adapter in (None, self.merged_adapters[i][0])), None)
        if index is None:
            raise AdapterError("that adapter is not merged into this model" if adapter else "no adapter is merged into this model")
        merged, scale = self.merged_adapters.pop(index)
        self.params.update(merged_weights(self._float_params(), self.config, merged, -scale))
        return merged

    def _float_params(self) -> dict[str, jax.Array]:
        """The parameters, all float: an adapter cannot be merged into quantized weights."""
        if any(isinstance(value, QuantizedWeight) for value in self.params.values()):
            raise AdapterError(
                "this model's linear weights are quantized, and an adapter merged into them would be rounded away; "
                "apply it per request (adapter=...) or with push_adapter, which keep it in float"
            )
        return cast(dict[str, jax.Array], self.params)


def attached(model: Model, name: str, make: Callable[[], T]) -> T:
    """``make()`` computed once per model and kept with it under ``name`` (``Model.attachments``)."""
    if name not in model.attachments:
        model.attachments[name] = make()
    return cast(T, model.attachments[name])


def default_cache_dir() -> Path:
    base = os.environ.get("ZGEN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zgen"
    return Path(base)


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    text = str(name_or_path)
    if text in BUILTIN_MODELS:
        return builtin_model_path(text)
    path = Path(text).expanduser()
    try:
        if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
            return path
        exists = path.exists()
    except OSError as err:  # a name too long for the file system, a directory we may not read, ...
        raise ModelNotFoundError(f"cannot look at {text[:200]!r} as a model path: {err.strerror}") from None
    if exists:
        raise ModelNotFoundError(f"{path} is neither an HF model directory nor a .gguf file")
    raise ModelNotFoundError(
        f"no model {text!r}: give a built-in name ({', '.join(BUILTIN_MODELS)}), an HF model directory "
        "or a .gguf file"
    )


def load_model(
    name_or_path: str | os.PathLike[str] = "smollm2",
    *,
    dtype: str = "float32",
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
    tensor_parallel: int = 1,
    weights: str | WeightQuantization | None = None,
) -> Model:
    """Load a model by built-in name (``"smollm2"``), HF directory or GGUF file.

    ``tensor_parallel=N`` splits the weights over N local devices (attention heads and MLP columns,
    :mod:`zgen.sharding`); every front end then runs the model across them.

    GGUF weights are dequantized once and cached as float32 safetensors under ``cache_dir``
    (default ``$ZGEN_CACHE_DIR`` or ``~/.cache/zgen``) so later loads skip the dequantization.
    ``progress(done, total)`` hears the bytes of GGUF tensors dequantized so far, when that happens.

    ``weights`` picks how the linear layers' weights (q/k/v/o, gate/up/down) are held: None in
    ``dtype``; ``"int8"`` / ``"int4"`` (or a :class:`~zgen.quantized_weights.WeightQuantization`)
    quantized at load; ``"gguf"`` a GGUF file's own Q8_0/Q4_0/Q4_1/Q4_K blocks, computed on directly.
    Embeddings and norms stay in ``dtype``; the LM head too, except that ``"int8"`` and ``"int4"``
    hold an untied one in int8 (``WeightQuantization.head_bits``).
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    scheme = weight_scheme(weights)
    path = resolve_model(name_or_path)
    if scheme == GGUF_WEIGHTS and path.is_dir():
        raise ConfigError(
            f"weights='gguf' computes on a GGUF file's own quantized tensors, and {path} is an HF directory; "
            "quantize it at load with weights='int8' or 'int4'"
        )
    start = time.perf_counter()
    # The config is checked against the weights' tensor names before a tensor is read, and the graph
    # is built from it only once the weights are in hand, so a corrupt header drives no allocation.
    described = str(path)
    if path.is_dir():
        config = config_from_dir(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        host = params_from_dir(path, config)
        source = "safetensors"
    else:
        cache = cache_dir or default_cache_dir()
        if scheme == GGUF_WEIGHTS:
            # Repacking blocks is cheap and reads no floats: nothing to cache.
            reader = open_gguf(path)
            config, tokenizer = config_from_gguf(reader, path), Tokenizer.from_gguf(reader)
            reading = reader if progress is None else _reporting_reader(reader, progress)
            host, source = params_from_gguf(reading, config, path, keep_quantized=True), "gguf"
        else:
            config, tokenizer, host, source = _gguf_cached(path, cache, progress)
        if source == "converted-cache":
            described = f"{path} (read from its converted copy under {cache / 'converted'}; delete that to convert again)"
    _check_special_ids(config, tokenizer, described)
    if tensor_parallel != 1:
        check_tensor_parallel(config, tensor_parallel)
        if scheme is not None:
            raise ConfigError("quantized weights and tensor_parallel together are not available yet; load float weights to split them")
    jdtype = DTYPES[dtype]
    graph = build_decoder(config, shards=tensor_parallel)
    check_params(graph, host, described, jdtype)
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    params: dict[str, jax.Array | QuantizedWeight]
    if isinstance(scheme, WeightQuantization):
        params = quantize_linear_weights(graph, host, scheme, jdtype)
    elif tensor_parallel != 1:  # each device receives only its shards
        params = {**shard_params({name: np.asarray(value, dtype=jdtype) for name, value in host.items()}, config, tensor_parallel)}
    else:
        params = {name: _to_device(value, jdtype) for name, value in host.items()}
    jax.block_until_ready(params)
    timings = LoadTimings(source, read_s, time.perf_counter() - start)
    return Model(config, tokenizer, graph, params, jdtype, path, timings)


def split_model(model: Model, tensor_parallel: int, devices: Sequence[Any] | None = None) -> Model:
    """``model`` with its weights split over ``tensor_parallel`` local devices (``devices``, default the
    first ones; :mod:`zgen.sharding`), as ``load_model(..., tensor_parallel=N)`` loads it."""
    if any(isinstance(value, QuantizedWeight) for value in model.params.values()):
        raise ConfigError("quantized weights and tensor_parallel together are not available yet; split a float model")
    params = shard_params(model.params, model.config, tensor_parallel, devices)
    return replace(model, graph=build_decoder(model.config, shards=tensor_parallel), params=params, attachments={})


def weight_scheme(weights: str | WeightQuantization | None) -> WeightQuantization | str | None:
    """``load_model``'s ``weights=`` checked: a quantization, ``"gguf"`` or None (ConfigError otherwise)."""
    if weights is None or isinstance(weights, WeightQuantization) or weights == GGUF_WEIGHTS:
        return weights
    if isinstance(weights, str) and weights in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[weights]
    raise ConfigError(f"weights={weights!r} is not supported; choose one of {', '.join(WEIGHTS_CHOICES)} (or None)")


def quantize_model(model: Model, weights: str | WeightQuantization) -> Model:
    """A copy of ``model`` whose linear weights are quantized (``"int8"``, ``"int4"`` or a
    :class:`~zgen.quantized_weights.WeightQuantization`) from its current ones; for random weights
    (benchmarks) and models already in memory."""
    scheme = weight_scheme(weights)
    if not isinstance(scheme, WeightQuantization):
        raise ConfigError(f"quantize_model takes 'int8', 'int4' or a WeightQuantization, not {weights!r}")
    if any(isinstance(value, QuantizedWeight) for value in model.params.values()):
        raise ConfigError("the model's weights are already quantized; quantize a float model")
    params = quantize_linear_weights(model.graph, model.params, scheme, model.dtype)
    # Its own compiled steps and adapter stacks; pushed adapters carry over, merged ones stay in the weights.
    return replace(model, params=params, attachments={}, adapters=list(model.adapters), merged_adapters=[])


def _to_device(value: np.ndarray | QuantizedWeight, dtype: jnp.dtype) -> jax.Array | QuantizedWeight:
    if isinstance(value, QuantizedWeight):
        return jax.tree.map(jnp.asarray, value)  # codes and scales keep their stored dtypes
    return jnp.asarray(value, dtype=dtype)


def random_model(config: ModelConfig, *, dtype: str = "bfloat16", seed: int = 0) -> Model:
    """A model of ``config``'s shape with random weights and a word-level placeholder tokenizer
    (``"t0" .. "t{vocab-1}"``): for speed runs where no checkpoint is present, like HF's ``from_config``.

    Matrices are drawn with standard deviation ``fan_in ** -0.5``, vectors (norm weights) are 1-ish,
    so activations stay in range and decode paths do realistic work.
    """
    import tokenizers
    from tokenizers.models import WordLevel

    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    graph = build_decoder(config)
    key = jax.random.key(seed)
    params: dict[str, jax.Array | QuantizedWeight] = {}
    for i, (name, dims) in enumerate(sorted(graph.param_shapes().items())):
        scale = 1.0 if len(dims) == 1 else dims[-1] ** -0.5
        params[name] = (scale * jax.random.normal(jax.random.fold_in(key, i), dims, jnp.float32)).astype(DTYPES[dtype])
    vocab = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    tokenizer = Tokenizer(backend=vocab, bos_id=None, eos_ids=tuple(config.eos_token_ids))
    return Model(config, tokenizer, graph, params, DTYPES[dtype], source=None, load_timings=LoadTimings("random", 0.0, 0.0))


def check_params(graph: Graph, params: Mapping[str, np.ndarray | QuantizedWeight], source: str, dtype: jnp.dtype = DTYPES["float32"]) -> None:
    """Every parameter the graph reads exists with the shape its node declares and holds only numbers
    ``dtype`` can represent (finite, within its range).

    GGUF and safetensors carry no checksum: damage that leaves the values finite is not detected here
    (README, "Guarantees").
    """
    for name, shape in graph.param_shapes().items():
        value = params.get(name)
        if value is None:
            raise CheckpointError(f"{source} lacks parameter {name!r}")
        if isinstance(value, QuantizedWeight):
            if value.shape != shape:
                raise CheckpointError(
                    f"{source}: quantized parameter {name!r} stands for shape {value.shape} but the graph node "
                    f"reading it expects {shape}; the config and the weights disagree"
                )
            continue  # its scales were checked as they were read
        if tuple(value.shape) != shape:
            raise CheckpointError(
                f"{source}: parameter {name!r} has shape {tuple(value.shape)} but the graph node reading it "
                f"expects {shape}; the config and the weights disagree"
            )
        check_values(value, f"{source}: parameter {name!r}", dtype)


def _check_special_ids(config: ModelConfig, tokenizer: Tokenizer, source: str) -> None:
    """The tokenizer's BOS/EOS ids are rows of the model's embedding (the config's own are checked by
    ModelConfig), so generation never stops on, or feeds, an id the model cannot compute on."""
    for token in (*tokenizer.eos_ids, *([] if tokenizer.bos_id is None else [tokenizer.bos_id])):
        if not 0 <= token < config.vocab_size:
            raise CheckpointError(
                f"{source}: the tokenizer's special token id {token} is outside the model's vocabulary of "
                f"{config.vocab_size}; the tokenizer does not belong to these weights"
            )


def _gguf_cached(
    path: Path, cache_dir: Path, progress: Callable[[int, int], None] | None
) -> tuple[ModelConfig, Tokenizer, HostParams, str]:
    """A GGUF's config, tokenizer and parameters from the converted-weight cache, or read from the
    file (its parameters dequantized) and cached there.

    Entries are keyed by content (:func:`_content_key`), so a reinstalled or copied file finds its
    entry, and carry the config and tokenizer in their metadata (:func:`_description`): a hit never
    parses the GGUF's metadata (its 49k-token vocabulary and merges took 2.5-5 s of every SmolLM2
    load). A new entry replaces the entries of other files of the same name (an updated download), so
    the cache keeps one conversion per model file name.
    """
    data_offset = header_extent(path)  # refuses a header that runs past the end of the file
    directory = cache_dir / "converted"
    cached = None if data_offset is None else directory / f"{path.stem}-{_content_key(path, data_offset)[:16]}.safetensors"
    entry = None if cached is None else _read_entry(cached)
    described = None if entry is None else _described(entry[1])
    if entry is not None and described is not None:
        return *described, entry[0], "converted-cache"
    reader = open_gguf(path)
    config, tokenizer = config_from_gguf(reader, path), Tokenizer.from_gguf(reader)
    if entry is not None and cached is not None:  # weights of this file, described by other code: describe them again
        _write_atomically(cached, entry[0], _description(config, tokenizer))
        return config, tokenizer, entry[0], "converted-cache"
    params = params_from_gguf(reader if progress is None else _reporting_reader(reader, progress), config, path)
    if cached is not None and _write_atomically(cached, params, _description(config, tokenizer)):
        for other in directory.glob(f"{glob.escape(path.stem)}-{'[0-9a-f]' * 16}.safetensors"):
            if other != cached:
                other.unlink(missing_ok=True)
    return config, tokenizer, params, "gguf"


def _read_entry(cached: Path) -> tuple[HostParams, dict[str, str]] | None:
    """A converted entry's parameters and metadata; None when absent. A damaged entry is removed (it is
    rebuilt, never trusted)."""
    if not cached.exists():
        return None
    try:
        with safe_open(str(cached), framework="np") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}, dict(handle.metadata() or {})
    except Exception:
        cached.unlink(missing_ok=True)
        return None


def _description_version() -> str:
    """A digest of the code that builds a GGUF's config and tokenizer (zgen's, and the versions of the
    packages it calls): entries described by other code are described again."""
    root = Path(__file__).parent
    digest = hashlib.sha256(f"gguf {package_version('gguf')} tokenizers {package_version('tokenizers')}".encode())
    for source in _DESCRIPTION_SOURCES:
        digest.update((root / source).read_bytes())
    return digest.hexdigest()


def _description(config: ModelConfig, tokenizer: Tokenizer) -> dict[str, str]:
    """The metadata a converted entry carries: the model's config and tokenizer."""
    settings = {"bos_id": tokenizer.bos_id, "eos_ids": list(tokenizer.eos_ids), "chat_template": tokenizer.chat_template, "add_bos": tokenizer.add_bos}
    return {
        "zgen.description": _description_version(),
        "zgen.config": json.dumps(asdict(config)),
        "zgen.tokenizer": tokenizer.backend.to_str(),
        "zgen.tokenizer_settings": json.dumps(settings),
    }


def _described(metadata: Mapping[str, str]) -> tuple[ModelConfig, Tokenizer] | None:
    """The config and tokenizer of an entry's metadata; None for entries described by other code (or
    by none)."""
    if metadata.get("zgen.description") != _description_version():
        return None
    try:
        fields = json.loads(metadata["zgen.config"])
        scaling = fields["rope_scaling"]
        fields.update(rope_scaling=None if scaling is None else Llama3RopeScaling(**scaling), eos_token_ids=tuple(fields["eos_token_ids"]))
        settings = json.loads(metadata["zgen.tokenizer_settings"])
        backend = tokenizers.Tokenizer.from_str(metadata["zgen.tokenizer"])
        tokenizer = Tokenizer(backend, settings["bos_id"], tuple(settings["eos_ids"]), settings["chat_template"], settings["add_bos"])
        return ModelConfig(**fields), tokenizer
    except Exception:  # a damaged description is built again from the file, never trusted
        return None


def _content_key(path: Path, data_offset: int) -> str:
    """A digest of the file's size, its header (metadata and the tensor index: every tensor's name,
    type, shape and offset; ``data_offset`` bytes) and evenly spaced blocks of its tensor data. Cheap
    on files of many GB; a re-quantized or re-exported file changes it. (An edit that keeps every type
    and shape and misses every sampled block would not: ``zgen cache clear --weights`` then.)"""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        size = len(data)
        digest = hashlib.sha256(f"{_CONVERSION_VERSION}|{size}".encode())
        digest.update(data[:data_offset])
        for offset in range(data_offset, size, max((size - data_offset) // _SAMPLED_BLOCKS, 1)):
            digest.update(data[offset : offset + _SAMPLED_BLOCK_BYTES])
    return digest.hexdigest()


def _reporting_reader(reader: gguf.GGUFReader, progress: Callable[[int, int], None]) -> gguf.GGUFReader:
    """A copy of ``reader`` whose tensor list tells ``progress`` the bytes walked so far, as the
    converter dequantizes tensors in list order."""
    tensors = list(reader.tensors)
    total = sum(int(t.n_bytes) for t in tensors)

    class ReportingTensors(list[gguf.ReaderTensor]):
        def __iter__(self) -> Iterator[gguf.ReaderTensor]:
            done = 0
            progress(done, total)
            for tensor in tensors:
                yield tensor
                done += int(tensor.n_bytes)
                progress(done, total)

    reporting = copy.copy(reader)
    reporting.tensors = ReportingTensors(tensors)
    return reporting


def _write_atomically(target: Path, params: HostParams, metadata: dict[str, str]) -> bool:
    """Write ``params`` (and ``metadata``) to ``target`` through a temporary file; False when the
    directory refused."""
    partial = target.with_suffix(f".partial-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: np.ascontiguousarray(v) for k, v in params.items()}, partial, metadata=metadata)
        os.replace(partial, target)
    except OSError:
        # A read-only or full cache directory only costs speed on the next load.
        partial.unlink(missing_ok=True)
        return False
    return True
