"""Quantized-weight GEMMs beside the dense one, side by side in one run (issue 38):

* on a GPU: for INT4 (g128), INT8 and FP8 weights with bf16 activations, what
  kernels/triton/wquant.py's wquant_linear runs at each row count ("served") and each
  path it picks from: the Triton GEMV and the in-loop GEMM (each weight tile
  dequantized in registers), and the weight dequantized once then cuBLAS (the
  reference): the columns place GEMV_MAX_TOKENS and DEQUANTIZE_FROM_TOKENS. Then
  INT8 W8A8 (Triton int32 dots) and torch._scaled_mm's FP8 W8A8 (sm89+). TFLOP/s
  against bf16 cuBLAS (F.linear) at decode and prefill row counts;
* on the CPU: the C++ kernel that reads the stored bytes (kernels/wquant_cpu.py,
  what the worker runs) and the reference path (dequantize on every call, then
  multiply: kernels/wquant.py), and an act-order INT4 weight as the worker serves it
  (its inputs in group order, the C++ kernel) and through the reference, ms per call
  against fp32 F.linear on the same shape, CPU time of the calling thread on one torch
  thread.

    python -m bench.wquant_gemm [--quick]     # -> bench/results/wquant_gemm_{gpu,cpu}.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import machine
from bench.harness.results import RESULTS, commit
from kernels import wquant, wquant_act, wquant_cpu
from kernels.wquant import Int4Weight, ScaledWeight
from kernels.wquant_formats import pack_rows
from worker_svc.models.linear import WQuantLinear

GPU_SHAPES = [(4096, 4096), (14336, 4096)]  # (out, in): a 8B model's attention and MLP projections
CPU_SHAPES = [(3072, 576), (576, 1536)]  # SmolLM2-135M's gate-up and down projections


def weights(out: int, inp: int, device: torch.device, group: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    groups = -(-inp // group)
    int4 = Int4Weight("int4", pack_rows(torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)),
                      (torch.rand(out, groups, generator=g) * 0.01).half(),
                      torch.randint(0, 16, (out, groups), generator=g, dtype=torch.uint8), group)  # fmt: skip
    # GPTQ's desc_act: each group's inputs spread over the row (g_idx)
    act_order = replace(int4, g_idx=(torch.randperm(inp, generator=g) // group).to(torch.int32))
    scale = torch.rand(out, 1, generator=g) * 0.01
    int8 = ScaledWeight("int8", torch.randint(-128, 128, (out, inp), generator=g, dtype=torch.int8), scale, 1, inp)
    # fp8 as a checkpoint's scale maps its weights: the largest near 448 (randn alone
    # would make a fifth of all 16-weight runs hold a subnormal, a rare value in a checkpoint)
    e4m3 = (torch.randn(out, inp, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    fp8 = ScaledWeight("fp8", e4m3, scale, 1, inp)
    return {
        "int4": int4.to(device),
        "int8": int8.to(device),
        "fp8": fp8.to(device),
        "int4 act-order": act_order.to(device),
    }


def gpu_rows(rows: list[int]) -> list[str]:
    from triton.testing import do_bench

    from kernels.triton import wquant as tw

    device = torch.device("cuda")
    lines = ["| out x in | rows | bf16 cuBLAS | " + " | ".join(GPU_KERNELS) + " |",
             "|---|---|---|" + "---|" * len(GPU_KERNELS)]  # fmt: skip
    for out, inp in GPU_SHAPES:
        w = weights(out, inp, device, 128)
        dense = torch.randn(out, inp, device=device, dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, inp, device=device, dtype=torch.bfloat16)
            tflops = 2 * m * out * inp / 1e9  # per ms
            base = tflops / do_bench(partial(F.linear, x, dense))
            ops: dict[str, Callable[[], torch.Tensor]] = {"int8 W8A8": partial(tw.w8a8_linear, x, w["int8"])}
            for kind in W8A16_KINDS:  # what the worker runs at m rows, and each path it chooses from
                ops[f"{kind} served"] = partial(tw.wquant_linear, x, w[kind])
                ops[f"{kind} GEMV"] = partial(tw.dequantize_gemv, x, w[kind])
                ops[f"{kind} GEMM"] = partial(tw.dequantize_in_the_loop, x, w[kind])
                ops[f"{kind} dequantized + cuBLAS"] = partial(wquant.wquant_linear, x, w[kind])
            ops["fp8 W8A8 _scaled_mm"] = partial(tw.fp8_linear, x, w["fp8"])
            cells = []
            for name in GPU_KERNELS:
                if name.startswith("fp8") and not tw.has_fp8_mm(device):
                    cells.append("no FP8 (reference)")
                    continue
                t = tflops / do_bench(ops[name])
                cells.append(f"{t:.1f} ({t / base:.2f}x)")
            lines.append(f"| {out} x {inp} | {m} | {base:.1f} | " + " | ".join(cells) + " |")
    return lines


# W8A16 weights (int4: g128 W4A16): the Triton GEMV (decode rows), the in-loop GEMM, the
# weight dequantized once then cuBLAS, and "served": which of them wquant_linear picks.
W8A16_KINDS = ("int4", "int8", "fp8")
GPU_KERNELS = [
    *(f"{kind} {path}" for kind in W8A16_KINDS for path in ("served", "GEMV", "GEMM", "dequantized + cuBLAS")),
    "int8 W8A8",
    "fp8 W8A8 _scaled_mm",
]


def cpu_rows(rows: list[int], rounds: int) -> list[str]:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    kinds = ("int4", "int8", "fp8")
    cpp = wquant_cpu.takes(weights(*CPU_SHAPES[0], device, 64)["int4"])
    names = ["fp32 F.linear", *(f"{k}{' g64' if k == 'int4' else ''} {impl}" for k in kinds
                                for impl in (("C++", "reference") if cpp else ("reference",))),
             "int4 g64 act-order served", "int4 g64 act-order reference", "int8 W8A8 (reference)"]  # fmt: skip
    lines = ["| out x in | rows | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for out, inp in CPU_SHAPES:
        w = weights(out, inp, device, 64)  # 576 = 9 x 64: SmolLM2's INT4 checkpoints group by 64 or 32
        dense = w["int8"].dequantize()
        act_order_served = WQuantLinear(w["int4 act-order"], cpu_kernel=True)  # what the worker runs: group order
        for m in rows:
            x = torch.randn(m, inp)
            impls = (wquant_cpu.multiply, wquant.wquant_linear) if cpp else (wquant.wquant_linear,)
            ops = [partial(F.linear, x, dense), *(partial(op, x, w[k]) for k in kinds for op in impls),
                   partial(act_order_served, x), partial(wquant.wquant_linear, x, w["int4 act-order"]),
                   partial(wquant_act.w8a8_linear, x, w["int8"])]  # fmt: skip
            times: list[list[float]] = [[] for _ in ops]
            for _ in range(rounds):  # interleaved: the machine's load hits every variant alike
                for i, op in enumerate(ops):
                    start = time.thread_time()
                    op()
                    times[i].append((time.thread_time() - start) * 1e3)
            ms = [statistics.median(t) for t in times]
            cells = [f"{ms[0]:.3f}"] + [f"{v:.3f} ({v / ms[0]:.2f}x)" for v in ms[1:]]
            lines.append(f"| {out} x {inp} | {m} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and row counts")
    parser.add_argument("--out", type=Path, help="the report (default bench/results/wquant_gemm_{gpu,cpu}.md)")
    args = parser.parse_args(argv)
    machine.announce("wquant_gemm")
    gpu = torch.cuda.is_available()
    if gpu:
        table = gpu_rows([1, 16] if args.quick else [1, 4, 16, 128, 256, 2048])
        what = f"{torch.cuda.get_device_name()}: TFLOP/s (x: of bf16 cuBLAS on the same shape)"
    else:
        table = cpu_rows([1, 4, 32], 5 if args.quick else 21)
        what = "CPU, 1 torch thread: ms per call, median of interleaved rounds, thread CPU time (x: of fp32 F.linear)"
    command = "python -m bench.wquant_gemm" + (" --quick" if args.quick else "")
    text = "\n".join([f"# Quantized-weight GEMMs ({what})", "", f"machine: {machine.describe()}  ",
                      f"commit: {commit()}  ", f"command: `{command}`  ",
                      f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "", *table, ""])  # fmt: skip
    out = args.out or RESULTS / f"wquant_gemm_{'gpu' if gpu else 'cpu'}.md"
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
