"""The CPU worker's own step, in-process, for issue 25 phase B: the same steps through
Worker objects built with different flags, side by side in one process, interleaved,
as CPU time of this thread (one torch thread: every op runs here, so the figure is
the step's cost, unmoved by the other sessions sharing the machine; --threads 2 gives
wall times instead).

Steps of the default model, shaped like bench/peers.py's workloads:
  decode 1 x 256         one stream (ITL)
  decode 32 x 320        32 streams, mid-way through 256 in / 128 out
  decode 16 x 1088       16 streams sharing a 1,024-token prefix (the prefix blocks shared)
  prefill 8 x 256        fresh prompts (TTFT at 32 streams: four such steps)
  prefill 16 x 64 / 1k   each stream's own 64 tokens over the shared cached prefix

Variants (--variants): today's path (the torch reference attention, the per-op
eager forward: --attention-backend torch --enforce-eager), the C++ attention alone
(--enforce-eager), and everything (the defaults), in bf16 and fp32.

    python -m bench.cpu.worker_step                        # every step, every variant
    python -m bench.cpu.worker_step --steps "decode 1 x 256" --profile
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from svc_common.cpu_features import read_cpu_features
from worker_svc.config import WorkerConfig
from worker_svc.step.builder import StepBuilder
from worker_svc.step.input import StepInput
from worker_svc.worker import Worker

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "SmolLM2-135M-Instruct"
BLOCK = 16


@dataclass(frozen=True)
class StepShape:
    seqs: int
    new_tokens: int  # per sequence (1: decode)
    context: int  # per sequence, the new tokens included
    shared_prefix: int = 0  # tokens of the context every sequence shares (same blocks)


STEPS = {
    "decode 1 x 256": StepShape(1, 1, 256),
    "decode 32 x 320": StepShape(32, 1, 320),
    "decode 16 x 1088": StepShape(16, 1, 1088, shared_prefix=1024),
    "prefill 8 x 256": StepShape(8, 256, 256),
    "prefill 16 x 64 / 1k": StepShape(16, 64, 1088, shared_prefix=1024),
}

# name -> WorkerConfig fields over the defaults
VARIANTS: dict[str, dict[str, object]] = {
    "today bf16": dict(dtype="bfloat16", attention_backend="torch", enforce_eager=True),
    "C++ attention bf16": dict(dtype="bfloat16", enforce_eager=True),
    "all bf16": dict(dtype="bfloat16"),
    "today fp32": dict(dtype="float32", attention_backend="torch", enforce_eager=True),
    "C++ attention fp32": dict(dtype="float32", enforce_eager=True),
    "all fp32": dict(dtype="float32"),
}


def build_step(shape: StepShape, step_id: int, vocab: int) -> StepInput:
    """Sequence s owns blocks after the shared prefix's; every row sampled (greedy)."""
    g = torch.Generator().manual_seed(step_id)
    prefix_blocks = shape.shared_prefix // BLOCK
    own_blocks = -(-(shape.context - shape.shared_prefix) // BLOCK)
    builder = StepBuilder(BLOCK)
    for s in range(shape.seqs):
        table = list(range(prefix_blocks)) + [prefix_blocks + s * own_blocks + b for b in range(own_blocks)]
        start = shape.context - shape.new_tokens
        ids = torch.randint(100, vocab, (shape.new_tokens,), generator=g).tolist()
        builder.add(s, ids, start, table, sample=True)
    return builder.build(step_id)


def blocks_needed(shape: StepShape) -> int:
    return shape.shared_prefix // BLOCK + shape.seqs * -(-(shape.context - shape.shared_prefix) // BLOCK) + 1


def timer(wall: bool) -> Callable[[], float]:
    return time.thread_time if torch.get_num_threads() == 1 and not wall else time.perf_counter


def measure(workers: dict[str, Worker], shape: StepShape, rounds: int, wall: bool = False) -> dict[str, float]:
    """Median ms per step of each worker, interleaved round by round."""
    now = timer(wall)
    times: dict[str, list[float]] = {name: [] for name in workers}
    vocab = next(iter(workers.values())).info.vocab_size
    for w in workers.values():
        w.step(build_step(shape, 1, vocab))  # warm: first-call allocations
    for r in range(rounds):
        for name, w in workers.items():
            step = build_step(shape, r + 2, vocab)
            start = now()
            w.step(step)
            times[name].append((now() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def profile(worker: Worker, shape: StepShape) -> dict[str, object]:
    from bench.cpu.decode_study import profile_split

    vocab = worker.info.vocab_size
    split, top = profile_split(lambda: worker.step(build_step(shape, 1, vocab)))
    return {"split_ms": split, "top_ops_ms": top}


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="wall time even with one thread")
    parser.add_argument("--profile", action="store_true", help="torch.profiler split of each variant's step")
    args = parser.parse_args(argv)
    emit(
        section="machine",
        cpu=read_cpu_features().describe(),
        torch=torch.__version__,
        threads=args.threads,
        clock="wall" if args.wall or args.threads > 1 else "CPU time of this thread",
        load=open("/proc/loadavg").read().split()[:3],
    )
    num_blocks = max(blocks_needed(STEPS[s]) for s in args.steps)
    workers = {}
    for name in args.variants:
        config = WorkerConfig(model=str(MODEL_DIR), num_blocks=num_blocks, num_threads=args.threads)
        for key, value in VARIANTS[name].items():
            setattr(config, key, value)
        workers[name] = Worker(config)
    for step_name in args.steps:
        shape = STEPS[step_name]
        ms = measure(workers, shape, args.rounds, args.wall)
        tokens = shape.seqs * shape.new_tokens
        emit(section="step", step=step_name, ms=ms, tok_s={k: tokens / v * 1e3 for k, v in ms.items()})
        if args.profile:
            for name, w in workers.items():
                emit(section="profile", step=step_name, variant=name, **profile(w, shape))
    emit(section="end", load=open("/proc/loadavg").read().split()[:3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
