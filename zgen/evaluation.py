"""Perplexity of a model over a text, with the KV cache in the loop — a front end of the engine.

Method (the one ``docs/kv_quantization.md`` reports): the text's tokens are cut into
non-overlapping windows of ``window`` tokens; each window is one sequence starting from an empty
cache, no BOS is added, and every token after the first in a window is scored. The engine feeds a
window ``chunk`` tokens per step (its ``prefill_chunk``), so attention to earlier chunks reads what the
cache stored (quantized or compressed, for lossy kinds); ``chunk=1`` is pure decode. All windows are
submitted at once and batched by the engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zgen.cache.factory import CacheOption
from zgen.errors import InputError
from zgen.model import Model
from zgen.pallas.paged_attention.layouts import KeyCalibration
from zgen.runtime.engine import Engine, EngineConfig, ForwardRequest

MAX_TEXT_BYTES = 64 * 2**20  # the most read_text_file reads by default


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens_scored: int
    windows: int


def perplexity(
    model: Model,
    token_ids: Sequence[int],
    *cache: CacheOption,
    window: int,
    chunk: int,
    batch_size: int = 8,
    key_calibration: Sequence[KeyCalibration] | None = None,
) -> PerplexityResult:
    """Perplexity of ``token_ids`` in windows of ``window`` fed ``chunk`` tokens at a time through the
    cache the options describe (default: the dense tensor cache; ``key_calibration`` as for
    :class:`~zgen.runtime.engine.Engine`)."""
    for name, value, least in (("window", window, 2), ("chunk", chunk, 1), ("batch_size", batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputError(f"{name} must be an integer >= {least}, got {value!r}")
    context = model.config.max_position_embeddings
    if window > context:
        raise InputError(f"window={window} is longer than the model's context of {context} tokens; use --window <= {context}")
    # A step's activations grow with the chunk (attention scores with chunk x window): a chunk beyond
    # the window would only ask for memory, never feed more tokens.
    if chunk > window:
        raise InputError(f"chunk={chunk} is larger than window={window}; a window is fed at most whole: use chunk <= window")
    windows = [list(token_ids[i : i + window]) for i in range(0, len(token_ids) - 1, window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise InputError(f"the text has {len(token_ids)} tokens; at least 2 are needed to score one")
    config = EngineConfig(max_batch=batch_size, prefill_chunk=chunk, on_pool_exhausted="wait")
    engine = Engine(model, *cache, config=config, default_kind="tensor", key_calibration=key_calibration)
    try:
        sequences = [engine.new_sequence(engine.check_ids(w)) for w in windows]
        # Logits after every token but the last, which nothing follows.
        jobs = [engine.submit(seq, ForwardRequest(end=len(w), logits_at=tuple(range(len(w) - 1)))) for seq, w in zip(sequences, windows, strict=True)]
        total, scored = 0.0, 0
        for seq, job, ids in zip(sequences, jobs, windows, strict=True):
            logits = engine.wait(job).logits
            engine.release(seq)  # its row goes to the next window
            for position in range(len(ids) - 1):
                row = logits[position].astype(np.float64)
                total -= float(row[ids[position + 1]] - np.logaddexp.reduce(row))
                scored += 1
    finally:
        engine.close()
    mean = total / scored
    return PerplexityResult(ppl=math.exp(mean), nll=mean, tokens_scored=scored, windows=len(windows))


def read_text_file(path: Path, *, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a file to score, read in pieces and at most ``max_bytes`` (64 MiB by
    default), so a binary file, a device such as ``/dev/zero`` or an endless pipe is refused with an
    :class:`~zgen.errors.InputError` instead of being read until memory runs out."""
    pieces: list[bytes] = []
    size = 0
    try:
        with open(path, "rb") as file:
            while piece := file.read(1 << 20):
                if b"\0" in piece:
                    raise InputError(f"{path} holds NUL bytes: it is a binary file, not text; give a UTF-8 text file")
                size += len(piece)
                if size > max_bytes:
                    raise InputError(
                        f"{path} is larger than {max_bytes} bytes, the most read for scoring; score a shorter excerpt"
                    )
                pieces.append(piece)
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror or err}") from None
    data = b"".join(pieces)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{path} is not UTF-8 text (byte {err.start} is {data[err.start : err.start + 1]!r}); convert it, e.g. "
            "with iconv -t UTF-8"
        ) from None
