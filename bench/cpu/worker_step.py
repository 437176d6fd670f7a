"""The CPU worker's own step, in-process, for issue 25 phase B: the same steps through
Worker objects built with different flags, side by side in one process, interleaved,
as CPU time of this thread (one torch thread: every op runs here, so the figure is
the step's cost, unmoved by the other sessions sharing the machine; --threads 2 gives
wall times instead).

Steps of the default model, shaped like bench/peers.py's workloads:
  decode 1 x 256         one stream (ITL)
  decode 1 x 1024        one stream at a long context (attention cut into segments)
  decode 32 x 320        32 streams, mid-way through 256 in / 128 out
  decode 16 x 1088       16 streams sharing a 1,024-token prefix (the prefix blocks shared)
  verify 1 x 256 + 4     one stream verifying 4 drafts (speculative decoding: 5 positions)
  verify 2 x 256 + 4     2 streams verifying 4 drafts each
  prefill 8 x 256        fresh prompts (TTFT at 32 streams: four such steps)
  prefill 16 x 64 / 1k   each stream's own 64 tokens over the shared cached prefix

Variants (--variants): today's path (the torch reference attention, the per-op
eager forward: --attention-backend torch --enforce-eager), the C++ attention alone
(--enforce-eager), and everything (the defaults), in bf16 and fp32; the shipped Q4_1
GGUF served from its blocks, and llama.cpp's Q4_K_M of it where `bench.peers --gguf`
has made that file (PEERS_CACHE; the variant is skipped, with a line saying so, if not).

    python -m bench.cpu.worker_step                        # every step, every variant
    python -m bench.cpu.worker_step --steps "decode 1 x 256" --profile
    python -m bench.cpu.worker_step --variants "today bf16" "all bf16" --profile --out cpu_worker_step
                                                           # and bench/results/cpu_worker_step.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.harness.llama_cpp import made_gguf
from bench.harness.results import fmt, markdown_table, write_result
from svc_common.cpu_features import read_cpu_features
from tools.prepare_default_model import shipped_gguf
from worker_svc.config import WorkerConfig
from worker_svc.step.builder import StepBuilder
from worker_svc.step.input import StepInput
from worker_svc.worker import Worker

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "SmolLM2-135M-Instruct"
# The GGUF that MODEL_DIR was converted from (tools/prepare_default_model.py): the same
# values, served from its Q4_1 blocks (issue 38).
SHIPPED_GGUF = str(shipped_gguf())
BLOCK = 16


@dataclass(frozen=True)
class StepShape:
    seqs: int
    new_tokens: int  # per sequence (1: decode)
    context: int  # per sequence, the new tokens included
    shared_prefix: int = 0  # tokens of the context every sequence shares (same blocks)
    drafts: int = 0  # per sequence, of its new tokens: a speculative verification chunk


STEPS = {
    "decode 1 x 256": StepShape(1, 1, 256),
    "decode 1 x 1024": StepShape(1, 1, 1024),
    "decode 32 x 320": StepShape(32, 1, 320),
    "decode 16 x 1088": StepShape(16, 1, 1088, shared_prefix=1024),
    "verify 1 x 256 + 4": StepShape(1, 5, 256, drafts=4),
    "verify 2 x 256 + 4": StepShape(2, 5, 256, drafts=4),
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
    "Q4_1 gguf fp32": dict(dtype="float32", model=SHIPPED_GGUF),
    "Q4_1 gguf bf16": dict(dtype="bfloat16", model=SHIPPED_GGUF),
    # int8 activations as served (bench.peers' --pagedserve-args): with a bf16 KV cache.
    "Q4_1 gguf int8": dict(dtype="float32", model=SHIPPED_GGUF, quant_activations="int8", kv_dtype="bf16"),
    # llama.cpp's most used preset (Q4_K and Q6_K; for SmolLM2 mostly Q5_0, as 576 is no
    # multiple of 256), as bench.peers --gguf makes it
    # from the shipped file with llama-quantize into PEERS_CACHE: skipped where it is absent.
    "Q4_K_M gguf fp32": dict(dtype="float32", model=str(made_gguf("Q4_K_M"))),
    "Q4_K_M gguf int8": dict(
        dtype="float32", model=str(made_gguf("Q4_K_M")), quant_activations="int8", kv_dtype="bf16"
    ),
    "Q8_0 gguf fp32": dict(dtype="float32", model=str(made_gguf("Q8_0"))),
    "Q8_0 gguf int8": dict(dtype="float32", model=str(made_gguf("Q8_0")), quant_activations="int8", kv_dtype="bf16"),
    # The C++ layer loop off (PAGEDSERVE_LAYER_LOOP=0 at load): the Python loop per layer.
    "all fp32 python loop": dict(dtype="float32", layer_loop="0"),
    "Q4_1 gguf fp32 python loop": dict(dtype="float32", model=SHIPPED_GGUF, layer_loop="0"),
}


def model_present(variant: str) -> bool:
    """Whether the variant's model file is here (a made GGUF may not be); says so if not."""
    model = VARIANTS[variant].get("model")
    if model is None or Path(str(model)).exists():
        return True
    emit(section="skipped", variant=variant, reason=f"{model} is absent: `python -m bench.peers --gguf` makes it")
    return False


def variant_worker(name: str, num_blocks: int, threads: int) -> Worker:
    config = WorkerConfig(model=str(MODEL_DIR), num_blocks=num_blocks, num_threads=threads)
    fields = dict(VARIANTS[name])
    os.environ["PAGEDSERVE_LAYER_LOOP"] = str(fields.pop("layer_loop", "1"))  # read at load
    for key, value in fields.items():
        setattr(config, key, value)
    return Worker(config)


def build_step(shape: StepShape, step_id: int, vocab: int) -> StepInput:
    """Sequence s owns blocks after the shared prefix's; every row sampled (greedy);
    a verification chunk's last `drafts` tokens are drafts (random: all rejected,
    which costs what an accepted run does)."""
    g = torch.Generator().manual_seed(step_id)
    prefix_blocks = shape.shared_prefix // BLOCK
    own_blocks = -(-(shape.context - shape.shared_prefix) // BLOCK)
    builder = StepBuilder(BLOCK)
    for s in range(shape.seqs):
        table = list(range(prefix_blocks)) + [prefix_blocks + s * own_blocks + b for b in range(own_blocks)]
        start = shape.context - shape.new_tokens
        ids = torch.randint(100, vocab, (shape.new_tokens,), generator=g).tolist()
        builder.add(s, ids, start, table, sample=True)
    step = builder.build(step_id)
    if not shape.drafts:
        return step
    drafts = np.full(shape.seqs, shape.drafts, dtype=np.int64)
    return dataclasses.replace(step, seqs=dataclasses.replace(step.seqs, num_drafts=drafts))


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


# Op families of a step's profile, by the op's name after its namespace (pagedserve_cpu's
# ops included: linear, quant_linear, add_rms_norm).
OP_FAMILIES = {
    "linear (weights)": ("linear", "quant_linear", "addmm", "mm", "matmul", "_linear_pointwise", "_mkl_linear"),
    "attention": ("scaled_dot_product", "_scaled_dot_product", "paged", "index_select", "_softmax"),
    "kv write": ("index_put",),
    "rms_norm": ("rms_norm", "add_rms_norm"),
    "rope / elementwise": ("mul", "add", "cat", "neg", "cos", "sin", "silu", "sub", "slice", "to", "copy_", "_to_copy"),
}


def profile(worker: Worker, shape: StepShape, steps: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """(ms by op family, the 10 costliest ops' ms) of one step, `steps` steps averaged.
    torch.profiler times ops by the wall clock, which a loaded machine stretches: each
    op's share of the profiled steps' wall time is scaled to their CPU time (this
    thread's), so the split adds up to the step's cost; "host (outside ops)" is the rest
    (Python, the step's input and output)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    vocab = worker.info.vocab_size
    worker.step(build_step(shape, 1, vocab))
    clock = timer(False)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start, wall = clock(), time.perf_counter()
        for i in range(steps):
            worker.step(build_step(shape, 2 + i, vocab))
        cpu_ms, wall_ms = (clock() - start) * 1e3 / steps, (time.perf_counter() - wall) * 1e3 / steps
    split: dict[str, float] = {}
    ops: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key.split("::")[-1]
        family = next((f for f, keys in OP_FAMILIES.items() if any(name.startswith(k) for k in keys)), "other ops")
        ms = event.self_cpu_time_total / 1e3 / steps * cpu_ms / wall_ms
        split[family] = split.get(family, 0.0) + ms
        ops[event.key] = ms
    split["host (outside ops)"] = max(0.0, cpu_ms - sum(split.values()))
    return split, dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10])


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
    parser.add_argument("--out", default="", help="also write bench/results/<out>.md")
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
    args.variants = [name for name in args.variants if model_present(name)]
    workers = {}
    for name in args.variants:
        workers[name] = variant_worker(name, num_blocks, args.threads)
    step_ms: dict[str, dict[str, float]] = {}
    splits: dict[tuple[str, str], tuple[dict[str, float], dict[str, float]]] = {}
    for step_name in args.steps:
        shape = STEPS[step_name]
        ms = step_ms[step_name] = measure(workers, shape, args.rounds, args.wall)
        tokens = shape.seqs * shape.new_tokens
        emit(section="step", step=step_name, ms=ms, tok_s={k: tokens / v * 1e3 for k, v in ms.items()})
        if args.profile:
            for name, w in workers.items():
                split, top = splits[step_name, name] = profile(w, shape)
                emit(section="profile", step=step_name, variant=name, split_ms=split, top_ops_ms=top)
    load = open("/proc/loadavg").read().split()[:3]
    emit(section="end", load=load)
    if args.out:
        write_report(args, step_ms, splits, load)
    return 0


def write_report(
    args: argparse.Namespace,
    step_ms: dict[str, dict[str, float]],
    splits: dict[tuple[str, str], tuple[dict[str, float], dict[str, float]]],
    load_after: list[str],
) -> None:
    """bench/results/<out>.md: ms per step and variant, then each profiled step's split."""
    clock = "wall time" if args.wall or args.threads > 1 else "CPU time of the stepping thread"
    body = markdown_table(
        ["step", *args.variants], [[s, *(fmt(ms[v]) for v in args.variants)] for s, ms in step_ms.items()]
    )
    body = (
        f"ms per step, median of {args.rounds} interleaved rounds, {clock}, {args.threads} torch thread(s).\n\n{body}"
    )
    if splits:
        by_family = {key: split for key, (split, _) in splits.items()}
        families = sorted(
            {f for split in by_family.values() for f in split},
            key=lambda f: -max(split.get(f, 0.0) for split in by_family.values()),
        )
        rows = [[s, v, *(fmt(split.get(f, 0.0)) for f in families)] for (s, v), split in by_family.items()]
        body += "\n\n### Where a step's time goes (ms: torch.profiler's self time per op family, 5 steps averaged, "
        body += "scaled from the wall clock to the steps' CPU time; host: the rest)\n\n"
        body += markdown_table(["step", "variant", *families], rows)
    notes = f"Load average after: {' '.join(load_after)}. Workers built in-process from the default model."
    write_result(args.out, "The CPU worker's own step, side by side (issue 25)", body, notes, module="cpu.worker_step")


if __name__ == "__main__":
    sys.exit(main())
