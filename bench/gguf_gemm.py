"""The Triton GEMM over GGUF blocks (kernels/triton/gguf_gemm.py) beside bf16
cuBLAS on a 7B layer's shapes (Llama-2-7B: hidden 4,096, intermediate 11,008),
at decode (T = 1, 32) and prefill (T = 2,048) sizes, Q4_K and Q8_0 (llama.cpp's
Q4_K_M preset and its 8-bit format): time, TFLOP/s, and GB/s of the bytes a
multiply must move (the weight as stored, x and y), the L2 flushed before each
run (triton.testing.do_bench). Every shape is first checked against the
reference (kernels/gguf_quant.py's quant_linear). Writes bench/results/gguf_gemm.md.

    python -m bench.gguf_gemm [--tokens 1 32 2048] [--resources-only]

Without a CUDA GPU (or under TRITON_INTERPRET) it says so and exits 0, writing
nothing: the kernels are tested under the interpreter on CPU
(tests/unit/test_gguf_triton.py). `--resources-only` compiles the kernels'
tiles for sm_80 and sm_90 without a GPU and prints registers and spills
(bench/kernel_resources.py's report) — what tests/unit/test_gguf_triton.py checks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight

RESULT = Path(__file__).resolve().parent / "results" / "gguf_gemm.md"
# (name, out_features, in_features) of one 7B decoder layer's projections
SHAPES = (("qkv", 12288, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008))
QTYPES = ("Q4_K", "Q8_0")
TOKENS = (1, 32, 2048)


@dataclass(frozen=True)
class Row:
    shape: str
    tokens: int
    kernel: str  # "bf16 cuBLAS" or a GGUF type
    ms: float
    flops: float
    moved_bytes: int

    @property
    def tflops(self) -> float:
        return self.flops / self.ms / 1e9

    @property
    def gbps(self) -> float:
        return self.moved_bytes / self.ms / 1e6


def skip_reason() -> str | None:
    """Why this machine cannot time the kernels (None: it can)."""
    import os

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set"
    return None


def random_weight(qtype: str, out_features: int, in_features: int, device: torch.device) -> QuantizedWeight:
    """Random blocks with finite fp16 scales (every other byte pattern is a valid block)."""
    elems, size = BLOCK_FORMATS[qtype]
    scale_fields = {"Q8_0": (0,), "Q4_K": (0, 2)}[qtype]
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = torch.randint(0, 256, (out_features * in_features // elems, size), dtype=torch.uint8, device=device)
    for offset in scale_fields:
        scales = (torch.randn(len(blocks), generator=gen, device=device) * 0.02).half()
        blocks[:, offset : offset + 2] = scales.view(torch.uint8).view(-1, 2)
    return QuantizedWeight(qtype, out_features, in_features, blocks.view(out_features, -1))


def time_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def gguf_rows(
    tokens: tuple[int, ...] = TOKENS,
    shapes: tuple[tuple[str, int, int], ...] = SHAPES,
    dev: torch.device = torch.device("cuda"),
    timer: Callable[[Callable[[], object]], float] = time_ms,
) -> list[Row]:
    """bf16 cuBLAS and the GGUF kernel for every shape, type and token count (a CPU
    device and another timer: the same code under the interpreter, in the tests)."""
    import torch.nn.functional as F

    from kernels.gguf_quant import quant_linear as reference
    from kernels.triton.gguf_gemm import quant_linear

    rows = []
    for name, out_features, in_features in shapes:
        dense = torch.randn(out_features, in_features, device=dev, dtype=torch.bfloat16) * 0.02
        weights = {q: random_weight(q, out_features, in_features, dev) for q in QTYPES}
        for t in tokens:
            x = torch.randn(t, in_features, device=dev, dtype=torch.bfloat16)
            flops = 2.0 * t * out_features * in_features
            activations = 2 * t * (in_features + out_features)
            ms = timer(partial(F.linear, x, dense))
            rows.append(Row(name, t, "bf16 cuBLAS", ms, flops, dense.numel() * 2 + activations))
            for qtype, weight in weights.items():
                got, want = quant_linear(x, weight).float(), reference(x, weight).float()
                torch.testing.assert_close(got, want, atol=0.05 * float(want.abs().max()), rtol=0.02)
                ms = timer(partial(quant_linear, x, weight))
                rows.append(Row(name, t, qtype, ms, flops, weight.nbytes + activations))
            print(*(f"{r.shape} T={r.tokens} {r.kernel}: {r.ms:.3f} ms" for r in rows[-3:]), sep="\n", flush=True)
    return rows


def gguf_table(rows: list[Row]) -> str:
    from bench.harness.results import markdown_table

    base = {(r.shape, r.tokens): r.ms for r in rows if r.kernel == "bf16 cuBLAS"}
    body = [
        [
            r.shape,
            r.tokens,
            r.kernel,
            f"{r.ms:.3f}",
            f"{r.tflops:.1f}",
            f"{r.gbps:.0f}",
            f"{base[r.shape, r.tokens] / r.ms:.2f}x",
        ]
        for r in rows
    ]
    headers = ["projection", "T", "weights", "ms", "TFLOP/s", "GB/s moved", "speed vs bf16"]
    return markdown_table(headers, body)


def resource_rows(arches: tuple[int, ...] = (80, 90)) -> list[dict[str, object]]:
    """Every format's kernels compiled for each arch at the tiles of T = 1, 32 and
    2,048 (bf16 x): shared memory, registers and spilled bytes as ptxas reports them."""
    import triton.language as tl

    from bench.kernel_resources import _compile, ptxas_report
    from kernels.triton import gguf_gemm as G

    pointers = dict(x_ptr="*bf16", w_ptr="*u8", h_ptr="*fp16", y_ptr="*bf16")
    out = []
    for arch in arches:
        for qtype, code in G.QTYPE_CODES.items():
            elems, size = BLOCK_FORMATS[qtype]
            for tokens in TOKENS:
                tiles = G.gguf_tiles(tokens, qtype)
                meta: dict[str, object] = dict(
                    QTYPE=code, E=elems, B=size, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k
                )
                kernel = G._gemv_kernel
                if not tiles.gemv:
                    kernel = G._gemm_kernel
                    meta |= dict(COMPUTE=tl.bfloat16, DOT_PRECISION=None, BLOCK_M=tiles.block_m)
                compiled = _compile(kernel, pointers, meta, G.launch_options(tiles), arch)
                registers, spills = ptxas_report(compiled.asm["ptx"], arch)
                out.append(
                    dict(arch=arch, qtype=qtype, tokens=tokens, tiles=f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k}",
                         shared=int(compiled.metadata.shared), registers=registers, spill_bytes=spills)
                )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument(
        "--resources-only", action="store_true", help="compile for sm_80/sm_90 and report, no GPU needed"
    )
    args = parser.parse_args(argv)
    if args.resources_only:
        import json

        compiled = resource_rows()
        for row in compiled:
            print(json.dumps(row))
        return 0 if not any(r["spill_bytes"] for r in compiled) else 1
    if (reason := skip_reason()) is not None:
        print(f"bench.gguf_gemm skipped: {reason}; nothing written (it times the kernels on a CUDA GPU)")
        return 0
    from bench.harness.results import commit

    rows = gguf_rows(tuple(args.tokens))
    gpu = torch.cuda.get_device_name()
    command = f"python -m bench.gguf_gemm --tokens {' '.join(map(str, args.tokens))}"
    text = f"# GGUF GEMM on {gpu}\n\n`{command}` at {commit()}; L2 flushed before each run, median.\n\n"
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(text + gguf_table(rows) + "\n")
    print(gguf_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
