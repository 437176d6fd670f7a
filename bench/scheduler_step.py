"""The scheduler's CPU time per decode step, in process, in this revision and in a
baseline revision (a temporary git worktree), in the same run: no worker, no RPC,
only the scheduler's own code for one step of N decoding sequences.

    python -m bench.scheduler_step [--baseline REV | --no-baseline] [--batch 64 256] [--steps 80] [--rounds 3]

N requests (prompts of 40-80 random ids, greedy, ignore_eos) run in an EngineCore's
planner and streams (tiny Llama tokenizer); after the prefill, per decode step:
* plan: Planner.schedule;
* send: plan_to_proto + SerializeToString (what goes to the worker);
* result: a worker reply (one sampled token per sequence, in bytes, made beforehand)
  parsed (StepResponse.FromString + result_from_proto), applied (Planner.update),
  dispatched to the request streams (EngineCore._dispatch: detokenizing, events) and
  sent (streams.coalesce + event_to_proto + SerializeToString per client message).
Each figure is the median over --steps steps of time.process_time (CPU time, which
other processes on a shared machine do not inflate); the revisions alternate
--rounds times, each in its own process, and the lowest median per stage is kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

NAME = "scheduler_step"
DEFAULT_BASELINE = "70b3116"  # before the columnar sampled-token path (issue 24 item 2)
STAGES = ("plan", "send", "result", "total")


def measure(model: str, batch: int, steps: int) -> dict[str, float]:
    """Median CPU ms per stage, for the scheduler this process imports (any revision's)."""
    import random
    from types import SimpleNamespace

    from proto import worker_pb2
    from scheduler_svc.api.serving import event_to_proto
    from scheduler_svc.engine.core import EngineCore
    from scheduler_svc.engine.streams import coalesce
    from scheduler_svc.engine.worker_client import plan_to_proto, result_from_proto
    from scheduler_svc.kv.block_manager import KVCacheManager
    from scheduler_svc.kv.block_pool import BlockPool
    from scheduler_svc.planning.planner import Planner, PlannerConfig
    from scheduler_svc.request import Request, SamplingOptions
    from scheduler_svc.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    rng = random.Random(batch)
    config = PlannerConfig(max_num_seqs=batch, max_model_len=4096, block_size=16, max_waiting=4096)
    planner = Planner(config, KVCacheManager(BlockPool(8192, 16, enable_prefix_caching=False)))
    core = EngineCore(client=None, info=SimpleNamespace(address="w"), planner=planner, tokenizer=tokenizer)
    sampling = SamplingOptions(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    handles = [
        core.add(Request(f"r{i}", i + 1, [rng.randrange(4, 700) for _ in range(rng.randint(40, 80))], sampling))
        for i in range(batch)
    ]

    def reply_for(plan) -> bytes:
        rows = [s for s in plan.seqs if s.sample]
        columns = worker_pb2.SampledColumns(
            seq_ids=[s.seq_id for s in rows],
            token_ids=[(s.seq_id * 7 + plan.step_id) % 700 + 4 for s in rows],
            logprobs=[-0.5] * len(rows),
        )
        return worker_pb2.StepResponse(step_id=plan.step_id, sampled=columns, instance_id="i").SerializeToString()

    def apply(plan, payload: bytes) -> None:
        result = result_from_proto(worker_pb2.StepResponse.FromString(payload))
        if hasattr(result, "samples"):
            updates = planner.update(plan, result.samples)
        else:  # before the columnar path: (token id, logprob) per seq_id
            updates = planner.update(plan, result.sampled, result.logprobs)
        core._dispatch(updates)
        for handle in handles:
            while not handle.events.empty():
                event, _ = coalesce(handle.events, handle.events.get_nowait())
                event_to_proto(event, "request", tokenizer).SerializeToString()

    while any(not r.output_token_ids for r in planner.running) or planner.num_waiting:
        plan = planner.schedule()
        apply(plan, reply_for(plan))
    if planner.num_running != batch:
        raise RuntimeError(f"expected {batch} decoding sequences, got {planner.num_running}")
    cpu: dict[str, list[float]] = {stage: [] for stage in STAGES}
    for _ in range(steps):
        start = time.process_time()
        plan = planner.schedule()
        planned = time.process_time()
        plan_to_proto(plan).SerializeToString()
        sent = time.process_time()
        payload = reply_for(plan)  # the worker's part: not timed
        applying = time.process_time()
        apply(plan, payload)
        done = time.process_time()
        for stage, ms in zip(STAGES, (planned - start, sent - planned, done - applying)):
            cpu[stage].append(ms * 1e3)
        cpu["total"].append((planned - start + sent - planned + done - applying) * 1e3)
    return {stage: sorted(values)[len(values) // 2] for stage, values in cpu.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="revision to compare against (git worktree)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="", help="tokenizer's checkpoint (default: the tiny Llama)")
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:  # in a revision's tree: imports nothing of bench/
        print("SCHEDSTEP " + json.dumps({b: measure(args.model, b, args.steps) for b in args.batch}))
        return
    from bench.harness.machine import announce, load_average
    from bench.harness.results import fmt, markdown_table, write_result
    from bench.harness.services import REPO, make_worktree, remove_worktree, rev_of, run_in_tree, tiny_model

    announce(NAME)
    model = args.model or str(tiny_model("llama"))
    trees = {"current": REPO}
    if not args.no_baseline:
        trees[f"baseline {rev_of(args.baseline)}"] = make_worktree(args.baseline)
    argv = [str(Path(__file__).resolve()), "--measure-only", "--model", model, "--steps", str(args.steps)]
    argv += ["--batch", *map(str, args.batch)]
    load_before = load_average()
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    try:
        for i in range(args.rounds):
            for name in list(trees)[:: 1 if i % 2 == 0 else -1]:  # alternate who goes first
                rounds[name].append(run_in_tree(trees[name], argv, "SCHEDSTEP"))
    finally:
        for root in trees.values():
            if root != REPO:
                remove_worktree(root)
    best = {
        name: {b: {s: min(r[str(b)][s] for r in runs) for s in STAGES} for b in args.batch}
        for name, runs in rounds.items()
    }
    rows = [[b, name, *(fmt(best[name][b][s], 3) for s in STAGES)] for b in args.batch for name in trees]
    if len(trees) == 2:
        cur, base = best["current"], best[list(trees)[1]]
        rows += [[b, "current / baseline", *(f"{cur[b][s] / base[b][s]:.2f}x" for s in STAGES)] for b in args.batch]
    table = markdown_table(["decoding seqs", "revision", *(f"{s} CPU ms" for s in STAGES)], rows)
    print(table)
    notes = (
        f"Lowest of {args.rounds} rounds' medians over {args.steps} decode steps, CPU time (time.process_time) of "
        f"one process running the scheduler's planner, streams and proto code; tokenizer `{Path(model).name}`. "
        f"Load average (1 min) {load_before:.2f} before, {load_average():.2f} after. plan = Planner.schedule; send "
        "= plan_to_proto + serialize; result = parse the reply + Planner.update + dispatch to the streams + "
        "coalesce and serialize each client message."
    )
    write_result(NAME, "The scheduler's CPU per decode step, current vs baseline", table, notes)


if __name__ == "__main__":
    sys.exit(main())
