"""What the attention kernels cost a GPU's multiprocessor once compiled: shared
memory, registers per thread and spilled bytes, for the tiles the launcher picks
(kernels/triton/launch.attention_tiles) at a head_dim, on an architecture; and the
quantized-weight GEMV and GEMM (kernels/triton/wquant.py) for each weight format.

Triton compiles for a CUDA target without a GPU (ptxas ships in its wheel), so
this runs on CPU-only machines too (tests/unit/test_kernel_resources.py) and on
a GPU (`make gpu-check`, bench/gpu_check.py). The register and spill counts are
ptxas's own report (`-v`) of the cubin Triton built, with the options Triton
gave it; shared memory is what Triton's launcher asks for.

    python -m bench.kernel_resources [--arch 80 90] [--head-dims 64 128 256]

must run without TRITON_INTERPRET (it compiles; the interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

# Query / KV heads of the cases: Llama-3's GQA group of 4 (32 / 8), and MQA's 16 (16 / 1).
HEADS = ((32, 8), (16, 1))
_TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8"}


@dataclass(frozen=True)
class Resources:
    kernel: str
    arch: int
    head_dim: int
    q_heads: int
    kv_heads: int
    dtype: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    shared_bytes: int
    shared_limit: int
    registers: int
    spill_bytes: int  # spill stores (ptxas)

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= self.shared_limit and self.spill_bytes == 0 and self.registers <= 255


def _type_name(dtype: torch.dtype) -> str:
    from kernels import quant

    return "fp8e4nv" if dtype == quant.FP8_DTYPE else _TYPE_NAMES[dtype]


def _compile(fn: Any, pointers: dict[str, str], constexprs: dict[str, object], options: dict[str, int], arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {
        n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "qk_scale" else "i32")
        for n in fn.arg_names
    }
    return triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", arch, 32), options=options)


def ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill-store bytes) that ptxas reports for `ptx`, run as Triton runs it."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        cmd = [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}"]
        done = subprocess.run([*cmd, src.name, "-o", "/dev/null"], capture_output=True, text=True, check=True)
    log = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    assert registers and spills, log
    return int(registers.group(1)), int(spills.group(1))


def attention_resources(
    arch: int,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    query_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    decode: bool,
    split: bool = False,
) -> Resources:
    """_paged_attention_kernel compiled for sm_`arch` as the launcher would launch it."""
    from kernels import triton as T

    capability = (arch // 10, arch % 10)
    meta, options = T.attention_launch(
        q_heads,
        kv_heads,
        head_dim,
        16,
        query_dtype,
        cache_dtype,
        decode,
        False,
        capability,
        interpret=False,
        split=split,
    )
    io, cache = "*" + _type_name(query_dtype), "*" + _type_name(cache_dtype)
    part = "*fp32" if split else io
    zero = "*i8" if cache_dtype == torch.int8 else "*fp32"
    pointers = dict(
        out_ptr=io,
        q_ptr=io,
        k_cache_ptr=cache,
        v_cache_ptr=cache,
        block_tables_ptr="*i32",
        context_lens_ptr="*i32",
        cu_query_lens_ptr="*i32",
        k_scale_ptr="*fp32",
        v_scale_ptr="*fp32",
        k_zero_ptr=zero,
        v_zero_ptr=zero,
        part_out_ptr=part,
        part_max_ptr=part,
        part_sum_ptr=part,
    )
    kernel = _compile(T.attention_kernel.paged_attention_kernel, pointers, meta, options, arch)
    registers, spills = ptxas_report(kernel.asm["ptx"], arch)
    return Resources(
        kernel=("split decode" if split else "decode") if decode else "prefill",
        arch=arch,
        head_dim=head_dim,
        q_heads=q_heads,
        kv_heads=kv_heads,
        dtype=f"{_type_name(query_dtype)}/{_type_name(cache_dtype)}",
        block_m=int(meta["BLOCK_M"]),  # type: ignore[call-overload]
        block_n=int(meta["BLOCK_N"]),  # type: ignore[call-overload]
        num_warps=options["num_warps"],
        num_stages=options["num_stages"],
        shared_bytes=int(kernel.metadata.shared),
        shared_limit=T.launch.SHARED_MEMORY_PER_BLOCK[capability],
        registers=registers,
        spill_bytes=spills,
    )


def merge_resources(arch: int, head_dim: int) -> Resources:
    """_merge_splits_kernel at the most partitions a decode may use."""
    import triton

    from kernels import triton as T

    block_d = max(16, triton.next_power_of_2(head_dim))
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=T.MAX_SPLITS)
    pointers = dict(out_ptr="*bf16", part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32")
    kernel = _compile(T.attention_kernel.merge_splits_kernel, pointers, meta, {"num_warps": 4, "num_stages": 1}, arch)
    registers, spills = ptxas_report(kernel.asm["ptx"], arch)
    shared_limit = T.launch.SHARED_MEMORY_PER_BLOCK[(arch // 10, arch % 10)]
    return Resources(
        "split merge", arch, head_dim, 0, 0, "bf16/fp32", T.MAX_SPLITS, block_d, 4, 1,
        int(kernel.metadata.shared), shared_limit, registers, spills,
    )  # fmt: skip


def sampler_resources(arch: int) -> Resources:
    """_gumbel_argmax_kernel (the fused sampler) over fp32 logits, as gumbel_argmax launches it."""
    from kernels import reference
    from kernels import triton as T

    meta = dict(MUL_A=reference.HASH_MULTIPLIERS[0], MUL_B=reference.HASH_MULTIPLIERS[1], BLOCK_V=2048)
    pointers = dict(
        logits_ptr="*fp32", temperature_ptr="*fp32", keys_ptr="*i64", thresholds_ptr="*fp32", out_ptr="*i64"
    )
    kernel = _compile(T.sampling._gumbel_argmax_kernel, pointers, meta, {"num_warps": 4, "num_stages": 3}, arch)
    registers, spills = ptxas_report(kernel.asm["ptx"], arch)
    shared_limit = T.launch.SHARED_MEMORY_PER_BLOCK[(arch // 10, arch % 10)]
    return Resources(
        "gumbel sampler", arch, 0, 0, 0, "fp32", 1, 2048, 4, 3,
        int(kernel.metadata.shared), shared_limit, registers, spills,
    )  # fmt: skip


def wquant_resources(arch: int, weight: str, gemv: bool) -> Resources:
    """kernels/triton/wquant.py's GEMV or in-loop GEMM over a bf16 x, as wquant_linear
    launches them; weight: int4, int4 g_idx (act-order), int8 or fp8."""
    from kernels import triton as T
    from kernels.triton import wquant as W

    int4 = weight.startswith("int4")
    w_type = {"int8": "*i8"}.get(weight, "*u8")  # int4 packed and fp8 bytes arrive as uint8
    scale = "*fp16" if int4 else "*fp32"
    pointers = dict(x_ptr="*bf16", w_ptr=w_type, scale_ptr=scale, zero_ptr="*u8" if int4 else scale,
                    gidx_ptr="*i32" if weight == "int4 g_idx" else scale, y_ptr="*bf16")  # fmt: skip
    flags = dict(INT4=int4, HAS_GIDX=weight == "int4 g_idx", FP8=weight == "fp8")
    if gemv:
        kernel, tile = W._dequant_gemv_kernel, dict(BLOCK_N=W.GEMV_BLOCK_N, BLOCK_K=W.GEMV_BLOCK_K)
        options, block_m, block_n = {"num_warps": 4, "num_stages": 2}, 1, W.GEMV_BLOCK_N
    else:
        kernel, tile = W._dequant_gemm_kernel, dict(FP32=False, BLOCK_M=W.BLOCK_M, BLOCK_N=W.BLOCK_N, BLOCK_K=W.BLOCK_K)
        options, block_m, block_n = {}, W.BLOCK_M, W.BLOCK_N
    compiled = _compile(kernel, pointers, {**flags, **tile}, options, arch)
    registers, spills = ptxas_report(compiled.asm["ptx"], arch)
    return Resources(
        f"wquant {'GEMV' if gemv else 'GEMM'}", arch, 0, 0, 0, f"bf16/{weight}", block_m, block_n,
        options.get("num_warps", 4), options.get("num_stages", 3), int(compiled.metadata.shared),
        T.launch.SHARED_MEMORY_PER_BLOCK[(arch // 10, arch % 10)], registers, spills,
    )  # fmt: skip


def wquant_cases(arches: Sequence[int]) -> list[Callable[[], Resources]]:
    """Every quantized-weight kernel wquant_linear launches; FP8 from sm_89 (below it the
    reference runs: kernels/triton/wquant.py's triton_decodes)."""
    weights = ["int4", "int4 g_idx", "int8"]
    return [
        partial(wquant_resources, arch, weight, gemv)
        for arch in arches
        for weight in ([*weights, "fp8"] if arch >= 89 else weights)
        for gemv in (True, False)
    ]


def attention_cases(
    arches: Sequence[int], head_dims: Sequence[int], full: bool = True
) -> list[Callable[[], Resources]]:
    """Issue 27's matrix: bf16 prefill, decode and split decode at every head_dim
    (GQA), and the heaviest variants at the largest head_dim (an fp32 model, the
    INT8 and, from sm_89, FP8 caches). `full`: also MQA, and fp32 and the
    quantized caches at every head_dim."""
    from kernels import quant

    bf16, f32 = torch.bfloat16, torch.float32
    cases: list[Callable[[], Resources]] = []
    for arch in arches:
        quantized = (quant.FP8_DTYPE, torch.int8) if arch >= 89 else (torch.int8,)
        for head_dim in head_dims:
            heavy = full or head_dim == max(head_dims)
            for q_heads, kv_heads in HEADS if full else HEADS[:1]:
                for decode, split in ((False, False), (True, False), (True, True)):
                    cases.append(_case(arch, head_dim, q_heads, kv_heads, bf16, bf16, decode, split))
            for decode in (False, True) if heavy else ():
                cases.append(_case(arch, head_dim, 32, 8, f32, f32, decode, False))
                for cache in quantized:
                    cases.append(_case(arch, head_dim, 32, 8, bf16, cache, decode, False))
        cases.append(lambda arch=arch: merge_resources(arch, max(head_dims)))
        cases.append(lambda arch=arch: sampler_resources(arch))
    return cases


def _case(*args: Any) -> Callable[[], Resources]:
    return lambda: attention_resources(*args)


def table(rows: Sequence[Resources]) -> str:
    from bench.harness.results import markdown_table

    headers = ["kernel", "sm", "head_dim", "heads q/kv", "dtype q/cache", "BLOCK_M x N", "warps", "stages"]
    headers += ["shared KB (limit)", "registers", "spill bytes", "fits"]
    body = [
        [
            r.kernel,
            r.arch,
            r.head_dim,
            f"{r.q_heads}/{r.kv_heads}",
            r.dtype,
            f"{r.block_m} x {r.block_n}",
            r.num_warps,
            r.num_stages,
            f"{r.shared_bytes / 1024:.1f} ({r.shared_limit // 1024})",
            r.registers,
            r.spill_bytes,
            "yes" if r.fits else "**no**",
        ]
        for r in rows
    ]
    return markdown_table(headers, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--json", action="store_true", help="one JSON object per kernel instead of a table")
    parser.add_argument(
        "--quick", action="store_true", help="issue 27's matrix only (bf16 GQA; the rest at the top head_dim)"
    )
    args = parser.parse_args(argv)
    from kernels import triton as triton_ops

    if triton_ops.interpreter_enabled():
        print("bench.kernel_resources compiles kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    cases = attention_cases(args.arch, args.head_dims, full=not args.quick) + wquant_cases(args.arch)
    rows = [case() for case in cases]
    if args.json:
        import json

        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print(table(rows))
    return 0 if all(r.fits for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
