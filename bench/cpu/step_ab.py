"""One CPU worker step in two checkouts side by side: this one and another (`--base`, a
tree of an earlier commit: `git archive COMMIT | tar -x -C DIR`), for changes that a
flag of bench/cpu/worker_step.py cannot switch (the host path of a step: Python,
small ops, metadata).

Each (checkout, variant) is a child process running that checkout's own code (its
bench.cpu.worker_step builds the worker and the steps); the parent drives them round
by round, interleaved, and each child reports its step's CPU time on its own thread
(one torch thread: robust to the other processes sharing the machine). Then each
child runs the same steps under cProfile (thread CPU clock) and splits a step into
its C++ kernels (the pagedserve_cpu ops' own time) and the rest (the step's
unprofiled time less the kernels': Python, small torch ops, the step's input and
output). torch.profiler's split (worker_step --profile) is not used: its own cost per
recorded op lands outside the ops and made the host look ~3x larger than it is.

    python -m bench.cpu.step_ab --base /tmp/base --variants 'all fp32' 'Q4_1 gguf fp32' --out hostpath
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.harness.results import fmt, markdown_table, write_result

REPO = Path(__file__).resolve().parents[2]
ANSWER = "@@ "

# The child: commands on stdin ("step N", "profile N", "quit"), one JSON line per answer
# after ANSWER (the worker logs to stdout too).
CHILD = r"""
import cProfile, json, pstats, sys, time
from bench.cpu.worker_step import STEPS, MODEL_DIR, VARIANTS, blocks_needed, build_step
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

variant, step_name = sys.argv[1], sys.argv[2]
shape = STEPS[step_name]
config = WorkerConfig(model=str(MODEL_DIR), num_blocks=blocks_needed(shape), num_threads=1)
for key, value in VARIANTS[variant].items():
    setattr(config, key, value)
worker = Worker(config)
vocab = worker.info.vocab_size
for i in range(3):
    worker.step(build_step(shape, 1000 + i, vocab))
print("@@", json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    command, arg = line.split()
    if command == "step":
        step = build_step(shape, int(arg), vocab)
        start = time.thread_time()
        worker.step(step)
        print("@@", json.dumps({"ms": (time.thread_time() - start) * 1e3}), flush=True)
    elif command == "profile":
        steps = [build_step(shape, 2000 + i, vocab) for i in range(int(arg))]
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        for step in steps:
            worker.step(step)
        prof.disable()
        ops = {}
        for (file, _, name), (_, calls, own, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
            if file == "~" and "pagedserve_cpu" in name:
                ops[name.split(".")[-1].rstrip(">")] = own * 1e3 / len(steps)
        calls = sum(c for (file, _, name), (_, c, _, _, _) in pstats.Stats(prof).stats.items() if file == "~" and "torch" in name)
        print("@@", json.dumps({"kernels_ms": sum(ops.values()), "kernels": ops, "torch_calls": calls / len(steps)}), flush=True)
    else:
        break
"""


class Child:
    def __init__(self, checkout: Path, variant: str, step: str):
        env = dict(os.environ, PYTHONPATH=str(checkout))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, variant, step],
            cwd=checkout,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, command: str) -> dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the child exited ({self.proc.wait()})")
            if line.startswith(ANSWER):
                answer: dict[str, object] = json.loads(line[len(ANSWER) :])
                return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("quit 0\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, type=Path, help="the other checkout (its tree, models linked)")
    parser.add_argument("--variants", nargs="+", default=["all fp32", "Q4_1 gguf fp32"])
    parser.add_argument("--step", default="decode 1 x 256")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    trees = {"before": args.base.resolve(), "after": REPO}
    children = {(v, t): Child(path, v, args.step) for v in args.variants for t, path in trees.items()}
    try:
        for child in children.values():
            child.ask("")  # ready
        times: dict[tuple[str, str], list[float]] = {key: [] for key in children}
        for r in range(args.rounds):
            for key, child in children.items():
                times[key].append(float(child.ask(f"step {r}")["ms"]))  # type: ignore[arg-type]
        profiles = {key: child.ask(f"profile {args.profile_steps}") for key, child in children.items()}
    finally:
        for child in children.values():
            child.close()
    rows = []
    for v in args.variants:
        for t in trees:
            ms = statistics.median(times[v, t])
            ops = float(profiles[v, t]["kernels_ms"])  # type: ignore[arg-type]
            calls = float(profiles[v, t]["torch_calls"])  # type: ignore[arg-type]
            rows.append([v, t, fmt(ms), fmt(ops), fmt(max(0.0, ms - ops)), fmt(calls, 0)])
            print(json.dumps({"variant": v, "tree": t, "ms": ms, **profiles[v, t]}), flush=True)
        before, after = (statistics.median(times[v, t]) for t in trees)
        rows.append([v, "after / before", fmt(after / before, 3), "", "", ""])
    headers = ["variant", "tree", "step ms", "C++ kernels ms", "the rest ms", "torch calls / step"]
    table = markdown_table(headers, rows)
    print(table)
    if args.out:
        body = (
            f"`{args.step}`, ms per step: median of {args.rounds} interleaved rounds, CPU time of each "
            f"worker's stepping thread (1 torch thread). C++ kernels: the pagedserve_cpu ops' own time "
            f"under cProfile ({args.profile_steps} steps; linears, attention, norms, RoPE); the rest: the "
            f"step less its kernels (Python, the small torch ops, the step's input and output).\n\n{table}"
        )
        load = open("/proc/loadavg").read().split()[:3]
        write_result(args.out, "A CPU decode step's host path, before and after", body, f"Load after: {' '.join(load)}.",
                     module="cpu.step_ab")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
