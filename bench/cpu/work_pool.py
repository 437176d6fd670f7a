"""The work pool of the weight-streaming kernels (kernels/csrc/work_pool.h) on and off,
side by side: the same Worker objects (bench/cpu/worker_step.py's variants, one torch
thread: the thread plan's small steps on 2 cores) step with the pool off, then on, then
off..., round by round, and each step is timed by the wall clock (what the pool buys: a
second core's share of the GEMVs), the stepping thread's CPU time and the whole
process's (what it costs: the helper's chunks and its spin after each call).

The machine's load average is printed before and after: on a machine shared with other
work the wall times are the loaded ones (the helper gets the second core only when the
other processes leave it).

    python -m bench.cpu.work_pool                               # Q4_1 and Q8_0, decode 1 and 32
    python -m bench.cpu.work_pool --variants "Q4_1 gguf fp32" --steps "decode 1 x 256" --rounds 20
    python -m bench.cpu.work_pool --out cpu_work_pool           # and bench/results/cpu_work_pool.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.cpu.worker_step import STEPS, VARIANTS, blocks_needed, build_step, emit, model_present, variant_worker
from bench.harness.off_on import off_and_on
from bench.harness.results import fmt, markdown_table, write_result
from kernels import cpu_ops
from svc_common.cpu_features import read_cpu_features
from worker_svc.worker import Worker

CLOCKS = ("wall", "thread CPU", "process CPU")


def step_times(w: Worker, step_id: int, step_name: str) -> tuple[float, float, float]:
    step = build_step(STEPS[step_name], step_id, w.info.vocab_size)
    wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
    w.step(step)
    return (
        (time.perf_counter() - wall) * 1e3,
        (time.thread_time() - thread) * 1e3,
        (time.process_time() - process) * 1e3,
    )


def measure(w: Worker, step_name: str, rounds: int) -> dict[bool, tuple[float, ...]]:
    """Median (wall, thread CPU, process CPU) ms per step, pool off and on, alternating
    which goes first from round to round."""
    ids = iter(range(1, 1 << 30))
    times = off_and_on(cpu_ops.use_work_pool, lambda: step_times(w, next(ids), step_name), rounds)
    return {on: tuple(statistics.median(t[i] for t in ts) for i in range(3)) for on, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", nargs="+", default=["decode 1 x 256", "decode 32 x 320"], choices=list(STEPS))
    parser.add_argument("--variants", nargs="+", default=["Q4_1 gguf fp32", "Q8_0 gguf fp32"], choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="", help="also write bench/results/<out>.md")
    args = parser.parse_args(argv)
    if not cpu_ops.available():
        emit(section="skipped", reason="the C++ CPU kernels are not built here")
        return 1
    load_before = open("/proc/loadavg").read().split()[:3]
    emit(section="machine", cpu=read_cpu_features().describe(), pool=vars(cpu_ops.work_pool_info()), load=load_before)
    num_blocks = max(blocks_needed(STEPS[s]) for s in args.steps)
    variants = [name for name in args.variants if model_present(name)]
    rows = []
    for name in variants:
        w = variant_worker(name, num_blocks, threads=1)
        for step_name in args.steps:
            ms = measure(w, step_name, args.rounds)
            emit(section="step", variant=name, step=step_name, off_ms=ms[False], on_ms=ms[True])
            rows.append(
                [name, step_name]
                + [f"{fmt(ms[False][i])} / {fmt(ms[True][i])} ({ms[False][i] / ms[True][i]:.2f}x)" for i in range(3)]
            )
        del w
    load_after = open("/proc/loadavg").read().split()[:3]
    emit(section="end", load=load_after, pool=vars(cpu_ops.work_pool_info()))
    if args.out:
        body = (
            f"ms per step, pool off / on (off / on), median of {args.rounds} interleaved rounds, "
            f"1 torch thread, {cpu_ops.work_pool_info().helpers} helper(s).\n\n"
            + markdown_table(["variant", "step", *(f"{c} off / on" for c in CLOCKS)], rows)
        )
        notes = f"Load average before: {' '.join(load_before)}; after: {' '.join(load_after)}."
        write_result(args.out, "The kernels' work pool on and off (issue 38)", body, notes, module="cpu.work_pool")
    return 0


if __name__ == "__main__":
    sys.exit(main())
