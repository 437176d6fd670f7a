"""`make gpu-check`: one command that proves the CUDA path on a machine with a GPU
(issue 27), in at most ~15 minutes on an H100, writing bench/results/gpu_check.md
named with the GPU.

    python -m bench.gpu_check [--only STEP ...] [--timeout-s SECONDS]

Where one command may run at most 10 minutes (this workplace's lent GPUs), run
the steps in three calls, `--only tests sanitizer`, `--only resources smoke`,
`--only bench wquant gguf`: each merges its results into bench/results/gpu_check.json (kept
per GPU) and renders gpu_check.md from everything recorded for that GPU.

0. environment: torch, CUDA, Triton and the GPU, printed; no CUDA (or
   TRITON_INTERPRET set) is a loud failure with a non-zero exit, never a quiet
   run under the interpreter. Packages the GPU machine lacks come from
   `make gpu-wheels` (run beforehand where pip works; see install_carried).
1. tests: the kernel, KV-quantization, CUDA-graph, sampler (CUDA vs CPU, the
   fused race), prefill-routing, device and memory tests, compiled on CUDA; the
   MoE grouped GEMM and the soft-capped attention against their references, and
   tiny Qwen2 / Gemma 2 / Qwen2-MoE workers on the GPU token-exact with
   transformers.
2. sanitizer: `compute-sanitizer --tool memcheck` over a small script (a KV
   write with slots -1, a split decode forced to many partitions, a quantized
   write and decode, a mixed prefill, the fused sampler), if the tool is there.
3. resources: shared memory, registers and spills of every attention tile
   choice at head_dim 64/128/256, for this GPU's architecture, sm_80 and sm_90
   (bench/kernel_resources.py).
4. smoke: a worker on a random 1B Llama (bf16): graphs captured, the KV pool
   sized from device memory, a 256-sequence decode forward and graph replay
   under torch.cuda.set_sync_debug_mode("error"), a temperature / top-p /
   min-p step, an 8,192-token prefill, and a `cuda:1` worker where there are
   two GPUs.
5. bench: `bench/gpu_serving.py --quick --streams 1 256` (issue 17's targets,
   side by side with transformers), its targets table copied here.
6. wquant: `bench/wquant_gemm.py` (issue 38): the quantized-weight GEMMs' TFLOP/s
   (Triton INT4 W4A16, INT8 W8A16/W8A8, FP8 W8A16, torch._scaled_mm FP8) against
   bf16 cuBLAS; their exactness against the references is in step 1's tests.
7. gguf: `bench/gguf_gemm.py`, the Triton GEMM over GGUF Q4_K / Q8_0 blocks
   beside bf16 cuBLAS (TFLOP/s, GB/s) at a 7B layer's decode and prefill sizes.

A step that fails is reported and the others still run; the exit status is 1
if any failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRIED = REPO / ".cache" / "gpu-check"  # what `make gpu-wheels` prepares to carry to the GPU machine
SITE = Path("/tmp/pagedserve-gpu-site")  # the carried wheels, installed beside the machine's own packages
RESULT = REPO / "bench" / "results" / "gpu_check.md"
STATE = REPO / "bench" / "results" / "gpu_check.json"  # every step's last result on this GPU
STEPS = ("tests", "sanitizer", "resources", "smoke", "bench", "wquant", "gguf", "kvcopy")
TEST_FILES = [
    "tests/unit/test_triton_kernels.py",
    "tests/unit/test_kv_quant.py",
    "tests/unit/test_cuda_graphs.py",
    "tests/unit/test_sampler.py",
    "tests/unit/test_prefill_routing.py",
    "tests/unit/test_worker_device.py",
    "tests/unit/test_kv_memory.py",
    "tests/unit/test_fused_ops.py",
    "tests/unit/test_kv_chunk_invariance.py",
    "tests/unit/test_contiguous_cache.py",
    "tests/unit/test_moe_kernels.py",
    "tests/unit/test_softcap_attention.py",
    "tests/unit/test_families_on_device.py",
    "tests/unit/test_lora_kernels.py",
    "tests/unit/test_wquant_kernels.py",
    "tests/unit/test_gguf_triton.py",
]
OUTPUT_TAIL = 4000
PYTEST_COUNTS = re.compile(r"\d+ (passed|failed|error)")


@dataclass
class StepResult:
    name: str
    ok: bool
    seconds: float
    summary: str
    detail: str = ""


@dataclass
class Report:
    environment: dict[str, str] = field(default_factory=dict)
    steps: list[StepResult] = field(default_factory=list)


# --------------------------------------------------------------------------- 0. environment


def environment() -> dict[str, str]:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "CUDA (torch)": str(torch.version.cuda)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"missing ({exc})"
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info[f"GPU {i}"] = (
                f"{props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                f"{props.total_memory / 2**30:.1f} GiB"
            )
    return info


def cuda_problem() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: the kernels would run in the interpreter, not on the GPU"
    return None


def install_carried() -> list[str]:
    """The packages and files `make gpu-wheels` put in .cache/gpu-check, for a GPU
    machine that lacks them (its own torch, Triton and transformers stay):
    wheels installed without dependencies into SITE, which goes first on the
    path of this process and of every process it starts; the generated gRPC
    stubs (git-ignored, so they do not travel); the default model's config and
    tokenizer (the 1B checkpoint's vocabulary), where `models` is a link that
    did not travel. Returns what it did."""
    done: list[str] = []
    wheels = sorted((CARRIED / "wheels").glob("*.whl"))
    stamp = SITE / ".carried-wheels"  # steps run side by side install once, not into each other
    if wheels and not (stamp.exists() and stamp.read_text() == "\n".join(w.name for w in wheels)):
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*pip, "--upgrade", "--target", str(SITE), *map(str, wheels)], check=True)
        stamp.write_text("\n".join(w.name for w in wheels))
        done.append(f"installed {len(wheels)} carried wheels into {SITE}")
    if SITE.is_dir():
        sys.path.insert(0, str(SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), str(REPO), os.environ.get("PYTHONPATH", "")])
    for stub in sorted((CARRIED / "proto").glob("*.py*")):
        if not (REPO / "proto" / stub.name).exists():
            shutil.copy(stub, REPO / "proto" / stub.name)
            done.append(f"proto/{stub.name}")
    model_files = CARRIED / "model"
    target = REPO / "models" / "SmolLM2-135M-Instruct"
    if model_files.is_dir() and not (target / "config.json").exists():
        models = REPO / "models"
        if models.is_symlink() and not models.exists():  # a link to a checkout that did not come along
            models.unlink()
        shutil.copytree(model_files, target, dirs_exist_ok=True)
        done.append(f"default model config and tokenizer in {target.relative_to(REPO)}")
    return done


# --------------------------------------------------------------------------- steps


def _run(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit status, output) of a command in the repository; 124 on timeout."""
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout_s
        )
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        status = 124
    print(output, flush=True)  # the whole of it: a lease's log is the only copy (the report keeps a tail)
    print(f"[{time.perf_counter() - started:.0f} s, exit {status}]", flush=True)
    return status, output


def _limit(args: argparse.Namespace, default_s: float) -> float:
    return min(default_s, args.timeout_s or default_s)


def _parallel_args() -> list[str]:
    """pytest-xdist's workers where it is installed: the kernels' Triton compilation is
    CPU-bound and a GPU machine has many cores, so the tests fit in one short lease."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return []
    return ["-n", str(min(8, os.cpu_count() or 1))]


def step_tests(args: argparse.Namespace) -> StepResult:
    # Every failure is listed (no -x): a lease is too short to find them one run at a time.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_parallel_args(), *TEST_FILES]
    # The C++ CPU kernels are not what this checks: not building them saves the lease a minute.
    status, output = _run(command, _limit(args, 540), {"PAGEDSERVE_CPU_KERNELS": "0"})
    # pytest's closing count, not whatever warning came last
    counts = [line.strip("= ") for line in output.splitlines() if PYTEST_COUNTS.search(line)]
    return StepResult("tests", status == 0, 0, (counts or ["no test count in the output"])[-1], _tail(output))


def _compute_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    for candidate in (found, "/usr/local/cuda/bin/compute-sanitizer"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def step_sanitizer(args: argparse.Namespace) -> StepResult:
    tool = _compute_sanitizer()
    if tool is None:
        return StepResult("sanitizer", True, 0, "skipped: compute-sanitizer is not on this machine")
    command = [tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-m", "bench.gpu_check"]
    status, output = _run([*command, "--sanitize-case"], _limit(args, 300))
    errors = [line for line in output.splitlines() if "ERROR SUMMARY" in line]
    return StepResult("sanitizer", status == 0, 0, errors[-1] if errors else f"exit {status}", _tail(output))


def sanitize_case() -> None:
    """What memcheck watches (small shapes: it slows every access): the kernels'
    edge cases, each checked against the reference too."""
    import torch

    from kernels import quant, reference
    from kernels import triton as T

    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    blocks, kv_heads, heads, dim, size = 64, 2, 8, 128, 16
    k_cache = torch.randn(blocks, kv_heads, size, dim, device=dev, dtype=bf16)
    v_cache = torch.randn_like(k_cache)
    key = torch.randn(6, kv_heads, dim, device=dev, dtype=bf16)
    slots = torch.tensor([3, -1, 40, -1, 100, 1023], device=dev)  # -1: not written
    before = k_cache.clone()
    T.write_kv(key, key, k_cache, v_cache, slots)

    def at(cache: torch.Tensor, slot: int) -> torch.Tensor:
        return cache[slot // size, :, slot % size]

    for row, slot in ((0, 3), (2, 40), (4, 100), (5, 1023)):
        assert torch.equal(at(k_cache, slot), key[row])
    assert all(torch.equal(at(k_cache, s), at(before, s)) for s in (1, 2, 41))  # -1 wrote nothing
    contexts = [1, 50, 300, 1000]
    tables = torch.randint(0, blocks, (4, -(-max(contexts) // size)), device=dev, dtype=torch.int32)
    ctx = torch.tensor(contexts, device=dev, dtype=torch.int32)
    query = torch.randn(4, heads, dim, device=dev, dtype=bf16)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.1)
    for splits in (1, 16, 64):
        got = T.split_kv_decode_attention(query, k_cache, v_cache, tables, ctx, 0.1, num_splits=splits)
        torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
    q_cache = torch.zeros(blocks, kv_heads, size, dim, device=dev, dtype=quant.FP8_DTYPE)
    scales = quant.KVScales.zeros(q_cache.shape, q_cache.dtype, dev)
    assert scales is not None
    T.write_kv(key, key, q_cache, q_cache.clone(), slots, scales=scales)
    T.paged_decode_attention(query, q_cache, q_cache, tables, ctx, 0.1, scales=scales)
    lens = [17, 1, 129]  # a mixed prefill: chunks over cached context
    cu = torch.tensor([0, 17, 18, 147], device=dev, dtype=torch.int32)
    ctx = torch.tensor([40, 1, 600], device=dev, dtype=torch.int32)
    prefill_query = torch.randn(sum(lens), heads, dim, device=dev, dtype=bf16)
    got = T.paged_prefill_attention(prefill_query, k_cache, v_cache, tables[:3], cu, ctx, 0.1)
    want = reference.paged_prefill_attention(prefill_query, k_cache, v_cache, tables[:3], cu, ctx, 0.1)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    logits = torch.randn(5, 3001, device=dev)
    temperature, keys = torch.rand(5, device=dev) + 0.5, torch.randint(0, 2**32, (5,), device=dev)
    cut = torch.full((5,), -torch.inf, device=dev)
    assert torch.equal(
        T.gumbel_argmax(logits, temperature, keys, cut), reference.gumbel_argmax(logits, temperature, keys, cut)
    )
    torch.cuda.synchronize()
    print("sanitize case done")


def step_resources(args: argparse.Namespace) -> StepResult:
    import torch

    major, minor = torch.cuda.get_device_capability()
    arches = sorted({major * 10 + minor, 80, 90})
    status, output = _run(
        [sys.executable, "-m", "bench.kernel_resources", "--arch", *map(str, arches)],
        _limit(args, 420),
        {"TRITON_INTERPRET": "0"},
    )
    table = "\n".join(line for line in output.splitlines() if line.startswith("|"))
    return StepResult(
        "resources", status == 0, 0, f"sm {arches}: {'all fit' if status == 0 else 'some do not fit'}", table
    )


def step_smoke(args: argparse.Namespace) -> StepResult:
    status, output = _run([sys.executable, "-m", "bench.gpu_check", "--smoke-case"], _limit(args, 540))
    lines = [line for line in output.splitlines() if line.startswith("smoke:")]
    return StepResult(
        "smoke", status == 0, 0, lines[-1] if lines else f"exit {status}", "\n".join(lines) or _tail(output)
    )


def smoke_case() -> None:
    """Step 4, in its own process (its GPU memory goes with it)."""
    import torch

    from bench.gpu_serving import MAX_NUM_SEQS, ensure_checkpoint
    from worker_svc.config import WorkerConfig
    from worker_svc.step.builder import StepBuilder
    from worker_svc.worker import Worker

    model = ensure_checkpoint()
    block, context = 16, 8192
    worker = Worker(
        WorkerConfig(
            model=str(model), dtype="bfloat16", device="cuda", max_model_len=context, max_num_seqs=MAX_NUM_SEQS
        )
    )
    print(f"smoke: graphs captured {worker.graphs_enabled}, KV pool {worker.info.num_blocks} blocks", flush=True)
    assert worker.graphs_enabled, "the decode graphs were not captured"
    per_seq = 4  # 64 positions each
    assert worker.info.num_blocks >= MAX_NUM_SEQS * per_seq + -(-context // block)

    def step(step_id: int, rows: list[tuple[int, list[int], int]], **sampling: object):
        builder = StepBuilder(block)
        for seq, tokens, start in rows:
            builder.add(seq, tokens, start, [seq * per_seq + b for b in range(per_seq)], sample=True, **sampling)  # type: ignore[arg-type]
        return builder.build(step_id)

    worker.step(step(1, [(s, [5 + s % 100] * 20, 0) for s in range(MAX_NUM_SEQS)]))
    decode = step(2, [(s, [7], 20) for s in range(MAX_NUM_SEQS)])
    runner = worker.runner
    _, batch, graphs = runner._prepare(decode, None, None, use_graphs=True)
    assert graphs is not None, "a 256-row decode did not go to a graph"
    _, eager_batch, _ = runner._prepare(decode, None, None, use_graphs=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            runner.forward(eager_batch)
            graphs.replay(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print("smoke: 256-sequence decode forward and graph replay made no device sync", flush=True)
    out = worker.step(
        step(3, [(s, [7], 20) for s in range(MAX_NUM_SEQS)], temperature=0.8, top_p=0.9, min_p=0.05, seed=1)
    )
    again = worker.step(
        step(4, [(s, [7], 20) for s in range(MAX_NUM_SEQS)], temperature=0.8, top_p=0.9, min_p=0.05, seed=1)
    )
    assert out.samples.token_ids.tolist() == again.samples.token_ids.tolist(), "seeded sampling is not reproducible"
    print(f"smoke: temperature/top-p/min-p step of {MAX_NUM_SEQS}: {out.timings_ms['total_ms']:.1f} ms", flush=True)
    long_seq = MAX_NUM_SEQS  # its blocks after the others'
    table = list(range(long_seq * per_seq, long_seq * per_seq + -(-context // block)))
    builder = StepBuilder(block)
    builder.add(long_seq, [(11 * p) % 40000 + 100 for p in range(8192)], 0, table, sample=True)
    started = time.perf_counter()
    worker.step(builder.build(5))
    torch.cuda.synchronize()
    print(f"smoke: an 8,192-token prefill in {(time.perf_counter() - started) * 1e3:.0f} ms, no OOM", flush=True)
    del worker, runner, batch, eager_batch, graphs
    if torch.cuda.device_count() >= 2:
        other = Worker(WorkerConfig(model=str(model), dtype="bfloat16", device="cuda:1", num_blocks=64, max_num_seqs=8))
        out = other.step(step(1, [(0, [5, 6, 7], 0)]))
        assert other.model.device == torch.device("cuda", 1) and other.cache.k.device == torch.device("cuda", 1)
        print(f"smoke: a cuda:1 worker served a step on {other.info.device}", flush=True)
    else:
        print("smoke: one GPU: the cuda:1 start is not checked", flush=True)


def step_bench(args: argparse.Namespace) -> StepResult:
    status, output = _run(
        [sys.executable, "-m", "bench.gpu_serving", "--quick", "--streams", "1", "256"], _limit(args, 540)
    )
    results = REPO / "bench" / "results" / "gpu_serving.md"
    text = results.read_text() if results.exists() else ""
    targets = text[text.find("## Issue 17 targets") :] if "## Issue 17 targets" in text else ""
    summary = "issue 17 targets in bench/results/gpu_serving.md" if status == 0 else f"exit {status}"
    return StepResult("bench", status == 0, 0, summary, targets or _tail(output))


def _gemm_step(name: str, module: str, limit_s: int, results: str, args: argparse.Namespace) -> StepResult:
    """A quantized GEMM bench beside bf16 cuBLAS (`python -m MODULE`); its table copied here."""
    status, output = _run([sys.executable, "-m", module], _limit(args, limit_s))
    table = "\n".join(line for line in output.splitlines() if line.startswith("|"))
    summary = f"TFLOP/s vs bf16 cuBLAS in {results}" if status == 0 else f"exit {status}"
    return StepResult(name, status == 0, 0, summary, table or _tail(output))


def step_wquant(args: argparse.Namespace) -> StepResult:
    """Triton INT4/INT8/FP8 GEMMs and torch._scaled_mm FP8 (bench/wquant_gemm.py)."""
    return _gemm_step("wquant", "bench.wquant_gemm", 300, "bench/results/wquant_gemm_gpu.md", args)


def step_gguf(args: argparse.Namespace) -> StepResult:
    """The Triton GEMM over GGUF blocks (Q4_K, Q8_0) on a 7B layer's shapes at T = 1,
    32, 2,048 (bench/gguf_gemm.py)."""
    return _gemm_step("gguf", "bench.gguf_gemm", 420, "bench/results/gguf_gemm.md", args)


def step_kvcopy(args: argparse.Namespace) -> StepResult:
    """Host <-> device KV block copies of the second tier, beside plain pinned copies
    (bench/kv_offload_copy.py, issue 41)."""
    status, output = _run([sys.executable, "-m", "bench.kv_offload_copy"], _limit(args, 120))
    table = "\n".join(line for line in output.splitlines() if line.startswith("|"))
    summary = "GB/s in bench/results/kv_offload_copy.md" if status == 0 else f"exit {status}"
    return StepResult("kvcopy", status == 0, 0, summary, table or _tail(output))


def _tail(output: str) -> str:
    return "```\n" + output[-OUTPUT_TAIL:].strip() + "\n```"


STEP_FUNCTIONS: dict[str, Callable[[argparse.Namespace], StepResult]] = {
    "tests": step_tests,
    "sanitizer": step_sanitizer,
    "resources": step_resources,
    "smoke": step_smoke,
    "bench": step_bench,
    "wquant": step_wquant,
    "gguf": step_gguf,
    "kvcopy": step_kvcopy,
}


# --------------------------------------------------------------------------- report


def merge_recorded(report: Report, state: Path) -> Report:
    """The report with the steps recorded earlier on the same GPU that this run
    did not run (a run of `--only` some steps), in STEPS order; records it."""
    gpu = report.environment.get("GPU 0", "")
    recorded: dict[str, dict[str, object]] = {}
    state.parent.mkdir(parents=True, exist_ok=True)
    with open(state.with_suffix(".lock"), "w") as lock:  # steps run side by side each add theirs
        fcntl.flock(lock, fcntl.LOCK_EX)
        if state.exists():
            saved = json.loads(state.read_text())
            if saved.get("gpu") == gpu:
                recorded = saved.get("steps", {})
        recorded |= {s.name: dataclasses.asdict(s) for s in report.steps}
        state.write_text(json.dumps({"gpu": gpu, "steps": recorded}, indent=1) + "\n")
    steps = [StepResult(**recorded[name]) for name in STEPS if name in recorded]  # type: ignore[arg-type]
    return Report(report.environment, steps)


def write_report(report: Report, started: float) -> Path:
    gpu = report.environment.get("GPU 0", "no GPU")
    lines = [
        f"# make gpu-check on {gpu.split(',')[0]}",
        "",
        "Issue 27's check of the CUDA path (`make gpu-check`, bench/gpu_check.py), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{sum(s.seconds for s in report.steps):.0f} s of steps.",
        "",
        *[f"* {k}: {v}" for k, v in report.environment.items()],
        "",
        "| step | result | seconds | summary |",
        "|---|---|---|---|",
        *[f"| {s.name} | {'pass' if s.ok else '**FAIL**'} | {s.seconds:.0f} | {s.summary} |" for s in report.steps],
    ]
    for s in report.steps:
        if s.detail:
            lines += ["", f"## {s.name}", "", s.detail]
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text("\n".join(lines) + "\n")
    return RESULT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS), help="run these steps (default all)")
    parser.add_argument("--timeout-s", type=float, help="at most this long a step (a lease's deadline)")
    parser.add_argument("--sanitize-case", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke-case", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sanitize_case or args.smoke_case:  # run by the steps below, the carried packages on PYTHONPATH
        sanitize_case() if args.sanitize_case else smoke_case()
        return 0
    started = time.perf_counter()
    report = Report(environment())
    for key, value in report.environment.items():
        print(f"{key}: {value}", flush=True)
    if (problem := cuda_problem()) is not None:
        print(f"\nmake gpu-check FAILED: it needs a CUDA GPU: {problem}.", file=sys.stderr)
        print("Run it on a machine with a GPU (docs/design.md, 'The worker on a GPU').", file=sys.stderr)
        return 2
    for line in install_carried():
        print(f"carried: {line}", flush=True)
    for name in STEPS:
        if name not in args.only:
            continue
        print(f"\n==== gpu-check {name}", flush=True)
        step_started = time.perf_counter()
        try:
            result = STEP_FUNCTIONS[name](args)
        except Exception as exc:  # reported; the other steps still run
            result = StepResult(name, False, 0, f"{type(exc).__name__}: {exc}", _tail(traceback.format_exc()))
        result.seconds = time.perf_counter() - step_started
        report.steps.append(result)
        print(f"==== {name}: {'pass' if result.ok else 'FAIL'} ({result.seconds:.0f} s): {result.summary}", flush=True)
    report = merge_recorded(report, STATE)
    path = write_report(report, started)
    print(f"\nwrote {path.relative_to(REPO)}")
    for s in report.steps:
        print(f"{s.name:10} {'pass' if s.ok else 'FAIL':5} {s.seconds:5.0f} s  {s.summary}")
    return 0 if all(s.ok for s in report.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
