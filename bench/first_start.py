"""What a first `make serve` does before its workers load, per default model: on a CPU
the shipped GGUF's tokenizer, chat template and config extracted (`--sidecar`, what
`make serve` runs now), against the whole GGUF converted into an fp32 checkpoint
(`make model`, what it ran before; still what CUDA workers serve).

    python -m bench.first_start [--rounds 2]

Each step is a fresh process into a fresh temporary folder, the two alternating
(round after round), so both see the same machine load; wall seconds and the child's
CPU seconds (user + system), the median over rounds.
"""

from __future__ import annotations

import argparse

from bench.harness.machine import announce, load_average
from bench.harness.results import fmt, markdown_table, median, write_result
from bench.harness.services import run_timed_tool

STEPS = {
    "GGUF served as it is: its tokenizer extracted (--sidecar)": ["--sidecar"],
    "checkpoint served: the GGUF converted (make model)": ["--out", "{tmp}/checkpoint"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    announce("first_start")
    walls: dict[str, list[float]] = {name: [] for name in STEPS}
    cpus: dict[str, list[float]] = {name: [] for name in STEPS}
    loads = [load_average()]
    for _ in range(args.rounds):
        for name, flags in STEPS.items():
            wall, cpu = run_timed_tool("tools.prepare_default_model", flags)
            walls[name].append(wall)
            cpus[name].append(cpu)
            print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
        loads.append(load_average())
    gguf, converted = (median(walls[n]) for n in STEPS)
    rows = [[name, fmt(median(walls[name])), fmt(median(cpus[name])), fmt(median(walls[name]) / converted, 2)]
            for name in STEPS]  # fmt: skip
    body = markdown_table(["before the workers load", "wall s", "CPU s", "vs conversion"], rows)
    notes = (
        f"Median of {args.rounds} rounds, the two steps alternating; load average "
        f"{min(loads):.1f}-{max(loads):.1f} during the run. The first start saves {converted - gguf:.0f} s "
        "(and the checkpoint's 538 MB on disk); the worker's own start then reads the 98 MB GGUF instead "
        "(bench/results/peers_gguf.md: start until ready 17.6 s vs 13.1 s for the fp32 checkpoint, quiet)."
    )
    path = write_result("first_start", "A first make serve: the default model's preparation", body, notes)
    print(path.read_text())


if __name__ == "__main__":
    main()
