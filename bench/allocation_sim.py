"""Seed 004's allocation experiment, made real with this project's allocators.

100 sequences of 100-3,000 tokens (a prompt of 20-80 % of that, the rest
generated one token per step) arrive in one burst and go through four KV
allocators over one pool of the same size (65,536 token positions):

* naive contiguous: every sequence reserves a max_seq_len (4,096) slot -- the
  scheduler's SlotManager (scheduler_svc/kv/slot_manager.py), which accounts a
  contiguous worker;
* dynamic: one variable-size contiguous extent per sequence, sized to its whole
  length (prompt + max_tokens), placed first-fit in a linear address space with
  coalescing free holes (a small allocator written here: nothing in the
  project allocates that way);
* paged: the scheduler's BlockPool + KVCacheManager, 16-token blocks allocated as
  tokens are written, prefix caching off;
* paged + prefix sharing: the same with prefix caching on. The sequences come
  in 4 families that share a system prompt (up to 1,024 tokens, half of each
  prompt at most); only this allocator can use that.

Every step: finished sequences free their memory, waiting ones are admitted
first-come-first-served while the allocator can take them (a prefill writes the
whole prompt), then every running sequence writes one token. A paged allocator
that cannot give a growing sequence a block preempts the newest running one
(freed, requeued at the front, recomputed on readmission), as the planner does;
the other two reserve everything up front and never fail to grow.

Measured over time: running sequences, utilization (positions holding live KV
/ positions allocated), internal fragmentation (allocated but empty: 1 -
utilization), external fragmentation (free memory in holes too small to use:
1 - largest free hole / free memory; only the dynamic allocator has holes), and
how often the head of the queue was refused although enough memory was free.
Plus the seed's static snapshot: all 100 sequences at full length at once.

    python -m bench.allocation_sim            # ~10 s, pure Python

Writes bench/results/allocation_sim.md and allocation_sim.png.
"""

from __future__ import annotations

import argparse
import bisect
import logging
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import structlog
from tqdm import tqdm

from bench.harness.machine import announce
from bench.harness.results import RESULTS, markdown_table, write_result
from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.kv.slot_manager import SlotManager
from scheduler_svc.request import Request, SamplingOptions

BLOCK = 16
MAX_SEQ_LEN = 4096
CAPACITY = 65_536  # token positions, the same for every allocator
# KV bytes of one token of the default model (SmolLM2-135M, bf16): 2 x 30 layers
# x 3 KV heads x 64 x 2 bytes; only to put the snapshot in MiB.
BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2


# ---- workload --------------------------------------------------------------------------
@dataclass
class Seq:
    index: int
    length: int  # tokens written when done (prompt + generated)
    prompt: list[int]
    request: Request = None  # type: ignore[assignment]
    computed: int = 0  # positions written
    admitted_step: int = -1
    finished_step: int = -1


def workload(n: int, seed: int, families: int = 4, system_len: int = 1024) -> list[tuple[int, list[int]]]:
    """(length, prompt tokens) per sequence; prompts start with their family's system prompt."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 50000) for _ in range(system_len)] for _ in range(families)]
    cases = []
    for i in range(n):
        length = rng.randint(100, 3000)
        prompt_len = max(1, round(length * rng.uniform(0.2, 0.8)))
        shared = min(system_len, prompt_len // 2)
        prompt = systems[i % families][:shared] + [rng.randrange(1000, 50000) for _ in range(prompt_len - shared)]
        cases.append((length, prompt))
    return cases


# ---- allocators --------------------------------------------------------------------------
class Allocator:
    name = ""
    shares = False

    def admit(self, seq: Seq) -> bool:
        """Memory for the sequence's known tokens (it writes them all this step)."""
        raise NotImplementedError

    def grow(self, seq: Seq) -> bool:
        """Memory for one more token."""
        raise NotImplementedError

    def free(self, seq: Seq) -> None:
        raise NotImplementedError

    def allocated(self) -> int:
        """Token positions reserved now."""
        raise NotImplementedError

    def stored(self, running: list[Seq]) -> int:
        """Positions holding a live token, each physical position once."""
        return sum(s.computed for s in running)

    def largest_hole(self) -> int:
        """Largest allocation of contiguous positions possible now."""
        return CAPACITY - self.allocated()

    def fits_if_unfragmented(self, seq: Seq) -> bool:
        return False


class Naive(Allocator):
    name = "naive contiguous (4,096-token slot each)"

    def __init__(self):
        self.kv = SlotManager(CAPACITY // MAX_SEQ_LEN, MAX_SEQ_LEN)

    def admit(self, seq):
        return self.kv.allocate_slots(seq.request, seq.request.num_tokens) is not None

    def grow(self, seq):
        return self.kv.allocate_slots(seq.request, 1) is not None

    def free(self, seq):
        self.kv.free(seq.request)

    def allocated(self):
        return self.kv.pool.num_used_blocks * MAX_SEQ_LEN


class Dynamic(Allocator):
    """Variable-size contiguous extents, first fit, holes coalesced on free."""

    name = "dynamic (variable-size, first fit)"

    def __init__(self):
        self.holes: list[tuple[int, int]] = [(0, CAPACITY)]  # (start, size), sorted by start
        self.extents: dict[int, tuple[int, int]] = {}

    def admit(self, seq):
        need = seq.length  # the whole sequence: its prompt + max_tokens are known at admission
        for i, (start, size) in enumerate(self.holes):
            if size >= need:
                self.extents[seq.index] = (start, need)
                if size == need:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + need, size - need)
                return True
        return False

    def grow(self, seq):
        return True  # reserved up front

    def free(self, seq):
        start, size = self.extents.pop(seq.index)
        i = bisect.bisect(self.holes, (start, size))
        self.holes.insert(i, (start, size))
        # Coalesce with the neighbours.
        if i + 1 < len(self.holes) and start + size == self.holes[i + 1][0]:
            self.holes[i] = (start, size + self.holes[i + 1][1])
            del self.holes[i + 1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == self.holes[i][0]:
            self.holes[i - 1] = (self.holes[i - 1][0], self.holes[i - 1][1] + self.holes[i][1])
            del self.holes[i]

    def allocated(self):
        return sum(size for _, size in self.extents.values())

    def largest_hole(self):
        return max((size for _, size in self.holes), default=0)

    def fits_if_unfragmented(self, seq):
        return CAPACITY - self.allocated() >= seq.length


class Paged(Allocator):
    name = "paged (BlockPool + KVCacheManager)"

    def __init__(self, sharing: bool = False):
        self.shares = sharing
        if sharing:
            self.name = "paged + prefix sharing"
        self.kv = KVCacheManager(BlockPool(CAPACITY // BLOCK, BLOCK, enable_prefix_caching=sharing), BLOCK)

    def admit(self, seq):
        req = seq.request
        hits, hit_tokens = self.kv.get_computed_blocks(req)
        if self.kv.allocate_slots(req, req.num_tokens - hit_tokens, hits) is None:
            return False
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_full_blocks(req, req.num_computed_tokens)
        return True

    def grow(self, seq):
        req = seq.request
        if self.kv.allocate_slots(req, 1) is None:
            return False
        req.num_computed_tokens += 1
        self.kv.cache_full_blocks(req, req.num_computed_tokens)
        return True

    def free(self, seq):
        self.kv.free(seq.request)

    def allocated(self):
        return self.kv.pool.num_used_blocks * BLOCK

    def stored(self, running):
        if not self.shares:
            return super().stored(running)
        usage = self.kv.usage()  # shared blocks counted once, at their fullest holder
        return usage.allocated_slots - usage.unused_slots

    def largest_hole(self):
        return self.kv.pool.num_free_blocks * BLOCK  # any free block serves any sequence

    def fits_if_unfragmented(self, seq):
        return False


# ---- the simulation ------------------------------------------------------------------------
@dataclass
class Trace:
    name: str
    steps: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    utilization: list[float] = field(default_factory=list)  # stored / allocated
    occupancy: list[float] = field(default_factory=list)  # allocated / capacity
    live: list[float] = field(default_factory=list)  # stored / capacity
    external: list[float] = field(default_factory=list)  # 1 - largest hole / free
    blocked_by_fragmentation: int = 0  # steps whose head of queue fitted in total free memory, not in a hole
    preemptions: int = 0
    total_steps: int = 0
    alloc_calls: int = 0
    alloc_seconds: float = 0.0
    peak_running: int = 0
    latencies: list[int] = field(default_factory=list)  # steps from the burst to a sequence's last token


def simulate(alloc: Allocator, cases, seed: int, sample_every: int = 5, max_steps: int = 100_000) -> Trace:
    rng = random.Random(seed)
    seqs = [Seq(i, length, prompt) for i, (length, prompt) in enumerate(cases)]
    for s in seqs:
        s.request = Request(f"s{s.index}", s.index + 1, list(s.prompt), SamplingOptions(max_tokens=s.length))
    waiting: deque[Seq] = deque(seqs)
    running: list[Seq] = []
    trace = Trace(alloc.name)
    clock = time.perf_counter

    def timed(fn, seq):
        t0 = clock()
        ok = fn(seq)
        trace.alloc_seconds += clock() - t0
        trace.alloc_calls += 1
        return ok

    def preempt(victim: Seq):
        alloc.free(victim)
        running.remove(victim)
        victim.computed = 0
        victim.request.num_computed_tokens = 0
        waiting.appendleft(victim)
        trace.preemptions += 1

    step = 0
    while waiting or running:
        if step >= max_steps:
            raise RuntimeError(f"{alloc.name}: not done after {max_steps} steps")
        # Admit first-come-first-served until one does not fit.
        blocked, admitted_now = False, set()
        while waiting:
            seq = waiting[0]
            if not timed(alloc.admit, seq):
                blocked = alloc.fits_if_unfragmented(seq)
                break
            waiting.popleft()
            seq.computed = seq.request.num_tokens
            seq.request.num_computed_tokens = seq.computed
            if seq.admitted_step < 0:
                seq.admitted_step = step
            admitted_now.add(seq.index)
            running.append(seq)
        trace.blocked_by_fragmentation += blocked
        # Every running sequence admitted before this step writes one token (a
        # sequence admitted now wrote its prompt this step).
        for seq in list(running):
            if seq.index in admitted_now or seq not in running or seq.computed >= seq.length:
                continue
            if seq.request.num_tokens == seq.computed:  # the token this step writes
                seq.request.append_output(rng.randrange(1000, 50000), 0.0)
            while not timed(alloc.grow, seq):
                victim = running[-1]  # the newest: as the planner preempts
                preempt(victim)
                if victim is seq:
                    break
            else:
                seq.computed += 1
        if step % sample_every == 0:
            allocated, stored = alloc.allocated(), alloc.stored(running)
            free = CAPACITY - allocated
            trace.steps.append(step)
            trace.running.append(len(running))
            trace.waiting.append(len(waiting))
            trace.utilization.append(stored / allocated if allocated else 1.0)
            trace.occupancy.append(allocated / CAPACITY)
            trace.live.append(stored / CAPACITY)
            trace.external.append(1 - alloc.largest_hole() / free if free else 0.0)
        trace.peak_running = max(trace.peak_running, len(running))
        # Retire: the sequences that wrote their last token.
        for seq in [s for s in running if s.computed >= s.length]:
            alloc.free(seq)
            running.remove(seq)
            seq.finished_step = step
            trace.latencies.append(step + 1)
        step += 1
    trace.total_steps = step
    return trace


def snapshot(cases) -> list[list]:
    """The seed's static experiment: all 100 sequences at full length at once, in a
    pool large enough for each allocator. Memory taken, and what share holds tokens."""
    total_tokens = sum(length for length, _ in cases)
    rows = []
    naive = len(cases) * MAX_SEQ_LEN
    dynamic = total_tokens  # extents sized to each whole sequence, packed in a fresh space
    paged = sum(-(-length // BLOCK) for length, _ in cases) * BLOCK
    # Paged + sharing: the real KVCacheManager, unbounded pool, every sequence at full length.
    kv = KVCacheManager(BlockPool(naive // BLOCK, BLOCK, enable_prefix_caching=True), BLOCK)
    rng = random.Random(1)
    unique_tokens = 0
    for i, (length, prompt) in enumerate(cases):
        req = Request(f"x{i}", i + 1, list(prompt), SamplingOptions(max_tokens=length))
        hits, hit_tokens = kv.get_computed_blocks(req)
        kv.allocate_slots(req, req.num_tokens - hit_tokens, hits)
        req.num_computed_tokens = req.num_tokens
        kv.cache_full_blocks(req, req.num_computed_tokens)
        unique_tokens += req.num_tokens - hit_tokens
        while req.num_computed_tokens < length:
            req.append_output(rng.randrange(1000, 50000), 0.0)
            kv.allocate_slots(req, 1)
            req.num_computed_tokens += 1
        unique_tokens += length - len(prompt)
    shared = kv.pool.num_used_blocks * BLOCK
    usage = kv.usage()
    for name, used, holds in (
        ("naive contiguous", naive, total_tokens),
        ("dynamic (first fit)", dynamic, total_tokens),
        ("paged", paged, total_tokens),
        ("paged + prefix sharing", shared, usage.allocated_slots - usage.unused_slots),
    ):
        rows.append(
            [
                name,
                f"{used:,}",
                f"{used * BYTES_PER_TOKEN / 2**20:,.0f}",
                f"{holds / used:.1%}",
                f"{1 - holds / used:.1%}",
                f"{used / naive:.1%}",
            ]
        )
    return rows


def plot(traces: list[Trace], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    panels = [
        ("running", "sequences running"),
        ("utilization", "utilization: live KV / allocated"),
        ("live", "live KV / pool capacity"),
        ("external", "external fragmentation: 1 - largest hole / free"),
    ]
    for ax, (attr, title) in zip(axes.flat, panels):
        for trace in traces:
            ax.plot(trace.steps, getattr(trace, attr), label=trace.name, linewidth=1.2)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step (one token per running sequence)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"100 sequences of 100-3,000 tokens, one burst, {CAPACITY:,}-position pool")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    announce("allocation_sim")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # The block pool logs every eviction at info level: thousands of lines here.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    t0 = time.perf_counter()
    cases = workload(args.sequences, args.seed)
    allocators = [Naive, Dynamic, Paged, lambda: Paged(sharing=True)]
    traces = [simulate(make(), cases, args.seed) for make in tqdm(allocators, desc="allocators", leave=False)]

    def mean(values):
        return statistics.fmean(values) if values else 0.0

    rows = []
    for t in traces:
        # Means while requests were waiting: the pool is what holds them back.
        busy = [i for i, w in enumerate(t.waiting) if w]
        util = mean([t.utilization[i] for i in busy])
        rows.append(
            [
                t.name,
                t.total_steps,
                t.peak_running,
                f"{mean([t.running[i] for i in busy]):.1f}",
                f"{util:.1%}",
                f"{1 - util:.1%}",
                f"{mean([t.external[i] for i in busy]):.1%}",
                t.blocked_by_fragmentation,
                f"{mean([t.occupancy[i] for i in busy]):.1%}",
                f"{mean([t.live[i] for i in busy]):.1%}",
                t.preemptions,
                f"{statistics.median(t.latencies):.0f}",
                f"{t.alloc_seconds / t.alloc_calls * 1e6:.1f}",
            ]
        )
    table = markdown_table(
        [
            "allocator",
            "steps to finish all",
            "peak running",
            "mean running",
            "utilization (live / allocated)",
            "internal fragmentation",
            "external fragmentation",
            "steps blocked by fragmentation",
            "pool allocated",
            "pool holding live KV",
            "preemptions",
            "median finish step",
            "us per alloc call",
        ],
        rows,
    )
    snap = snapshot(cases)
    snap_table = markdown_table(
        [
            "allocator",
            "token positions",
            "MiB (SmolLM2-135M, bf16)",
            "utilization",
            "internal fragmentation",
            "memory vs naive",
        ],
        snap,
    )
    RESULTS.mkdir(exist_ok=True)
    png = RESULTS / "allocation_sim.png"
    plot(traces, png)
    elapsed = time.perf_counter() - t0
    print(table, "\n\n" + snap_table)

    lengths = [length for length, _ in cases]
    notes = f"""## Over time: one burst of {args.sequences} sequences through a {CAPACITY:,}-position pool

{table}

Means are over the sampled steps (every 5th) while requests were waiting, i.e. while
the pool was what held them back (the drain at the end, with the queue empty, is in
the plot but not in the means). Utilization =
positions holding a live token / positions allocated (shared positions once);
internal fragmentation = 1 - utilization; external fragmentation = 1 - (largest free
hole / free positions), i.e. free memory no single new sequence can use; "steps
blocked by fragmentation" counts steps where the head of the queue was refused
although the free memory in total would have held it. "us per alloc call" times
admit/grow calls (Python; paged with sharing includes the block hashing).

## Snapshot: all {args.sequences} sequences at full length at once (the seed's static experiment)

{snap_table}

Workload (seed {args.seed}): lengths uniform in 100-3,000 (mean {statistics.fmean(lengths):.0f}, total
{sum(lengths):,} tokens), prompts 20-80 % of the length, the rest generated; 4 families
whose prompts start with the same system prompt (min(1,024, prompt/2) tokens). The
seed's expected numbers (naive 15 % / dynamic 40 % / paged 88 % / advanced 92 %
utilization) are illustrations; these are measured with the scheduler's own
SlotManager (naive) and BlockPool + KVCacheManager (paged), and a first-fit extent
allocator for the dynamic scheme. Dynamic reserves each sequence's whole length at
admission (its prompt and max_tokens are known), so its internal fragmentation is
the not-yet-generated tail; naive's is the rest of the 4,096 slot; paged's is the
unfilled part of each sequence's last block.

Script time: {elapsed:.1f} s. Plot: `allocation_sim.png`.
"""
    path = write_result("allocation_sim", "Allocation simulation: naive, dynamic, paged, paged + sharing", "", notes)
    print(f"wrote {path} and {png} in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
