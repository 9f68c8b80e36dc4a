"""A loaded model: config, tokenizer, typed graph and device parameters — data, running nothing.

The runtime (:mod:`zgen.runtime`) compiles and runs it; this layer knows nothing about caches,
engines or front ends.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, cast

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from zgen.config import ModelConfig
from zgen.errors import CheckpointError, ConfigError, ModelNotFoundError
from zgen.graph.core import Graph
from zgen.graph.decoder import build_decoder
from zgen.loading.builtin import BUILTIN_MODELS, builtin_model_path
from zgen.loading.gguf_file import config_from_gguf, open_gguf, params_from_gguf
from zgen.loading.params import HostParams
from zgen.loading.safetensors_dir import config_from_dir, params_from_dir
from zgen.tokenizer import Tokenizer

T = TypeVar("T")
DTYPES: dict[str, jnp.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
}
# Bump when the conversion of GGUF tensors to zgen's layout changes, so stale caches are ignored.
_CONVERSION_VERSION = 1


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
    params: dict[str, jax.Array]
    dtype: jnp.dtype
    source: Path | None  # None for weights built in memory (benchmarks, tests)
    load_timings: LoadTimings
    # What higher layers derive from this model once and keep with it (its compiled steps, its key
    # calibration, the default engine of its contexts; see `attached`). The model never reads it.
    attachments: dict[str, object] = field(default_factory=lambda: {}, repr=False)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        ids += [i for i in self.tokenizer.eos_ids if i not in ids]
        return tuple(ids)


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
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
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
) -> Model:
    """Load a model by built-in name (``"smollm2"``), HF directory or GGUF file.

    GGUF weights are dequantized once and cached as float32 safetensors under ``cache_dir``
    (default ``$ZGEN_CACHE_DIR`` or ``~/.cache/zgen``) so later loads skip the dequantization.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    path = resolve_model(name_or_path)
    start = time.perf_counter()
    if path.is_dir():
        config = config_from_dir(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        graph = build_decoder(config)
        host = params_from_dir(path, config)
        source = "safetensors"
    else:
        reader = open_gguf(path)
        config = config_from_gguf(reader, path)
        tokenizer = Tokenizer.from_gguf(reader)
        graph = build_decoder(config)
        host, source = _gguf_params_cached(reader, config, path, cache_dir or default_cache_dir())
    check_params(graph, host, str(path))
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    jdtype = DTYPES[dtype]
    params = {name: jnp.asarray(value, dtype=jdtype) for name, value in host.items()}
    jax.block_until_ready(params)
    timings = LoadTimings(source, read_s, time.perf_counter() - start)
    return Model(config, tokenizer, graph, params, jdtype, path, timings)


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
    params: dict[str, jax.Array] = {}
    for i, (name, dims) in enumerate(sorted(graph.param_shapes().items())):
        scale = 1.0 if len(dims) == 1 else dims[-1] ** -0.5
        params[name] = (scale * jax.random.normal(jax.random.fold_in(key, i), dims, jnp.float32)).astype(DTYPES[dtype])
    vocab = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    tokenizer = Tokenizer(backend=vocab, bos_id=None, eos_ids=tuple(config.eos_token_ids))
    return Model(config, tokenizer, graph, params, DTYPES[dtype], source=None, load_timings=LoadTimings("random", 0.0, 0.0))


def check_params(graph: Graph, params: HostParams, source: str) -> None:
    """Every parameter the graph reads exists with the shape its node declares."""
    for name, shape in graph.param_shapes().items():
        value = params.get(name)
        if value is None:
            raise CheckpointError(f"{source} lacks parameter {name!r}")
        if tuple(value.shape) != shape:
            raise CheckpointError(
                f"{source}: parameter {name!r} has shape {tuple(value.shape)} but the graph node reading it "
                f"expects {shape}; the config and the weights disagree"
            )


def _gguf_params_cached(reader: gguf.GGUFReader, config: ModelConfig, path: Path, cache_dir: Path) -> tuple[HostParams, str]:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_CONVERSION_VERSION}".encode()).hexdigest()
    cached = cache_dir / "converted" / f"{path.stem}-{key[:16]}.safetensors"
    if cached.exists():
        try:
            return load_file(cached), "converted-cache"
        except Exception:  # a damaged cache entry is rebuilt, never trusted
            cached.unlink(missing_ok=True)
    params = params_from_gguf(reader, config, path)
    _write_atomically(cached, params)
    return params, "gguf"


def _write_atomically(target: Path, params: HostParams) -> None:
    partial = target.with_suffix(f".partial-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: np.ascontiguousarray(v) for k, v in params.items()}, partial)
        os.replace(partial, target)
    except OSError:
        # A read-only or full cache directory only costs speed on the next load.
        partial.unlink(missing_ok=True)
