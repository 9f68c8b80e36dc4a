"""A Triton kernel's compiled code for a Hopper GPU, read on any machine: registers and its loop.

The kernel is lowered for CUDA through ``jax.export`` (no GPU needed), its Triton IR is captured on
the way, and a stand-alone Triton compiles that IR for sm_90; the cubin's register use and the
instruction mix of its longest loop (a backward branch's span) are printed. This is
how the quantized matmul lost the MOVs that rematerialized its constant masks (BENCHMARKS.md,
"Weight-only quantization"). Instruction counts are not timings: time the change on a GPU too.

Needs a stand-alone Triton (it bundles ptxas and cuobjdump); it is not one of zgen's dependencies:

    pip install triton==3.9.0
    python benchmarks/kernel_sass.py quantized-matmul --bits 4 --out 28672 --inp 4096
    python benchmarks/kernel_sass.py --warps 4 quantized-matmul --form mma
    python benchmarks/kernel_sass.py paged-attention --format q4 --coded --warps 2
    python benchmarks/kernel_sass.py paged-append --format fp8 --context 8192
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import export


def captured_ir(fn: Callable[..., Any], *args: Any) -> list[str]:
    """The Triton IR of every Pallas kernel ``fn`` lowers for CUDA, as text."""
    import jax._src.pallas.triton.lowering as lowering
    import jax._src.pallas.triton.pallas_call_registration as registration

    modules: list[Any] = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*a: Any, **k: Any) -> Any:
        modules.append(lower(*a, **k))
        return modules[-1]

    registration.lowering.lower_jaxpr_to_triton_module = capture  # type: ignore[attr-defined]
    try:
        triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton_call])(*args)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower  # type: ignore[attr-defined]
    return [m.module.operation.get_asm(enable_debug_info=False) for m in modules]


def compiled(ir: str, warps: int, stages: int) -> tuple[str, str]:
    """``(resource usage, SASS)`` of ``ir`` compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ttir"
        source.write_text(ir)
        kernel = triton.compile(str(source), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        run = lambda *flags: subprocess.run([str(tools / "cuobjdump"), *flags, str(cubin)], capture_output=True, text=True, check=True).stdout  # noqa: E731
        usage = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", run("-res-usage"))
        return usage.group(0) if usage else "?", run("-sass")


def loop_mix(sass: str) -> tuple[int, collections.Counter[str]]:
    """Instructions of the longest loop (from a backward branch's target to the branch: the page loop
    of an attention kernel, not a short copy loop the compiler adds beside it), and their opcodes."""
    code = [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines() if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line))]
    span: tuple[int, int] | None = None
    for address, text in code:
        branch = re.search(r"BRA (0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            if span is None or address - int(branch.group(1), 16) > span[1] - span[0]:
                span = (int(branch.group(1), 16), address)
    body = [text for address, text in code if span and span[0] <= address <= span[1]]
    return len(body), collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)


def quantized_matmul_call(args: argparse.Namespace) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    from zgen.pallas.quantized_matmul import triton, triton_mma
    from zgen.quantized_weights import WeightQuantization, quantize

    scheme = WeightQuantization(args.bits, args.group)
    weight = jax.eval_shape(lambda: quantize(jnp.zeros((args.out, args.inp), jnp.float32), scheme, jnp.dtype(jnp.bfloat16)))
    kernel = triton_mma if args.form == "mma" else triton
    return (lambda x, w: kernel.quantized_matmul(x, w)), (jax.ShapeDtypeStruct((args.rows, args.inp), jnp.bfloat16), weight)


def paged_attention_call(args: argparse.Namespace) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    from zgen.pallas.paged_attention import quantize, triton as kernel
    from zgen.pallas.paged_attention.layouts import KeyCalibration

    b, kvh, heads, d, page, pages = args.batch, args.kv_heads, args.heads, args.head_dim, args.page_size, args.context // args.page_size
    pool = jax.eval_shape(lambda: quantize(jnp.zeros((kvh, b * pages, page, d), jnp.float32), args.format))
    coding: dict[str, Any] = {}
    if args.coded:
        ones = jnp.ones((kvh, d), jnp.float32)
        coding["key_calibration"] = KeyCalibration(ones, ones, ones, jnp.ones((d // 2,), jnp.float32))

    def call(q: Any, k: Any, v: Any, tables: Any, positions: Any, mask: Any) -> Any:
        return kernel.paged_attention(q, k, v, tables, positions, mask, scale=d**-0.5, soft_cap=None, sliding_window=None, **coding)

    shapes = (
        jax.ShapeDtypeStruct((b, 1, heads, d), jnp.bfloat16), pool, pool, jax.ShapeDtypeStruct((b, pages), jnp.int32),
        jax.ShapeDtypeStruct((b, 1), jnp.int32), jax.ShapeDtypeStruct((b, pages), jnp.bool_),
    )
    return call, shapes


def paged_append_call(args: argparse.Namespace) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    from zgen.pallas.paged_attention import quantize, triton as kernel

    b, kvh, heads, d, page, pages = args.batch, args.kv_heads, args.heads, args.head_dim, args.page_size, args.context // args.page_size
    pool = jax.eval_shape(lambda: quantize(jnp.zeros((kvh, b * pages, page, d), jnp.float32), args.format))
    inv_freq = jnp.ones((d // 2,), jnp.float32)

    def call(q: Any, new: Any, k: Any, v: Any, tables: Any, positions: Any) -> Any:
        return kernel.append_decode_attention(
            q, new, new, k, v, tables, positions, inv_freq=inv_freq, sliding_window=None, soft_cap=None, scale=d**-0.5
        )

    shapes = (
        jax.ShapeDtypeStruct((b, 1, heads, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, 1, kvh, d), jnp.bfloat16), pool, pool,
        jax.ShapeDtypeStruct((b, pages), jnp.int32), jax.ShapeDtypeStruct((b, 1), jnp.int32),
    )
    return call, shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warps", type=int, default=2, help="num_warps to compile with: match the launch (2 for quantized_matmul and quantized pages, 4 for bf16 pages)")
    parser.add_argument("--stages", type=int, default=3, help="num_stages to compile with (both kernels launch with 3)")
    kernels = parser.add_subparsers(dest="kernel", required=True)
    qmm = kernels.add_parser("quantized-matmul")
    qmm.add_argument("--bits", type=int, choices=[4, 8], default=4)
    qmm.add_argument("--group", type=int, default=None)
    qmm.add_argument("--out", type=int, default=28672)
    qmm.add_argument("--inp", type=int, default=4096)
    qmm.add_argument("--rows", type=int, default=1)
    qmm.add_argument("--form", choices=["cuda-cores", "mma"], default="cuda-cores", help="mma: 4-bit codes on the tensor cores (--warps 4)")
    paged = kernels.add_parser("paged-attention")
    paged.add_argument("--format", choices=["bf16", "fp8", "q4", "q3"], default="q4")
    paged.add_argument("--coded", action="store_true", help="keys coded through a calibration (the paged cache's q4/q3)")
    append = kernels.add_parser("paged-append", help="the paged cache's one-kernel decode step (plain or fp8 pages)")
    append.add_argument("--format", choices=["bf16", "fp8"], default="fp8")
    for sub in (paged, append):
        sub.add_argument("--batch", type=int, default=8)
        sub.add_argument("--heads", type=int, default=32)
        sub.add_argument("--kv-heads", type=int, default=8)
        sub.add_argument("--head-dim", type=int, default=128)
        sub.add_argument("--page-size", type=int, default=64)
        sub.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    calls = {"quantized-matmul": quantized_matmul_call, "paged-attention": paged_attention_call, "paged-append": paged_append_call}
    fn, shapes = calls[args.kernel](args)
    for i, ir in enumerate(captured_ir(fn, *shapes)):
        usage, sass = compiled(ir, args.warps, args.stages)
        count, mix = loop_mix(sass)
        print(f"kernel {i}: {usage}; longest loop {count} instructions: " + ", ".join(f"{op} {n}" for op, n in mix.most_common(14)))


if __name__ == "__main__":
    main()
