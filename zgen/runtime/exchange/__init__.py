"""A mailbox between a compiled loop on the GPU and a host thread, with no Python in the loop.

:func:`send` copies an int32 payload and a sequence number into pinned host memory; :func:`receive`
makes the device's stream wait until the host has answered, then copies the answer in. Both are XLA
FFI calls (``exchange.cc``) that only enqueue copies and stream memory operations on XLA's stream, so
the host thread that runs the loop never waits for them, where a Python callback (``io_callback``)
synchronises with the device, copies its operands and enters Python on every call. They are ordered by
data alone (a send returns a ticket the next receive takes), not declared side-effecting: an effect
sends every call of the loop through jax's Python dispatch, whose handling of a 30-layer model's ~300
arguments delayed the loop's first draw by ~1.2 ms (SmolLM2's shape, NVIDIA H200). The host side is
a :class:`Channel`: :meth:`Channel.wait` returns when the device has sent, :meth:`Channel.answer`
lets its receive go on.

The library is compiled on first use from ``exchange.cc`` with the system's C++ compiler (``$CXX``,
else ``c++``) and XLA's FFI headers, into zgen's cache directory; it needs the CUDA driver only at run
time. :func:`available` says whether this process can use it (a CUDA GPU, a compiler).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from zgen.errors import ExchangeUnavailableError

__all__ = ["Channel", "available", "receive", "send"]

_SOURCE = Path(__file__).with_name("exchange.cc")


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("ZGEN_EXCHANGE_DIR", root / "zgen" / "exchange"))


@functools.cache
def _library() -> ctypes.CDLL:
    """The compiled exchange (built once per source and jaxlib version), its FFI targets registered."""
    from jaxlib.version import __version__ as jaxlib_version

    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(source + jaxlib_version.encode()).hexdigest()[:16]
    path = _cache_dir() / f"zgen_exchange_{tag}.so"
    if not path.exists():
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            raise ExchangeUnavailableError("no C++ compiler found (set CXX): the GPU grammar exchange cannot be built")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            command = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}",
                       str(_SOURCE), "-o", str(built), "-ldl"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise ExchangeUnavailableError(f"building the exchange failed: {done.stderr.strip()[-2000:]}")
            built.replace(path)  # atomic: a concurrent build leaves one whole library
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise ExchangeUnavailableError(f"the built exchange cannot be loaded: {err}") from None
    lib.zgen_exchange_open.restype = ctypes.c_int64
    lib.zgen_exchange_open.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
    for name in ("zgen_exchange_inbox", "zgen_exchange_outbox"):
        getattr(lib, name).restype = ctypes.POINTER(ctypes.c_int32)
        getattr(lib, name).argtypes = [ctypes.c_int64]
    lib.zgen_exchange_wait.restype = ctypes.c_uint32
    lib.zgen_exchange_wait.argtypes = [ctypes.c_int64, ctypes.c_uint32, ctypes.c_double]
    lib.zgen_exchange_ready.argtypes = [ctypes.c_int64]
    lib.zgen_exchange_wake.argtypes = [ctypes.c_int64]
    lib.zgen_exchange_reset.argtypes = [ctypes.c_int64, ctypes.c_uint32]
    jax.ffi.register_ffi_target("zgen_exchange_send", jax.ffi.pycapsule(lib.ZgenExchangeSend), platform="CUDA")
    jax.ffi.register_ffi_target("zgen_exchange_receive", jax.ffi.pycapsule(lib.ZgenExchangeReceive), platform="CUDA")
    return lib


@functools.cache
def available() -> bool:
    """Whether loops on this process's default device can use the exchange: a GPU whose CUDA driver
    gives a channel, and a built library (checked once, with a probe channel)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        Channel(1, 1)
    except ExchangeUnavailableError:
        return False
    return True


class Channel:
    """Pinned host memory for one loop's traffic on the default device: an inbox of ``inbox_words``
    int32 values the device sends, an outbox of ``outbox_words`` it receives."""

    def __init__(self, inbox_words: int, outbox_words: int) -> None:
        self._lib = _library()
        error = ctypes.create_string_buffer(512)
        ordinal = jax.devices()[0].local_hardware_id or 0  # the device jit places the loop on
        self.id = int(self._lib.zgen_exchange_open(ordinal, inbox_words, outbox_words, error, len(error)))
        if self.id < 0:
            raise ExchangeUnavailableError(f"the exchange channel could not be opened: {error.value.decode()}")
        self.inbox = np.ctypeslib.as_array(self._lib.zgen_exchange_inbox(self.id), (inbox_words,))
        self.outbox = np.ctypeslib.as_array(self._lib.zgen_exchange_outbox(self.id), (outbox_words,))

    def reset(self, sequence: int = 0) -> None:
        """Before a loop: no answer pending, and ``sequence`` as the last number sent."""
        self._lib.zgen_exchange_reset(self.id, sequence)

    def wait(self, last: int, timeout_s: float) -> int:
        """The next sequence number the device sent after ``last`` (its payload is in :attr:`inbox`),
        or ``last`` if none came within ``timeout_s`` seconds or :meth:`wake` was called. Releases the
        GIL while it waits."""
        return int(self._lib.zgen_exchange_wait(self.id, last, timeout_s))

    def wake(self) -> None:
        """End the current (or next) :meth:`wait` at once."""
        self._lib.zgen_exchange_wake(self.id)

    def answer(self) -> None:
        """:attr:`outbox` holds the answer: the device's waiting :func:`receive` goes on."""
        self._lib.zgen_exchange_ready(self.id)


def send(channel: Channel, payload: Int[Array, " N"], sequence: Int[Array, ""]) -> Int[Array, ""]:
    """On the device: hand ``payload`` (int32, at most the inbox) and then ``sequence`` to the host.
    Returns a ticket (its value means nothing) for the :func:`receive` that must follow this send."""
    call = jax.ffi.ffi_call("zgen_exchange_send", jax.ShapeDtypeStruct((), jnp.int32))
    return call(payload.astype(jnp.int32), sequence.astype(jnp.uint32), channel=np.int64(channel.id))


def receive(channel: Channel, after: Array, ticket: Int[Array, ""], shape: tuple[int, ...]) -> Int[Array, "..."]:
    """On the device, once ``after`` is computed and the send that gave ``ticket`` is done: wait for
    the host's answer, then take ``shape`` int32 values of the outbox."""
    call = jax.ffi.ffi_call("zgen_exchange_receive", jax.ShapeDtypeStruct(shape, jnp.int32))
    return call(after, ticket, channel=np.int64(channel.id))
