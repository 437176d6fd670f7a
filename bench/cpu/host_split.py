"""Where a CPU decode step's host time goes, per layer: cProfile over a worker's
steps (bench/cpu/worker_step.py's steps and variants), each function's own time
sorted into

  C++ kernels      the pagedserve_cpu ops (torch.ops' call into the op: the kernel
                   and its dispatch), and the C++ layer loop's call (its kernels and
                   the ATen ops it calls between them: views, bias adds, activations)
  torch ops        every other torch call made from Python (view, split, add, chunk,
                   silu, mul, the embedding, the sampler's): dispatch and their work
  op wrappers      the Python frames of torch.ops (torch/_ops.py) and of kernels/
  model Python     the Python frames of worker_svc/models and worker_svc/attention
  step Python      the rest (the worker's step: validation, planning, upload, sampling)

cProfile's own cost inflates the Python rows, so the figures are for comparing
variants with each other, not absolute; a layer's share is the step's row over the
model's layers.

    python -m bench.cpu.host_split --variants "all fp32" "Q4_1 gguf fp32"
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch

from bench.cpu.worker_step import STEPS, VARIANTS, blocks_needed, build_step, variant_worker
from worker_svc.worker import Worker

ROWS = ("C++ kernels", "torch ops", "op wrappers", "model Python", "step Python")


def row(file: str, name: str) -> str:
    """The row a profiled function's own time belongs to."""
    if file == "~":  # a builtin: a C function called from Python
        if "pagedserve_cpu" in name or "DecoderLoop" in name or "ScriptMethod" in name or "ScriptObject" in name:
            return "C++ kernels"
        return "torch ops" if "torch" in name or "Tensor" in name or "method" in name else "step Python"
    if file.endswith("kernels/decoder_loop.py") and name == "__call__":  # its own time is the C++ loop's
        return "C++ kernels"
    if "torch/_ops.py" in file or "/kernels/" in file:
        return "op wrappers"
    if "worker_svc/models/" in file or "worker_svc/attention/" in file:
        return "model Python"
    return "step Python"


def split(worker: Worker, step_name: str, steps: int) -> dict[str, float]:
    """ms per step by row, over `steps` profiled steps."""
    shape = STEPS[step_name]
    vocab = worker.info.vocab_size
    worker.step(build_step(shape, 1, vocab))
    profiler = cProfile.Profile(time.thread_time)  # CPU time: the machine's load does not stretch it
    for i in range(steps):
        step = build_step(shape, 2 + i, vocab)
        profiler.enable()
        worker.step(step)
        profiler.disable()
    totals = dict.fromkeys(ROWS, 0.0)
    calls = 0
    for (file, _line, name), (_cc, nc, tottime, _cum, _callers) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        totals[row(file, name)] += tottime * 1e3 / steps
        calls += nc
    return {**totals, "calls": calls / steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = ["all fp32", "all fp32 python loop", "Q4_1 gguf fp32", "Q4_1 gguf fp32 python loop"]
    parser.add_argument("--variants", nargs="+", default=default, choices=list(VARIANTS))
    parser.add_argument("--step", default="decode 1 x 256", choices=list(STEPS))
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.variants:
        worker = variant_worker(name, blocks_needed(STEPS[args.step]), 1)
        layers = worker.model.spec.num_layers
        ms = split(worker, args.step, args.steps)
        per_layer = {k: round(v / layers, 3) for k, v in ms.items() if k in ROWS[1:4]}
        print(json.dumps({"variant": name, "step": args.step, "ms_per_step": ms, "ms_per_layer": per_layer}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
