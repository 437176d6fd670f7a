"""How fast the weight-streaming kernels read weights that come from memory, with their
software prefetch (kernels/csrc/weight_prefetch.h) on and off, side by side (issue 38).

A decode step reads every weight once, and a model's weights do not fit in the caches,
so its GEMVs stream from memory. A GEMV benchmark that calls one small matrix again and
again measures the caches instead. Here each case is a model-sized set of weights
(SmolLM2-135M's seven projections per layer, layers repeated up to --megabytes, several
times the last-level cache), and a pass multiplies one row of x by every matrix in
turn, as a decode step does. Passes alternate prefetch off and on round by round; the
figures are medians of the passes' wall times, one torch thread, the work pool off (the
kernel alone on one core).

The roofline is the same thread's plain sweep over a buffer of the same size (torch's
sum over fp32): the bandwidth one core gets from memory.

INT4's GEMV does not prefetch (it is bound by its decode, not by memory): its row shows
how far the same code moves between rounds.

Part 2 runs the worker's whole decode step (bench/cpu/worker_step.py's variants, the
work pool as the worker runs it) with the prefetch off and on, round by round.

    python -m bench.cpu.weight_stream                       # every case, then the steps
    python -m bench.cpu.weight_stream --rounds 9 --out cpu_weight_stream
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from bench.cpu.worker_step import STEPS, VARIANTS, blocks_needed, build_step, emit, model_present, variant_worker
from bench.harness.off_on import off_and_on
from bench.harness.results import fmt, markdown_table, write_result
from kernels import cpu_ops
from kernels.gguf_quant import BLOCK_FORMATS
from svc_common.cpu_features import read_cpu_features

# (out, in) of one SmolLM2-135M layer's projections: q, k, v, o, gate, up, down.
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
GROUP = 64  # the int4 weights' group along the input


@dataclass(frozen=True)
class Case:
    name: str
    bytes_per_weight: float
    make: Callable[[int, int, np.random.Generator], Callable[[torch.Tensor], torch.Tensor]]


def random_gguf(qtype: str, out: int, inp: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [out, inp / block * block bytes]: random Q8_0 / Q4_0 / Q4_1 blocks with finite
    scales (random bytes can be inf or NaN)."""
    elems, nbytes = BLOCK_FORMATS[qtype]
    blocks = rng.integers(0, 256, size=(out, inp // elems, nbytes), dtype=np.uint8)
    scales = np.full((out, inp // elems), 0.01, dtype=np.float16).view(np.uint8).reshape(out, inp // elems, 2)
    blocks[:, :, 0:2] = scales
    if qtype == "Q4_1":
        blocks[:, :, 2:4] = scales
    return torch.from_numpy(blocks.reshape(out, -1).copy())


def gguf_case(qtype: str, op: str) -> Callable[[int, int, np.random.Generator], Callable[[torch.Tensor], torch.Tensor]]:
    def make(out: int, inp: int, rng: np.random.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
        data = random_gguf(qtype, out, inp, rng)
        kernel = getattr(torch.ops.pagedserve_cpu, op)
        return lambda x: kernel(x, data, qtype, out)

    return make


def wquant_case(kind: str) -> Callable[[int, int, np.random.Generator], Callable[[torch.Tensor], torch.Tensor]]:
    def make(out: int, inp: int, rng: np.random.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
        cols = inp // 2 if kind == "int4" else inp
        data = torch.from_numpy(rng.integers(0, 256, size=(out, cols), dtype=np.uint8))
        scale = torch.full((out, inp // GROUP), 0.01)
        zero = torch.full((out, inp // GROUP), 8, dtype=torch.uint8) if kind == "int4" else None
        return lambda x: torch.ops.pagedserve_cpu.wquant_linear(x, data, scale, zero, kind, 1, GROUP)

    return make


def gguf_bytes_per_weight(qtype: str) -> float:
    elems, nbytes = BLOCK_FORMATS[qtype]
    return nbytes / elems


CASES = {
    "Q4_1, fp32 x": Case("Q4_1, fp32 x", gguf_bytes_per_weight("Q4_1"), gguf_case("Q4_1", "quant_linear")),
    "Q4_1, int8 x": Case("Q4_1, int8 x", gguf_bytes_per_weight("Q4_1"), gguf_case("Q4_1", "quant_linear_int8")),
    "Q8_0, fp32 x": Case("Q8_0, fp32 x", gguf_bytes_per_weight("Q8_0"), gguf_case("Q8_0", "quant_linear")),
    "Q8_0, int8 x": Case("Q8_0, int8 x", gguf_bytes_per_weight("Q8_0"), gguf_case("Q8_0", "quant_linear_int8")),
    # INT4's GEMV does not prefetch (decode-bound): its row is the noise of the switch.
    "INT4 g64 (AWQ/GPTQ)": Case("INT4 g64 (AWQ/GPTQ)", 0.5, wquant_case("int4")),
    "INT8 per channel": Case("INT8 per channel", 1.0, wquant_case("int8")),
}


def sweep_bandwidth(megabytes: int, rounds: int) -> float:
    """GB/s of one thread's sum over `megabytes` of fp32 (the best of `rounds`)."""
    buf = torch.ones(megabytes * (1 << 20) // 4)
    buf.sum()
    best = min(_seconds(lambda: buf.sum()) for _ in range(rounds))
    return buf.numel() * 4 / best / 1e9


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def case_pass(case: Case, megabytes: int) -> tuple[Callable[[], None], int, int]:
    """A pass over a model-sized set of the case's weights; its bytes and weights."""
    rng = np.random.default_rng(0)
    layer_weights = sum(o * i for o, i in LAYER)
    layers = max(1, int(megabytes * (1 << 20) / (layer_weights * case.bytes_per_weight)))
    calls = [(case.make(o, i, rng), torch.randn(1, i)) for _ in range(layers) for o, i in LAYER]

    def one_pass() -> None:
        for call, x in calls:
            call(x)

    return one_pass, int(layers * layer_weights * case.bytes_per_weight), layers * layer_weights


def off_and_on_median(run: Callable[[], float], rounds: int) -> dict[bool, float]:
    """Median of `run()` with the prefetch off and on (bench.harness.off_on)."""
    return {on: statistics.median(ts) for on, ts in off_and_on(cpu_ops.use_weight_prefetch, run, rounds).items()}


def gemv_row(name: str, megabytes: int, rounds: int, roofline: float) -> list[str]:
    one_pass, nbytes, weights = case_pass(CASES[name], megabytes)
    s = off_and_on_median(lambda: _seconds(one_pass), rounds)
    emit(section="gemv", case=name, bytes=nbytes, off_ms=s[False] * 1e3, on_ms=s[True] * 1e3)
    return (
        [name, f"{nbytes / 1e6:.0f}"]
        + [f"{fmt(s[on] * 1e3, 2)} ms, {nbytes / s[on] / 1e9:.1f} GB/s" for on in (False, True)]
        + [f"{weights / s[True] / 1e9:.1f}", f"{s[False] / s[True]:.2f}x", f"{nbytes / s[True] / 1e9 / roofline:.0%}"]
    )


def step_row(name: str, step_name: str, rounds: int) -> list[str]:
    shape = STEPS[step_name]
    w = variant_worker(name, blocks_needed(shape), threads=1)
    ids = iter(range(1, 1 << 30))
    s = off_and_on_median(lambda: _seconds(lambda: w.step(build_step(shape, next(ids), w.info.vocab_size))), rounds)
    emit(section="step", variant=name, step=step_name, off_ms=s[False] * 1e3, on_ms=s[True] * 1e3)
    return [name, step_name, fmt(s[False] * 1e3), fmt(s[True] * 1e3), f"{s[False] / s[True]:.2f}x"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--megabytes", type=int, default=128, help="weights per case (several times the L3)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--variants", nargs="+", default=["Q4_1 gguf fp32", "Q4_1 gguf int8", "Q8_0 gguf fp32"], choices=list(VARIANTS)
    )
    parser.add_argument("--step", default="decode 1 x 256", choices=list(STEPS))
    parser.add_argument("--out", default="", help="also write bench/results/<out>.md")
    args = parser.parse_args(argv)
    if not cpu_ops.available():
        emit(section="skipped", reason="the C++ CPU kernels are not built here")
        return 1
    torch.set_num_threads(1)
    load_before = open("/proc/loadavg").read().split()[:3]
    emit(section="machine", cpu=read_cpu_features().describe(), load=load_before)
    roofline = sweep_bandwidth(args.megabytes, args.rounds)
    emit(section="sweep", gb_s=roofline)
    was = cpu_ops.use_work_pool(False)
    gemv = [gemv_row(name, args.megabytes, args.rounds, roofline) for name in args.cases]
    cpu_ops.use_work_pool(was)
    steps = [step_row(name, args.step, args.rounds) for name in args.variants if model_present(name)]
    load_after = open("/proc/loadavg").read().split()[:3]
    emit(section="end", load=load_after)
    if args.out:
        body = (
            f"One core's plain sweep over {args.megabytes} MB: **{roofline:.1f} GB/s** (the roofline below).\n\n"
            f"### A pass of GEMVs over ~{args.megabytes} MB of weights (1 row of x, 1 thread, work pool off; "
            f"median of {args.rounds} interleaved rounds)\n\n"
            + markdown_table(
                [
                    "weights, activations",
                    "MB",
                    "prefetch off",
                    "prefetch on",
                    "G weights/s on",
                    "speed-up",
                    "on / roofline",
                ],
                gemv,
            )
            + f"\n\n### The worker's {args.step} step (ms, median of {args.rounds} interleaved rounds, "
            f"1 torch thread, the work pool on)\n\n"
            + markdown_table(["variant", "step", "prefetch off", "prefetch on", "speed-up"], steps)
        )
        notes = f"Load average before: {' '.join(load_before)}; after: {' '.join(load_after)}."
        write_result(
            args.out,
            "Weight streaming from memory, software prefetch off and on (issue 38)",
            body,
            notes,
            module="cpu.weight_stream",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
