"""What verifying drafts costs (issue 30, phase A): the policy's input.

    python -m bench.spec_cost [--batches 1 4 8 16 32 64] [--max-k 5] [--context 512] [--repeats 3]

In process (worker_svc.worker.Worker on CPU, one torch thread): a step of B rows,
each running 1 token (a decode) or K + 1 tokens (its last token and K drafts, the
verification chunk), at a context of --context tokens already in the cache. Timed
per step: the forward (all layers, attention through the worker's cache ops),
then the LM head over every verified position and the greedy pick (what greedy
verification needs), then the seeded Gumbel race over those rows (what sampled
verification adds). For each model (the default SmolLM2-135M-Instruct in bf16 and
fp32, the tiny test llama) and attention op set (the torch reference the worker
uses today; with --cpu-ops also the C++ kernel of kernels/cpu_ops.py).

Derived: r(B, K) = t(B rows x (K+1)) / t(B rows x 1), the step's cost ratio;
drafting K tokens on every row pays when a step emits more than r tokens per row,
i.e. when the mean accepted length exceeds r - 1 (break-even); with a per-token
acceptance rate p (accepted lengths geometric, capped at K) a step emits
(1 - p^(K+1)) / (1 - p) tokens per row, which gives the break-even p and the best K.

Also the scheduler's proposer (scheduler_svc/speculative/ngram.py) at 256 rows of
4k-token contexts: the per-step CPU time, the one-time index build, the memory.

Figures are CPU time of the measuring thread (time.thread_time), one torch thread:
the machine is shared (2 cores, other sessions running), and with two threads an
OpenMP team spends its time waiting for a descheduled peer. Each (B, K) cell is the
median of --repeats runs, the cells of a B interleaved within each repeat.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from bench.harness.machine import announce, load_average
from bench.harness.results import markdown_table, pyplot, save_plot, write_result
from bench.harness.services import DEFAULT_MODEL, require_model, tiny_model
from kernels import cpu_ops, reference
from scheduler_svc.speculative.ngram import NgramConfig, NgramProposer
from worker_svc.attention.kv_cache import PagedKVCache
from worker_svc.config import WorkerConfig
from worker_svc.runner.batch import plan_batch
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.upload import upload_batch
from worker_svc.sampling.sampler import Sampler, row_keys
from worker_svc.step.builder import StepBuilder
from worker_svc.step.input import StepInput
from worker_svc.worker import Worker

BLOCK = 16
ACCEPTANCE_RATES = (0.3, 0.5, 0.7, 0.9)


@dataclass
class Cell:
    forward: list[float] = field(default_factory=list)  # ms CPU
    head: list[float] = field(default_factory=list)  # LM head over every verified position + greedy pick
    race: list[float] = field(default_factory=list)  # the seeded Gumbel race over those rows

    def ms(self, sampled: bool = False) -> float:
        total = statistics.median(self.forward) + statistics.median(self.head)
        return total + (statistics.median(self.race) if sampled else 0.0)


@dataclass
class Variant:
    name: str  # model, dtype, attention ops
    cells: dict[tuple[int, int], Cell] = field(default_factory=dict)  # (B, K) -> times


def verification_step(rows: int, k: int, context: int) -> StepInput:
    """B rows, each its last token plus k drafts at positions context..context+k."""
    builder = StepBuilder(block_size=BLOCK)
    width = -(-(context + k + 1) // BLOCK)
    for row in range(rows):
        table = list(range(row * width, (row + 1) * width))
        builder.add(row, [100 + j for j in range(k + 1)], context, table, sample=True)
    return builder.build(0)


def timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    start = time.thread_time()
    out = fn()
    return out, (time.thread_time() - start) * 1e3


@torch.inference_mode()
def measure(runner: ModelRunner, step: StepInput, cell: Cell) -> None:
    batch = upload_batch(plan_batch(step), runner.uploader)
    model = runner.model
    hidden, forward_ms = timed(lambda: runner.forward(batch))
    _, head_ms = timed(lambda: model.logits(hidden).argmax(dim=-1))
    logits = model.logits(hidden)
    n = logits.shape[0]
    keys = torch.from_numpy(row_keys(np.full(n, 7, np.uint64), np.arange(n, dtype=np.uint64)).astype(np.int64))
    temperature = torch.full((n,), 0.8)
    cut = torch.full((n,), -torch.inf)
    _, race_ms = timed(lambda: reference.gumbel_argmax(logits, temperature, keys, cut))
    cell.forward.append(forward_ms)
    cell.head.append(head_ms)
    cell.race.append(race_ms)


def run_variant(name: str, model_dir: str, dtype: str, ops: object | None, args: argparse.Namespace) -> Variant:
    rows_max, k_max = max(args.batches), args.max_k
    num_blocks = rows_max * -(-(args.context + k_max + 1) // BLOCK)
    own_blocks = num_blocks if ops is None else 1
    worker = Worker(WorkerConfig(model=model_dir, dtype=dtype, num_blocks=own_blocks, num_threads=1))
    runner = worker.runner
    if ops is not None:  # the same model over a cache whose attention ops are `ops`
        spec, dtype_kv = worker.model.spec, worker.cache.k.dtype
        shape = (spec.num_layers, num_blocks, spec.num_kv_heads, BLOCK, spec.head_dim)
        runner = ModelRunner(worker.model, PagedKVCache(*shape, dtype_kv, worker.device, ops), Sampler(0))
    variant = Variant(name)
    steps = {(b, k): verification_step(b, k, args.context) for b in args.batches for k in range(k_max + 1)}
    for step in steps.values():  # warm-up: first calls of a shape allocate
        measure(runner, step, Cell())
    for repeat in range(args.repeats):
        for b in args.batches:
            order = list(range(k_max + 1))
            if repeat % 2:
                order.reverse()
            for k in order:
                measure(runner, steps[b, k], variant.cells.setdefault((b, k), Cell()))
        print(f"  {name}: repeat {repeat + 1}/{args.repeats} done, load {load_average():.1f}", flush=True)
    del runner, worker
    gc.collect()
    return variant


def emitted_per_step(p: float, k: int) -> float:
    """Tokens a row emits per verification step: its accepted drafts plus its own
    token, when each draft is accepted with probability p after the ones before it."""
    return float(k + 1) if p >= 1.0 else (1 - p ** (k + 1)) / (1 - p)


def break_even_p(ratio: float, k: int) -> float:
    """The acceptance rate at which k drafts per row emit as many tokens per unit of
    time as plain decoding: emitted_per_step(p, k) = ratio (bisection)."""
    if ratio <= 1.0:
        return 0.0
    if ratio >= k + 1:
        return float("nan")  # never pays, even if every draft is accepted
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if emitted_per_step(mid, k) < ratio else (lo, mid)
    return (lo + hi) / 2


def cost_table(variant: Variant, batches: list[int], k_max: int, sampled: bool) -> tuple[str, list[list[str]]]:
    rows = []
    for b in batches:
        base = variant.cells[b, 0].ms(sampled)
        ratios = [variant.cells[b, k].ms(sampled) / base for k in range(1, k_max + 1)]
        best = []
        for p in ACCEPTANCE_RATES:
            gains = [emitted_per_step(p, k) / r for k, r in zip(range(1, k_max + 1), ratios)]
            k_best = int(np.argmax(gains)) + 1
            best.append(f"K={k_best} {gains[k_best - 1]:.2f}x" if gains[k_best - 1] > 1 else "off")
        rows.append(
            [
                str(b),
                f"{base:.1f}",
                f"{base / b:.2f}",
                " / ".join(f"{r:.2f}" for r in ratios),
                " / ".join(f"{r - 1:.2f}" for r in ratios),
                " / ".join(_p(break_even_p(r, k)) for k, r in zip(range(1, k_max + 1), ratios)),
                *best,
            ]
        )
    return variant.name + (" (sampled: + the Gumbel race)" if sampled else " (greedy)"), rows


def _p(p: float) -> str:
    return "never" if p != p else f"{p:.2f}"


def split_table(variant: Variant, batches: list[int], k_max: int) -> list[list[str]]:
    """Where a step's time goes: forward, LM head + argmax, race, at K = 0 and K = k_max."""
    rows = []
    for b in batches:
        for k in (0, k_max):
            c = variant.cells[b, k]
            rows.append(
                [
                    variant.name,
                    str(b),
                    str(k),
                    str(b * (k + 1)),
                    f"{statistics.median(c.forward):.1f}",
                    f"{statistics.median(c.head):.1f}",
                    f"{statistics.median(c.race):.1f}",
                    f"{min(c.forward):.1f}-{max(c.forward):.1f}",
                ]
            )
    return rows


def proposer_cost(rows: int, context: int, steps: int) -> list[list[str]]:
    """Per-step CPU of drafting for `rows` sequences of `context` tokens, each
    growing by one token a step, and of the first proposal (the index's bulk build)."""
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 49152, size=context).tolist() for _ in range(rows)]
    for seq in tokens:  # copies inside the text, so that lookups find matches
        for _ in range(context // 200):
            a, b = rng.integers(0, context - 32, size=2)
            seq[b : b + 32] = seq[a : a + 32]
    out = []
    for config in (NgramConfig(5, 2, 4), NgramConfig(5, 1, 3), NgramConfig(5, 3, 5)):
        seqs = [list(t) for t in tokens]
        tracemalloc.start()  # the indices' memory, in a pass of its own (tracing slows allocation)
        traced = NgramProposer(config)
        for i, seq in enumerate(seqs):
            traced.propose(str(i), seq)
        memory = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del traced
        proposer = NgramProposer(config)
        start = time.thread_time()
        for i, seq in enumerate(seqs):
            proposer.propose(str(i), seq)
        build_ms = (time.thread_time() - start) * 1e3
        per_step = []
        growth = rng.integers(0, 49152, size=(steps, rows)).tolist()
        for step in range(steps):
            start = time.thread_time()
            for i, seq in enumerate(seqs):
                proposer.propose(str(i), seq)
            per_step.append((time.thread_time() - start) * 1e3)
            for i, seq in enumerate(seqs):
                seq.append(growth[step][i])
        out.append(
            [
                f"K={config.num_speculative_tokens}, n in [{config.ngram_min}, {config.ngram_max}]",
                str(rows),
                str(context),
                f"{statistics.median(per_step):.2f} ({min(per_step):.2f}-{max(per_step):.2f})",
                f"{statistics.median(per_step) / rows * 1e3:.1f}",
                f"{build_ms / rows:.2f}",
                f"{memory / rows / 2**20:.2f}",
                f"{memory / rows / context:.0f}",
            ]
        )
    return out


def plot(variants: list[Variant], batches: list[int], k_max: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 4), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        for b in batches:
            base = variant.cells[b, 0].ms()
            ax.plot(
                range(k_max + 1),
                [variant.cells[b, k].ms() / base for k in range(k_max + 1)],
                marker="o",
                label=f"B={b}",
            )
        ax.plot(range(k_max + 1), [k + 1 for k in range(k_max + 1)], "k:", label="all accepted")
        ax.set_title(variant.name, fontsize=9)
        ax.set_xlabel("drafts per row K")
        ax.set_ylabel("step cost / decode step")
        ax.legend(fontsize=7)
    save_plot(fig, "spec_cost")


def main() -> None:
    announce("spec_cost")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--max-k", type=int, default=5)
    parser.add_argument("--context", type=int, default=512, help="tokens in each row's cache before the step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["smollm2-bf16", "smollm2-fp32", "tiny-llama-fp32"])
    parser.add_argument("--cpu-ops", action="store_true", help="also the C++ attention kernel (kernels/cpu_ops.py)")
    parser.add_argument("--proposer-rows", type=int, default=256)
    parser.add_argument("--proposer-context", type=int, default=4096)
    args = parser.parse_args()
    load_before = load_average()
    default = str(require_model(DEFAULT_MODEL))
    models = {
        "smollm2-bf16": (default, "bfloat16"),
        "smollm2-fp32": (default, "float32"),
        "tiny-llama-fp32": (str(tiny_model("llama")), "float32"),
    }
    op_sets: list[tuple[str, object | None]] = [("torch ref attention", None)]
    if args.cpu_ops:
        if not cpu_ops.available():
            raise SystemExit("--cpu-ops: the C++ kernel did not build here")
        op_sets.append(("C++ attention", cpu_ops))
    variants = []
    for name in args.variants:
        model_dir, dtype = models[name]
        for ops_name, ops in op_sets:
            print(f"{name}, {ops_name} ...", flush=True)
            variants.append(run_variant(f"{name}, {ops_name}", model_dir, dtype, ops, args))
    headers = [
        "B",
        "decode step ms",
        "ms / row",
        "r(K) = cost ratio, K=1..",
        "break-even accepted length",
        "break-even p",
        *(f"best at p={p}" for p in ACCEPTANCE_RATES),
    ]
    sections = []
    for variant in variants:
        for sampled in (False, True):
            title, rows = cost_table(variant, args.batches, args.max_k, sampled)
            sections.append(f"### {title}\n\n" + markdown_table(headers, rows))
    split = markdown_table(
        ["variant", "B", "K", "tokens", "forward ms", "head+argmax ms", "race ms", "forward range"],
        [r for v in variants for r in split_table(v, args.batches, args.max_k)],
    )
    proposer = markdown_table(
        [
            "proposer",
            "rows",
            "context",
            "ms / step (range)",
            "us / row",
            "first proposal ms / row",
            "MiB / row",
            "B / token",
        ],
        proposer_cost(args.proposer_rows, args.proposer_context, 40),
    )
    body = (
        f"Context {args.context} tokens per row, {args.repeats} repeats, CPU ms of one torch thread.\n\n"
        + "\n\n".join(sections)
        + "\n\n### Where the step's time goes\n\n"
        + split
        + "\n\n### The proposer (scheduler side, per step)\n\n"
        + proposer
    )
    notes = f"Load average (1 min) {load_before:.1f} before, {load_average():.1f} after (2 cores, shared)."
    print(body + "\n\n" + notes)
    plot(variants, args.batches, args.max_k)
    print(f"wrote {write_result('spec_cost', 'Speculative decoding: what verification costs', body, notes)}")


if __name__ == "__main__":
    main()
