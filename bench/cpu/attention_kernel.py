"""The CPU paged attention op alone, this checkout's kernel against another tree's
(`--base`, e.g. `git archive COMMIT | tar -x -C DIR`), side by side in one process:
each tree's kernels/csrc/paged_attention_cpu.cpp (with its headers and work pool) is built on its
own under an op namespace of its own, so the two run interleaved, round by round, on
the same tensors. One torch thread, CPU time of this thread per step of 30 layers,
each layer with its own cache (a step reads every layer's K/V from memory once, as a
worker step does: the caches of all layers do not fit the CPU's caches).

Shapes of the default model (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64,
16-token blocks) at bench/cpu/worker_step.py's decode steps, and a split: the same
32 x 320 step with every sequence's table pointing at one sequence's blocks (K/V
then stay in the CPU's L2: what the arithmetic costs without the memory), at GQA
groups 1 and 3 (what a block costs once per KV head, and per query head).

    python -m bench.cpu.attention_kernel --base /tmp/base --out cpu_attention_kernel
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness.results import fmt, markdown_table, write_result
from kernels import reference
from kernels.cpu_build import CFLAGS, LDFLAGS

REPO = Path(__file__).resolve().parents[2]


def build(name: str, tree: Path) -> str:
    """The tree's attention kernel as the op torch.ops.<name>.paged_attention."""
    from torch.utils.cpp_extension import load

    cache = Path(os.environ.get("PAGEDSERVE_KERNEL_CACHE", Path.home() / ".cache" / "pagedserve" / "kernels"))
    csrc = tree / "kernels" / "csrc"
    files = {path.name: path.read_text() for path in sorted(csrc.glob("*.h"))}
    # The op and the work pool it shares its items through, their ops under `name`.
    for unit in ("paged_attention_cpu.cpp", "work_pool.cpp"):
        source = (csrc / unit).read_text() if (csrc / unit).exists() else ""
        for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
            source = source.replace(f"{macro}(pagedserve_cpu", f"{macro}({name}")
        files[unit] = source
    # A folder per source and flags: the cache is the machine's, and another checkout's
    # run (other sources under the same name) must not write into this one's build.
    digest = hashlib.sha256(repr((sorted(files.items()), CFLAGS)).encode()).hexdigest()[:16]
    folder = cache / "bench_attention" / f"{name}_{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, text in files.items():
        path = folder / file_name
        if not path.exists() or path.read_text() != text:  # unchanged: ninja keeps the build
            path.write_text(text)
    units = [str(folder / unit) for unit in ("paged_attention_cpu.cpp", "work_pool.cpp") if files[unit]]
    load(name, units, extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
         build_directory=str(folder), is_python_module=False)  # fmt: skip
    return name


@dataclass(frozen=True)
class Case:
    name: str
    seqs: int
    context: int
    dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype = torch.float32
    rows: int = 1  # query rows per sequence (> 1: a verify chunk)
    heads: int = 9
    layers: int = 30
    shared_blocks: bool = False  # every table points at sequence 0's blocks: K/V stay in L2


CASES = [
    Case("decode 1 x 256", 1, 256),
    Case("decode 32 x 320", 32, 320),
    Case("decode 1 x 256", 1, 256, torch.bfloat16, torch.bfloat16),
    Case("decode 32 x 320", 32, 320, torch.bfloat16, torch.bfloat16),
    Case("decode 32 x 320", 32, 320, torch.float32, torch.bfloat16),
    Case("decode 1 x 256", 1, 256, torch.float32, torch.float16),  # int8 activations + fp16 KV
    Case("decode 32 x 320", 32, 320, torch.float32, torch.float16),
    Case("verify 2 x 256 + 4", 2, 256, rows=5),
    Case("decode 32 x 320, K/V in L2, group 3", 32, 320, shared_blocks=True),
    Case("decode 32 x 320, K/V in L2, group 1", 32, 320, heads=3, shared_blocks=True),
]


def tensors(
    case: Case,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor | None, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    kv_heads, head_dim, block = 3, 64, 16
    per_seq = -(-case.context // block)
    total = per_seq * (1 if case.shared_blocks else case.seqs)
    caches = []
    for _ in range(case.layers):
        shape = (total, kv_heads, block, head_dim)
        caches.append(
            (torch.randn(shape, generator=g).to(case.cache_dtype), torch.randn(shape, generator=g).to(case.cache_dtype))
        )
    tables = torch.randperm(total, generator=g).to(torch.int32)
    tables = tables.view(1, per_seq).expand(case.seqs, -1) if case.shared_blocks else tables.view(case.seqs, per_seq)
    query = torch.randn(case.seqs * case.rows, case.heads, head_dim, generator=g).to(case.dtype)
    cu = None if case.rows == 1 else torch.arange(0, case.seqs * case.rows + 1, case.rows, dtype=torch.int32)
    return query, caches, tables.contiguous(), cu, torch.full((case.seqs,), case.context, dtype=torch.int32)


HEADERS = ["step (30 layers)", "query/cache dtype", "before ms", "after ms", "after / before",
           "max abs diff before", "after"]  # fmt: skip


def run_case(case: Case, ops: dict[str, str], rounds: int) -> list[str]:
    query, caches, tables, cu, ctx = tensors(case)
    scale = query.shape[-1] ** -0.5

    def call(op: str, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        fn = getattr(torch.ops, op).paged_attention
        out: torch.Tensor = fn(query, k, v, tables, cu, ctx, scale, 0, 0.0, None, None, None, None)
        return out

    k, v = caches[0]
    if cu is None:
        want = reference.paged_decode_attention(query, k, v, tables, ctx, scale)
    else:
        want = reference.paged_prefill_attention(query, k, v, tables, cu, ctx, scale)
    diff = {t: (call(op, k, v).float() - want.float()).abs().max().item() for t, op in ops.items()}
    ms: dict[str, list[float]] = {t: [] for t in ops}
    for _ in range(rounds):
        for t, op in ops.items():
            start = time.thread_time()
            for k, v in caches:
                call(op, k, v)
            ms[t].append((time.thread_time() - start) * 1e3)
    before, after = (statistics.median(ms[t]) for t in ("before", "after"))
    dtypes = f"{str(case.dtype)[6:]}/{str(case.cache_dtype)[6:]}"
    return [
        case.name,
        dtypes,
        fmt(before, 2),
        fmt(after, 2),
        fmt(after / before, 2),
        f"{diff['before']:.1e}",
        f"{diff['after']:.1e}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, type=Path, help="the other tree (its kernels/csrc)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ops = {"before": build("attention_before", args.base.resolve()), "after": build("attention_after", REPO)}
    rows = []
    for case in CASES:
        rows.append(run_case(case, ops, args.rounds))
        print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(HEADERS, rows)
    print(table)
    if args.out:
        write_result(
            args.out,
            "The CPU paged attention op, before and after",
            f"ms per step of 30 layers' attention: median of {args.rounds} interleaved rounds, CPU time of this "
            f"thread, 1 torch thread; max abs diff: against the torch reference (the oracle), layer 0.\n\n{table}",
            "Load after: {:.2f} {:.2f} {:.2f}.".format(*os.getloadavg()),
            module="cpu.attention_kernel",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
