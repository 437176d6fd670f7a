"""Helpers shared by the benchmarks (beside bench/common.py): plots, percentiles,
process memory, worker Info, prompt text, transformers' static batch, progress bars,
timed token streams and the 4-prompt routing workload. Not a benchmark itself (bench/run_all.py knows it is a helper)."""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.common import RESULTS, markdown_table
from proto import worker_pb2, worker_pb2_grpc
from svc_common import defaults
from svc_common.processes import REPO, ServiceProcess

DEFAULT_MODEL = REPO / defaults.DEFAULT_MODEL


def require_model(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").exists():
        raise SystemExit(f"{path} missing: run `make model` first")
    return path


# ---- statistics --------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def spread(values: list[float], fmt: str) -> str:
    """The mean and, for several values, (min-max)."""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


# ---- plots -------------------------------------------------------------------
def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, name: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


# ---- progress ----------------------------------------------------------------
def progress(total: int, desc: str):
    """A tqdm bar on stderr (long runs show they are alive)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True, leave=False)


# ---- process memory (Linux /proc) ---------------------------------------------
def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size (VmHWM) since it started."""
    return _status_kb(pid, "VmHWM") / 1024


def rss_mb(pid: int) -> float:
    return _status_kb(pid, "VmRSS") / 1024


# ---- the worker's Info ---------------------------------------------------------
def worker_info(address: str) -> worker_pb2.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=30)


# ---- prompts -------------------------------------------------------------------
def text_words() -> list[str]:
    """English-ish technical prose that ships with CPython (the Language Reference)."""
    from pydoc_data.topics import topics

    return " ".join(topics[k] for k in sorted(topics)).split()


def word_prompts(n: int, min_words: int = 20, max_words: int = 120, seed: int = 0) -> list[str]:
    """n prompts of min_words..max_words words (uniform), cut from the text at random places."""
    words = text_words()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_words, max_words)
        start = rng.randrange(0, len(words) - length)
        prompts.append(" ".join(words[start : start + length]))
    return prompts


def random_token_ids(n: int, rng: random.Random, low: int = 100, high: int = 40000) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


# ---- transformers' static batch ----------------------------------------------------
def left_padded(prompts: list[list[int]], pad_id: int, device: str | None = None):
    """The prompts as one batch for transformers' generate, padded on the left (each
    row's prompt ends in the last column): input ids and attention mask."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention_mask


def generate_exactly(model, input_ids, attention_mask, max_tokens: int, pad_id: int):
    """transformers' greedy generate, exactly max_tokens new tokens a row (no early
    stop at EOS): the new tokens, [rows, max_tokens]."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out[:, input_ids.shape[1] :]


# ---- timed token streams ---------------------------------------------------------
@dataclass
class TimedStream:
    """One Generate stream read on its own thread: arrival time of every token."""

    client: object  # SchedulerClient
    token_ids: list[int]
    max_tokens: int
    times: list[float] = field(default_factory=list)  # perf_counter per received token
    first_token_at: float | None = None
    finished_at: float | None = None
    started_at: float = 0.0
    error: str | None = None
    _call: object = None
    _thread: threading.Thread | None = None
    _cancelled: bool = False

    def start(self) -> TimedStream:
        self.started_at = time.perf_counter()
        self._call = self.client.stream(
            prompt_token_ids=self.token_ids, max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True, timeout=3600
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        try:
            for reply in self._call:
                now = time.perf_counter()
                for _ in reply.token_ids:
                    self.times.append(now)
                if reply.token_ids and self.first_token_at is None:
                    self.first_token_at = now
                if reply.finished:
                    break
        except grpc.RpcError as err:
            if not self._cancelled:
                self.error = f"{err.code().name}: {err.details()}"
        self.finished_at = time.perf_counter()

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def join(self, timeout: float | None = None) -> None:
        if self._thread:
            self._thread.join(timeout)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def gaps_ms(self, start: float, end: float) -> list[float]:
        """Inter-token gaps whose later token arrived in (start, end]."""
        return [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:]) if start < b <= end]


def wait_until(
    predicate, timeout_s: float, interval_s: float = 0.01, what: str = "condition", streams: list[TimedStream] = ()
) -> None:
    """Poll predicate(); raise if it is still false after timeout_s, or at once if
    one of `streams` failed."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if failed := next((s for s in streams if s.error), None):
            raise RuntimeError(f"a stream failed while waiting for {what}: {failed.error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


# ---- the 4-prompt routing workload (bench/routing.py, bench/scheduler_routing.py) ----
ARRIVALS = ("burst", "paced")
Case = tuple[str, int, list[int]]  # (request id, system prompt index, prompt ids)


@dataclass
class RoutingRun:
    """One (policy, arrival, seed); a home is where a request ran: a worker or a scheduler."""

    policy: str
    arrival: str
    seed: int
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    ideal: float
    both: int  # system prompts (of 4) with requests on both homes, so computed twice
    per_home: tuple[int, ...]  # requests per home, the less loaded first
    wall_s: float


def routing_workload(seed: int, system_tokens: int) -> list[Case]:
    """32 cases, 8 for each of 4 system prompts, each with its own question; shuffled."""
    rng = random.Random(seed)
    systems = [[rng.randrange(4, 700) for _ in range(system_tokens)] for _ in range(4)]
    order = [g for g in range(4) for _ in range(8)]
    rng.shuffle(order)
    return [
        (f"s{seed}-{n}-p{g}", g, systems[g] + [rng.randrange(4, 700) for _ in range(rng.randrange(3, 12))])
        for n, g in enumerate(order)
    ]


def ideal_hit_rate(cases: list[Case], system_tokens: int) -> float:
    """Each system prompt computed once, its 7 other requests hitting all its full blocks."""
    full = system_tokens // 16 * 16  # full blocks of a system prompt (the tails never fill one)
    return 28 * full / sum(len(ids) for _, _, ids in cases)


def prompts_on_both(cases: list[Case], homes: list[object]) -> int:
    """How many system prompts had requests on two homes (homes[i]: where cases[i] ran)."""
    placed = collections.defaultdict(set)
    for (_, g, _), home in zip(cases, homes):
        placed[g].add(home)
    return sum(len(p) == 2 for p in placed.values())


def finished_records(service: ServiceProcess) -> list[dict]:
    """The "request finished" lines of a scheduler's JSON log."""
    lines = service.log_path.read_text().splitlines()
    records = (json.loads(line) for line in lines if line.startswith("{"))
    return [r for r in records if r.get("event") == "request finished"]


def send_all(cases: list[Case], send: Callable, arrival: str, gap_ms: float) -> tuple[list, float]:
    """send(case) for every case, one thread each: all at once (burst) or one every
    gap_ms (paced). The replies in case order, and the wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = []
        for case in cases:
            futures.append(pool.submit(send, case))
            if arrival == "paced":
                time.sleep(gap_ms / 1e3)
        replies = [f.result() for f in futures]
    return replies, time.perf_counter() - start


def routing_args(description: str, step_tokens_help: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="checkpoint directory; default: the tiny llama test checkpoint")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=48)
    parser.add_argument("--step-tokens", type=int, default=64, help=step_tokens_help)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="paced arrivals: time between two requests")
    args = parser.parse_args()
    if not args.model:
        from worker_svc.tiny_checkpoints import ensure_checkpoint

        args.model = str(ensure_checkpoint("llama"))
    return args


def run_routing_bench(
    description: str, step_tokens_help: str, policies: Collection[str], one_run: Callable, policy_header: str, home: str
) -> tuple[argparse.Namespace, str, dict[tuple[str, str], list[RoutingRun]], float]:
    """A routing benchmark's main up to its notes: parse the flags, run the grid, print the
    table. The flags, the table, the runs by (arrival, policy) and the seconds it took."""
    args = routing_args(description, step_tokens_help)
    runs, elapsed = run_routing_grid(args, policies, one_run, home)
    table, by_key = routing_table(runs, policies, policy_header, home)
    print(table)
    return args, table, by_key, elapsed


def run_routing_grid(
    args: argparse.Namespace, policies: Collection[str], one_run: Callable, home: str
) -> tuple[list[RoutingRun], float]:
    """Two workers up for the whole run; one_run(args, workers, policy, arrival, seed)
    for every seed, arrival and policy. The runs and the seconds they took."""
    worker_args = ["--model", args.model, "--dtype", args.dtype, "--num-blocks", "512"]
    workers = [ServiceProcess("worker_svc", worker_args) for _ in range(2)]
    width = max(map(len, policies))
    runs: list[RoutingRun] = []
    t0 = time.perf_counter()
    try:
        for w in workers:
            w.start()
        for seed in range(args.seeds):
            for arrival in ARRIVALS:
                for policy in policies:
                    run = one_run(args, workers, policy, arrival, seed)
                    runs.append(run)
                    print(
                        f"seed {seed} {arrival:<5} {policy:<{width}} hit rate {run.hit_rate:.3f}  "
                        f"both {home}s {run.both}/4  per {home} {run.per_home}",
                        flush=True,
                    )
    finally:
        for w in workers:
            w.stop()
    return runs, time.perf_counter() - t0


def routing_table(
    runs: list[RoutingRun], policies: Collection[str], policy_header: str, home: str
) -> tuple[str, dict[tuple[str, str], list[RoutingRun]]]:
    """The markdown table, a row per (arrival, policy) over the seeds, and the runs by that key."""
    by_key = collections.defaultdict(list)
    for r in runs:
        by_key[(r.arrival, r.policy)].append(r)
    rows = [
        [
            arrival,
            policy,
            spread([r.hit_rate for r in rs], ".3f"),
            spread([r.ideal for r in rs], ".3f"),
            spread([r.prompt_tokens - r.hit_tokens for r in rs], ".0f"),
            spread([r.both for r in rs], ".1f"),
            ", ".join("/".join(map(str, r.per_home)) for r in rs),
            spread([r.wall_s for r in rs], ".2f"),
        ]
        for arrival in ARRIVALS
        for policy in policies
        for rs in [by_key[(arrival, policy)]]
    ]
    headers = [
        "arrival",
        policy_header,
        "prefix cache hit rate",
        "ideal",
        "prefill tokens computed",
        f"system prompts on both {home}s (of 4)",
        f"requests per {home}, per seed",
        "wall s",
    ]
    return markdown_table(headers, rows), by_key


def mean_by_key(by_key: dict[tuple[str, str], list[RoutingRun]], value: Callable[[RoutingRun], float]) -> dict:
    """value's mean over the seeds, per (arrival, policy)."""
    return {k: statistics.mean(value(r) for r in rs) for k, rs in by_key.items()}


def sampled_pairs(samples) -> dict[int, tuple[int, float]]:
    """A step's sampled columns (the scheduler's StepSamples) as (token id, logprob) per
    seq_id, the form the worker's SampledRows.of takes to build a reply."""
    return dict(zip(samples.seq_ids, zip(samples.token_ids, samples.logprobs)))
