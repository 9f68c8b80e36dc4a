"""The one table of KV storage formats: what each ``kv_dtype`` stores, what it costs, who can hold it.

A format is registered here once, in :data:`FORMATS`, and everything else asks this table: the paged
state (how to quantize a written token, whether it is coded), the block pool (bytes per token), the
KV factory (which cache kinds may hold it) and the CLI (the list of names).

==========  =====================  =====================================================  ===========
name        cache kinds            what a token's head vector becomes                     coded
==========  =====================  =====================================================  ===========
fp32        every kind             float32 array                                          no
bf16        every kind             bfloat16 array                                         no
fp16        every kind             float16 array                                          no
fp8         paged, tiered          E4M3 values + f32 scale per token (``Fp8Pages``)       no
q4          paged, tiered          4-bit groups, bf16 scale and min (``Q4Pages``)         yes
q3          paged, tiered          3 bit-planes into 8 levels, bf16 scale (``Q3Pages``)   yes
==========  =====================  =====================================================  ===========

Plain formats are arrays of a float dtype, so the dense and compressed caches can hold them too;
the others are page layouts (:mod:`zgen.pallas.paged_attention.layouts`) that only the paged kernels
read. Coded formats write keys and values through a coding fitted to the model (a
:class:`~zgen.pallas.paged_attention.layouts.KeyCalibration` per layer; see
:class:`~zgen.cache.paged_state.PagedKVState`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from zgen.errors import ConfigError
from zgen.pallas.common import platform
from zgen.pallas.paged_attention.layouts import (
    Fp8Pages,
    KVPages,
    Q3Pages,
    Q4Pages,
    as_bits,
    q4_group_size,
    quantize_fp8,
    quantize_q3,
    quantize_q4,
)

Q3_GROUP = 16


def q3_group_size(head_dim: int) -> int:
    """Dims per Q3 scale: 16, or the least multiple of head_dim/8 (a bit-plane block) that divides head_dim."""
    group = math.lcm(Q3_GROUP, head_dim // 8)
    return group if head_dim % group == 0 else head_dim


@dataclass(frozen=True)
class KVFormat:
    """One storage format of K/V (see the module docstring)."""

    name: str
    float_dtype: jnp.dtype | None  # plain formats: the array dtype; None: a page layout
    coded: bool  # written through the model's key calibration and a Hadamard rotation
    empty: Callable[[tuple[int, int, int], int], KVPages]  # (kv_heads, pages, page_size), head_dim -> zeros
    quantize: Callable[[Float[Array, "*lead D"]], KVPages]  # head vectors [..., D], each token on its own
    head_dim_rule: Callable[[int], str | None] = lambda head_dim: None  # why this head_dim cannot be stored

    @property
    def plain(self) -> bool:
        """A float array: any cache kind can hold it."""
        return self.float_dtype is not None

    def check(self, head_dim: int) -> None:
        why = self.head_dim_rule(head_dim)
        if why is not None:
            raise ConfigError(f"kv_dtype {self.name!r} {why}, got head_dim {head_dim}")

    def bytes_per_token_per_layer(self, kv_heads: int, head_dim: int, page_size: int = 16) -> int:
        """Bytes one token takes in one layer, K and V over all kv heads, measured on the real page
        arrays (scales included), so it is what a pool really spends: e.g. at 3 kv heads x 64 dims,
        fp32 1536, bf16 768, fp8 408, q4 240, q3 192."""
        shapes = jax.eval_shape(lambda: self.empty((kv_heads, 1, page_size), head_dim))
        total = sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(shapes))
        return 2 * total // page_size


def _plain(name: str, dtype: type) -> KVFormat:
    return KVFormat(
        name,
        jnp.dtype(dtype),
        coded=False,
        empty=lambda lead, d: jnp.zeros((*lead, d), dtype),
        quantize=lambda x: x.astype(dtype),
    )


def _empty_fp8(lead: tuple[int, int, int], d: int) -> Fp8Pages:
    return Fp8Pages(values=jnp.zeros((*lead, d), jnp.float8_e4m3fn), scale=jnp.ones(lead, jnp.float32))


def _empty_q4(lead: tuple[int, int, int], d: int) -> Q4Pages:
    groups = d // q4_group_size(d)
    return Q4Pages(
        packed=jnp.zeros((*lead, d // 2), jnp.uint8),
        scale=jnp.zeros((*lead, groups), jnp.bfloat16),
        zero=jnp.zeros((*lead, groups), jnp.bfloat16),
    )


def _empty_q3(lead: tuple[int, int, int], d: int) -> Q3Pages:
    groups = d // q3_group_size(d)
    return Q3Pages(planes=jnp.zeros((*lead, 3, d // 8), jnp.uint8), scale=jnp.zeros((*lead, groups), jnp.bfloat16))


FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        _plain("fp32", jnp.float32),
        _plain("bf16", jnp.bfloat16),
        _plain("fp16", jnp.float16),
        KVFormat("fp8", None, coded=False, empty=_empty_fp8, quantize=quantize_fp8),
        KVFormat(
            "q4", None, coded=True, empty=_empty_q4,
            quantize=quantize_q4,
            head_dim_rule=lambda d: None if d % 2 == 0 else "packs two dims per byte and needs an even head_dim",
        ),
        KVFormat(
            "q3", None, coded=True, empty=_empty_q3,
            quantize=lambda x: quantize_q3(x, group_size=q3_group_size(x.shape[-1])),
            head_dim_rule=lambda d: None if d % 8 == 0 else "stores 3 bit-planes of head_dim/8 bytes and needs head_dim % 8 == 0",
        ),
    )
}
# The built-in formats (the CLI offers these); formats registered later are known to kv_format.
KV_DTYPES: tuple[str, ...] = tuple(FORMATS)
FLOAT_KV_DTYPES: tuple[str, ...] = tuple(name for name, f in FORMATS.items() if f.plain)
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def register_format(fmt: KVFormat) -> None:
    """Add a storage format of your own (a page layout: ``float_dtype=None``), usable by name in
    ``kv_dtype(name)`` with the paged and tiered caches. Its pages are a registered pytree dataclass
    with ``head_dim`` and ``dequantize(dtype)``, like :class:`~zgen.pallas.paged_attention.layouts.Q4Pages`;
    the XLA attention path reads any such layout, the fused GPU kernels only the built-in ones.
    Check it with :mod:`zgen.testing.cache_conformance` (see docs/kv_quantization.md)."""
    if not _NAME.fullmatch(fmt.name):
        raise ConfigError(f"a kv dtype name is lowercase letters, digits and _ (at most 32), got {fmt.name!r}")
    if fmt.name in FORMATS:
        raise ConfigError(f"kv dtype {fmt.name!r} is already registered; pick another name")
    if fmt.plain or fmt.coded:
        raise ConfigError(
            f"kv dtype {fmt.name!r}: only page layouts that are not coded can be registered (float_dtype=None, coded=False)"
        )
    FORMATS[fmt.name] = fmt


def kv_format(name: str, head_dim: int | None = None) -> KVFormat:
    """The format called ``name`` (checked against ``head_dim`` when given), or ConfigError."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ConfigError(f"unknown kv dtype {name!r}; choose one of {', '.join(FORMATS)}")
    if head_dim is not None:
        fmt.check(head_dim)
    return fmt


def kv_dtype_of(dtype: jnp.dtype) -> str:
    """The plain format of a model dtype (float32 -> fp32, ...); fp32 for anything else."""
    return next((name for name in FLOAT_KV_DTYPES if FORMATS[name].float_dtype == jnp.dtype(dtype)), "fp32")


def empty_pages(kv_dtype: str, kv_heads: int, num_pages: int, page_size: int, head_dim: int) -> KVPages:
    """Zeroed pages ``[kv_heads, num_pages, page_size, ...]`` in the storage format ``kv_dtype``.

    On CPU their bfloat16 and fp8 leaves are kept in integer containers
    (:class:`~zgen.pallas.paged_attention.layouts.BitPages`): XLA:CPU copies the whole pool on every
    write to such a float array, and writes an integer one in place.
    """
    pages = kv_format(kv_dtype, head_dim).empty((kv_heads, num_pages, page_size), head_dim)
    return as_bits(pages) if platform() == "cpu" else pages


def bytes_per_token_per_layer(kv_dtype: str, kv_heads: int, head_dim: int, page_size: int = 16) -> int:
    """See :meth:`KVFormat.bytes_per_token_per_layer`."""
    return kv_format(kv_dtype, head_dim).bytes_per_token_per_layer(kv_heads, head_dim, page_size)
