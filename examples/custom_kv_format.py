"""Add a KV storage format of your own: 2-bit codes, four levels between each group's min and max.

This is the asymmetric per-group quantization KIVI uses for values, applied here to keys too: zgen
quantizes each token once when it is written (so pages are never re-quantized, and prefix sharing,
fork and truncate stay exact), which rules out KIVI's per-channel keys grouped over tokens. Register
the format once, then ``kv_dtype("q2")`` works with the paged and tiered caches; attention reads it
through the XLA path (the fused GPU kernels know only the built-in layouts). Check a format with
``zgen.testing.cache_conformance`` (property_tests/test_cache_conformance.py runs it on this one) and
measure its quality with ``benchmarks/kv_quality.py`` (docs/kv_quantization.md has its row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

import zgen
from zgen.cache.factory import kv_dtype
from zgen.cache.formats import FORMATS, KVFormat, bytes_per_token_per_layer, register_format

Q2_GROUP = 32  # dims per (scale, min) pair


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q2Pages:
    """``x[d] ~= code[d] * scale[d // G] + zero[d // G]`` with codes 0..3; byte ``j`` of ``packed`` holds
    ``code[j + i * D/4]`` in bits ``2i, 2i+1``."""

    packed: UInt8[Array, "kvh pages page quarter_d"]
    scale: Float[Array, "kvh pages page groups"]
    zero: Float[Array, "kvh pages page groups"]

    @property
    def head_dim(self) -> int:
        return 4 * self.packed.shape[-1]

    def dequantize(self, dtype: jnp.dtype) -> Float[Array, "*lead d"]:
        codes = jnp.concatenate([(self.packed >> (2 * i)) & 3 for i in range(4)], axis=-1).astype(jnp.float32)
        grouped = codes.reshape(*codes.shape[:-1], self.scale.shape[-1], -1)
        x = grouped * self.scale[..., None].astype(jnp.float32) + self.zero[..., None].astype(jnp.float32)
        return x.reshape(codes.shape).astype(dtype)


def quantize_q2(x: Float[Array, "*lead d"]) -> Q2Pages:
    """Each token's groups of :data:`Q2_GROUP` dims to 2-bit codes over their [min, max]."""
    d = x.shape[-1]
    grouped = x.astype(jnp.float32).reshape(*x.shape[:-1], d // Q2_GROUP, Q2_GROUP)
    low, high = grouped.min(-1), grouped.max(-1)
    scale = (jnp.where(high > low, (high - low) / 3, 1.0)).astype(jnp.float16)
    zero = low.astype(jnp.float16)
    codes = jnp.clip(jnp.round((grouped - zero[..., None]) / scale[..., None].astype(jnp.float32)), 0, 3).astype(jnp.uint8)
    quarters = jnp.split(codes.reshape(x.shape), 4, axis=-1)
    packed = quarters[0] | (quarters[1] << 2) | (quarters[2] << 4) | (quarters[3] << 6)
    return Q2Pages(packed=packed, scale=scale, zero=zero)


def empty_q2(lead: tuple[int, int, int], d: int) -> Q2Pages:
    groups = (*lead, d // Q2_GROUP)  # separate arrays: the cache donates each leaf to its writes
    return Q2Pages(packed=jnp.zeros((*lead, d // 4), jnp.uint8), scale=jnp.zeros(groups, jnp.float16), zero=jnp.zeros(groups, jnp.float16))


Q2 = KVFormat(
    "q2", None, coded=False, empty=empty_q2, quantize=quantize_q2,
    head_dim_rule=lambda d: None if d % Q2_GROUP == 0 and d % 4 == 0 else f"groups {Q2_GROUP} dims and needs head_dim % {Q2_GROUP} == 0",
)
if "q2" not in FORMATS:  # importing this module twice registers it once
    register_format(Q2)


def main(model: zgen.Model | None = None) -> None:
    """Generate with the q2 format (default model: SmolLM2, whose 64-dim heads hold two groups)."""
    model = model or zgen.load_model("smollm2")
    c = model.config
    for name in ("bf16", "q4", "q2"):
        print(f"{name}: {bytes_per_token_per_layer(name, c.num_kv_heads, c.head_dim)} bytes per token per layer")
    generator = zgen.Generator(model, kv_dtype("q2"))
    reply = generator.chat([{"role": "user", "content": "Name three colours."}], zgen.SamplingConfig(temperature=0.0, max_new_tokens=16))
    print("q2 reply:", reply.text)


if __name__ == "__main__":
    main()
