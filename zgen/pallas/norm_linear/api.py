"""``add_rms_norm_linear``: a residual add, the RMS norm of its sum and the projection that reads the
norm (a decoder block's first matmul: attention's qkv, the MLP's gate/up), as one kernel.

In a batch-1 decode step of a small model every launch costs more than its bytes: the norm (zgen's
``add_rms_norm`` kernel) and XLA's product are two launches; the Triton kernel is one, each program
normalizing the few rows itself beside its slice of the weight.
"""

from __future__ import annotations

from jaxtyping import Array, Float

from zgen import numerics
from zgen.errors import ConfigError
from zgen.graph.core import linear
from zgen.pallas.common import interpret_pallas, platform, with_reference_gradient
from zgen.pallas.norm_linear.triton import MAX_ROWS, MAX_WIDTH

# Output columns per program: with 4 warps, the best or within 8 % of it in the launch sweep (BENCHMARKS.md).
DEFAULT_BLOCK_N = 8


def reference(
    x: Float[Array, "*rows size"],
    delta: Float[Array, "*rows size"] | None,
    norm_weight: Float[Array, " size"],
    eps: float,
    weight: Float[Array, "out size"],
) -> tuple[Float[Array, "*rows size"] | None, Float[Array, "*rows out"]]:
    """The graph's own form: :func:`zgen.numerics.add_rms_norm` (or ``rms_norm`` without ``delta``),
    then :func:`zgen.graph.core.linear`."""
    if delta is None:
        total, normed = None, numerics.rms_norm(x, norm_weight, eps)
    else:
        total, normed = numerics.add_rms_norm(x, delta, norm_weight, eps)
    return total, linear(normed, weight)


def kernel_block_n(rows: int, size: int, out_size: int) -> int | None:
    """The kernel's output block for this problem, or None where it does not take it: at most
    :data:`MAX_ROWS` rows, rows at most :data:`MAX_WIDTH` wide (wider models' weights are bytes
    enough that XLA's matrix-vector product, which streams them better, pays for the norm's launch),
    and output columns that the block divides."""
    if rows > MAX_ROWS or size > MAX_WIDTH or out_size % DEFAULT_BLOCK_N:
        return None
    return DEFAULT_BLOCK_N


def kernel_takes(x: Float[Array, "*rows size"], weight: Float[Array, "out size"]) -> bool:
    """Whether ``implementation=None`` runs this problem through the kernel (a GPU, and a shape
    :func:`kernel_block_n` takes)."""
    return platform() == "gpu" and kernel_block_n(x.size // x.shape[-1], x.shape[-1], weight.shape[0]) is not None


def add_rms_norm_linear(
    x: Float[Array, "*rows size"],
    delta: Float[Array, "*rows size"] | None,
    norm_weight: Float[Array, " size"],
    eps: float,
    weight: Float[Array, "out size"],
    *,
    implementation: str | None = None,
    block_n: int | None = None,
) -> tuple[Float[Array, "*rows size"] | None, Float[Array, "*rows out"]]:
    """The residual stream ``x + delta`` (None without ``delta``: then ``x`` is normalized as it is),
    and its RMS norm times ``norm_weight`` projected by ``weight`` (``[out, size]``, the checkpoint's
    layout): ``rms_norm(x + delta) @ weight.T``, rounded as the graph rounds it.

    ``implementation``: None (Triton on GPUs for the few rows of a decode step, XLA elsewhere),
    "reference" / "xla" (:func:`reference`) or "triton" (differentiable: its gradient is
    :func:`reference`'s). ``block_n`` overrides the kernel's output
    columns per program (a power of two dividing ``out``).
    """
    size = x.shape[-1]
    if (delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype)) or norm_weight.shape != (size,) or weight.ndim != 2 or weight.shape[1] != size:
        raise ConfigError(
            "add_rms_norm_linear needs x and delta of one shape and dtype, a norm weight over their last axis and "
            f"a weight [out, {size}]; got x {x.dtype}{list(x.shape)}, delta "
            f"{None if delta is None else f'{delta.dtype}{list(delta.shape)}'}, norm weight {list(norm_weight.shape)}, "
            f"weight {list(weight.shape)}"
        )
    rows = x.size // size
    chosen = implementation or ("triton" if kernel_takes(x, weight) else "xla")
    if chosen in ("reference", "xla"):
        return reference(x, delta, norm_weight, eps, weight)
    if chosen != "triton":
        raise ConfigError(f"unknown add_rms_norm_linear implementation {chosen!r}; choose reference, xla, triton or None")
    block = block_n or kernel_block_n(rows, size, weight.shape[0])
    if block is None or weight.shape[0] % block or block & (block - 1):
        raise ConfigError(
            f"the Triton add_rms_norm_linear takes at most {MAX_ROWS} rows of at most {MAX_WIDTH} values and output "
            f"columns divisible by its block (a power of two, {DEFAULT_BLOCK_N} by default); got {rows} rows, x {list(x.shape)}, "
            f"weight {list(weight.shape)}{'' if block_n is None else f', block_n {block_n}'}; use implementation='xla' or None"
        )
    from zgen.pallas.norm_linear import triton

    def kernel(
        x: Float[Array, "*rows size"], delta: Float[Array, "*rows size"] | None, norm_weight: Float[Array, " size"], weight: Float[Array, "out size"]
    ) -> tuple[Float[Array, "*rows size"] | None, Float[Array, "*rows out"]]:
        flat_delta = None if delta is None else delta.reshape(rows, size)
        total, projected = triton.add_rms_norm_linear(
            x.reshape(rows, size), flat_delta, norm_weight, eps, weight, block_n=block, interpret=interpret_pallas()
        )
        return (None if total is None else total.reshape(x.shape)), projected.reshape(*x.shape[:-1], weight.shape[0])

    same = lambda x, delta, norm_weight, weight: reference(x, delta, norm_weight, eps, weight)  # noqa: E731 - eps bound
    return with_reference_gradient(kernel, same)(x, delta, norm_weight, weight)
