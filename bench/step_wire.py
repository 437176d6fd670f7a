"""The worker.v1 Step on the wire: the CPU time one step's request and reply
cost to convert and (de)serialize, on both sides, in this revision and in a
baseline revision (a temporary git worktree), in the same run. No model, no
RPC: only the code that turns a plan into bytes and the bytes into the
worker's StepInput, and the sampled tokens back.

    python -m bench.step_wire [--baseline REV | --no-baseline] [--repeats 300] [--rounds 3]

Steps (greedy, as the serving loop sends them):
* decode: 256 sequences of one token, 8-block tables (context 121);
* prefill: 32 sequences of 256 tokens from position 0, 16-block tables.

Request direction, per step: build = scheduler plan_to_proto(plan); encode =
SerializeToString; parse = StepRequest.FromString; to input = worker
step_from_proto; validate = step_input.validate. Reply direction: one sampled
token per sequence; reply = worker step_to_proto(out) + SerializeToString;
read = StepResponse.FromString + scheduler result_from_proto.

Each figure is the median of --repeats calls; the two revisions alternate
--rounds times (each in its own process) and the lowest median per stage is
kept, so that a burst of load from other processes on a shared machine shows
up as a spread between rounds, not as a difference between revisions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

NAME = "step_wire"
DEFAULT_BASELINE = "321503c"  # the last commit with one SequenceStep message per sequence
BLOCK_SIZE = 16
VOCAB = 49152
CASES = {"decode": (256, 1, 120, 8), "prefill": (32, 256, 0, 16)}  # seqs, tokens, start_pos, table blocks
STAGES = ["build", "encode", "parse", "to input", "validate", "request total", "reply", "read", "reply total"]


def plan_of(seqs: int, tokens: int, start: int, blocks: int):
    from scheduler_svc.planning.plan import ScheduledSeq, StepPlan
    from scheduler_svc.request import SamplingOptions

    sampling = SamplingOptions(temperature=0.0, max_tokens=128, ignore_eos=True)
    scheduled = []
    for i in range(seqs):
        table = list(range(i * blocks, (i + 1) * blocks))
        positions = range(start, start + tokens)
        scheduled.append(
            ScheduledSeq(
                request_id=f"r{i}",
                seq_id=i,
                token_ids=[(7 * i + p) % (VOCAB - 4) + 4 for p in positions],
                start_pos=start,
                block_table=table,
                slot_mapping=[table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions],
                sample=True,
                sampling=sampling,
            )
        )
    return StepPlan(step_id=1, seqs=scheduled)


def median_ms(repeats: int, fn, *args) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(repeats: int) -> dict[str, dict[str, float]]:
    """case -> stage -> median ms, for the revision this process imports."""
    return {case: measure_case(repeats, *shape) for case, shape in CASES.items()}


def measure_case(repeats: int, seqs: int, tokens: int, start: int, blocks: int) -> dict[str, float]:
    from proto import worker_pb2
    from scheduler_svc.engine.worker_client import plan_to_proto, result_from_proto
    from worker_svc.step.output import SampledRows, StepOutput
    from worker_svc.step.validation import Limits, validate
    from worker_svc.step_proto import step_from_proto, step_to_proto

    plan = plan_of(seqs, tokens, start, blocks)
    limits = Limits(VOCAB, seqs * blocks, BLOCK_SIZE, 4096)
    message = plan_to_proto(plan)
    payload = message.SerializeToString()
    parsed = worker_pb2.StepRequest.FromString(payload)
    step = step_from_proto(parsed)
    validate(step, limits)  # well formed: the figures are those of a step that passes
    rows = np.arange(seqs)
    sampled = SampledRows(rows.astype(np.uint64), (3 * rows) % VOCAB, -0.25 - rows / seqs)
    output = StepOutput(1, sampled, seqs * tokens, {"total_ms": 1.0})
    reply = step_to_proto(output, "instance").SerializeToString()

    def encode_reply() -> bytes:
        return step_to_proto(output, "instance").SerializeToString()

    def read_reply() -> object:
        return result_from_proto(worker_pb2.StepResponse.FromString(reply))

    t = {
        "build": median_ms(repeats, plan_to_proto, plan),
        "encode": median_ms(repeats, message.SerializeToString),
        "parse": median_ms(repeats, worker_pb2.StepRequest.FromString, payload),
        "to input": median_ms(repeats, step_from_proto, parsed),
        "validate": median_ms(repeats, validate, step, limits),
        "reply": median_ms(repeats, encode_reply),
        "read": median_ms(repeats, read_reply),
    }
    t["request total"] = t["build"] + t["encode"] + t["parse"] + t["to input"] + t["validate"]
    t["reply total"] = t["reply"] + t["read"]
    t["request bytes"] = len(payload)
    t["reply bytes"] = len(reply)
    return t


def measure_in(root: Path, repeats: int) -> dict[str, dict[str, float]]:
    """This script's measure() in a child process importing `root`'s code (this file
    imports nothing of bench/ at its top, so it runs in any revision's tree)."""
    from bench.harness.services import run_in_tree

    return run_in_tree(root, [str(Path(__file__).resolve()), "--measure-only", "--repeats", str(repeats)], "STEPWIRE")


def best(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {case: {k: min(r[case][k] for r in rounds) for k in rounds[0][case]} for case in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="revision to compare against (git worktree)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:
        print("STEPWIRE " + json.dumps(measure(args.repeats)))
        return
    from bench.harness.machine import announce, load_average
    from bench.harness.results import commit, fmt, markdown_table, write_result
    from bench.harness.services import REPO, make_worktree, remove_worktree

    announce(NAME)

    trees = {"current": REPO}
    if not args.no_baseline:
        trees[f"baseline {args.baseline}"] = make_worktree(args.baseline)
    load_before = load_average()
    try:
        rounds: dict[str, list] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, root in trees.items():
                rounds[name].append(measure_in(root, args.repeats))
    finally:
        for root in trees.values():
            if root != REPO:
                remove_worktree(root)
    results = {name: best(r) for name, r in rounds.items()}
    rows = [
        [case, name, *(fmt(t[s], 3) for s in STAGES), int(t["request bytes"]), int(t["reply bytes"])]
        for case in CASES
        for name, t in ((n, results[n][case]) for n in trees)
    ]
    table = markdown_table(["step", "revision", *(f"{s} ms" for s in STAGES), "request B", "reply B"], rows)
    print(table)
    notes = (
        f"Current = this working tree at {commit()}. Load average (1 min) {load_before:.2f} before the run, "
        f"{load_average():.2f} after; lowest of {args.rounds} rounds' medians of {args.repeats} calls. "
        "decode: 256 x 1 token, 8-block tables; prefill: 32 x 256 tokens, 16-block tables; greedy, "
        "one sampled token per sequence in the reply."
    )
    write_result(NAME, "worker.v1 Step conversion and (de)serialization, per step", table, notes)


if __name__ == "__main__":
    main()
