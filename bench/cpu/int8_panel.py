"""The int8-activation GEMM over GGUF blocks (--quant-activations int8) at a decode's
and a batch's rows: the fp32 path (quant_linear), int8 over the file's layout (the
tiles below kPanelFrom rows, panels repacked per call from there) and int8 over
weights packed at load (pack_int8, what the worker multiplies), side by side.

Each case is SmolLM2-135M's seven projections per layer, layers repeated up to
--megabytes (several times the last-level cache), so the weights come from memory as
a step's do; a pass multiplies `rows` rows of x by every matrix in turn. Variants
alternate round by round; the figures are medians of the passes' wall times, with the
worker's threads (torch's, --threads) and the work pool on.

    python -m bench.cpu.int8_panel                         # Q8_0 and Q4_1, 1 to 256 rows
    python -m bench.cpu.int8_panel --out int8_panel        # and bench/results/int8_panel.{md,png}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.cpu.weight_stream import LAYER, random_gguf
from bench.cpu.worker_step import emit
from bench.harness.results import fmt, markdown_table, pyplot, save_plot, write_result
from kernels import cpu_ops
from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight
from kernels.quant_cpu_ops import Int8Panels, pack_int8
from svc_common.cpu_features import read_cpu_features

VARIANTS = ("fp32 x", "int8 x, file layout", "int8 x, packed")
Pass = Callable[[], None]


def weights(qtype: str, megabytes: int) -> list[QuantizedWeight]:
    """A model-sized set of the format's weights (SmolLM2's layers repeated)."""
    rng = np.random.default_rng(0)
    elems, size = BLOCK_FORMATS[qtype]
    layer_bytes = sum(o * i for o, i in LAYER) * size / elems
    layers = max(1, int(megabytes * (1 << 20) / layer_bytes))
    return [QuantizedWeight(qtype, o, i, random_gguf(qtype, o, i, rng)) for _ in range(layers) for o, i in LAYER]


def passes(ws: list[QuantizedWeight], packed: list[Int8Panels], rows: int) -> dict[str, Pass]:
    ops = torch.ops.pagedserve_cpu
    xs = [torch.randn(rows, w.in_features) for w in ws]

    def over(op: Callable[..., torch.Tensor], held: list[QuantizedWeight] | list[Int8Panels]) -> Pass:
        def one_pass() -> None:
            for x, w in zip(xs, held):
                op(x, w.data, w.qtype, w.out_features)

        return one_pass

    return {
        VARIANTS[0]: over(ops.quant_linear, ws),
        VARIANTS[1]: over(ops.quant_linear_int8, ws),
        VARIANTS[2]: over(ops.quant_linear_int8, packed),
    }


def medians(runs: dict[str, Pass], rounds: int) -> dict[str, float]:
    """Seconds per pass, the median of `rounds`, the variants alternating."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm: first touches, the kernels' buffers
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def plot(results: dict[str, dict[int, dict[str, float]]], macs: dict[str, int], name: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (qtype, by_rows) in zip(axes[0], results.items()):
        rows = sorted(by_rows)
        for variant in VARIANTS:
            ax.plot(rows, [macs[qtype] * r / by_rows[r][variant] / 1e9 for r in rows], marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows of x")
        ax.set_ylabel("G multiply-adds / s")
        ax.set_title(qtype)
        ax.legend(fontsize=8)
    save_plot(fig, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--formats", nargs="+", default=["Q8_0", "Q4_1"], choices=["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
    )
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 32, 256])
    parser.add_argument("--megabytes", type=int, default=128, help="weights per format (several times the L3)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="", help="also write bench/results/<out>.{md,png}")
    args = parser.parse_args(argv)
    if not cpu_ops.available():
        emit(section="skipped", reason="the C++ CPU kernels are not built here")
        return 1
    torch.set_num_threads(args.threads)
    cpu = read_cpu_features().describe()
    emit(section="machine", cpu=cpu, threads=args.threads, load=open("/proc/loadavg").read().split()[:3])
    results: dict[str, dict[int, dict[str, float]]] = {}
    macs: dict[str, int] = {}
    table = []
    for qtype in args.formats:
        ws = weights(qtype, args.megabytes)
        packed = [p for p in map(pack_int8, ws) if isinstance(p, Int8Panels)]
        if len(packed) < len(ws):
            emit(section="skipped", format=qtype, reason="this build packs no panels for it")
            continue
        macs[qtype] = sum(w.out_features * w.in_features for w in ws)
        results[qtype] = {}
        for rows in args.rows:
            s = medians(passes(ws, packed, rows), args.rounds)
            results[qtype][rows] = s
            emit(section="pass", format=qtype, rows=rows, ms={k: v * 1e3 for k, v in s.items()})
            table.append(
                [qtype, rows]
                + [f"{fmt(s[v] * 1e3, 2)} ({macs[qtype] * rows / s[v] / 1e9:.0f})" for v in VARIANTS]
                + [f"{s[VARIANTS[0]] / s[VARIANTS[2]]:.2f}x", f"{s[VARIANTS[1]] / s[VARIANTS[2]]:.2f}x"]
            )
    emit(section="end", load=open("/proc/loadavg").read().split()[:3])
    if args.out and table:
        headers = ["format", "rows"] + [f"{v}: ms (GMAC/s)" for v in VARIANTS]
        headers += ["packed vs fp32", "packed vs file layout"]
        body = (
            f"CPU: {cpu}; {args.threads} threads. A pass: SmolLM2-135M's projections over ~{args.megabytes} MB of "
            f"weights per format, from memory; median of {args.rounds} alternating rounds.\n\n"
            + markdown_table(headers, table)
            + f"\n\n![GMAC/s]({args.out}.png)"
        )
        write_result(args.out, "int8-activation GEMM: panels packed at load", body, module="cpu.int8_panel")
        plot(results, macs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
