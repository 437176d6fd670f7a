"""The docs test: every command block of README.md and every example of
`make serve`'s banner runs against a live cluster of the default model, started
as `make serve` starts it (`python -m tools.local_cluster`, which prints the
banner), and where the README shows an output the command's output has its
structure (tests/helpers/doc_blocks.py: JSON by keys and types, text by lines
with `…` for the model's words)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.doc_blocks import Block, banner_blocks, markdown_blocks, mismatch
from tests.helpers.procs import REPO, free_port

README = REPO / "README.md"
# README blocks that cannot run here, by their first line, with the reason.
SKIPPED = {
    "make serve": "starts the cluster the other blocks run against: its launcher runs here, on free ports",
    "make test": "runs the whole suite, this test included",
    "make serve MODEL=/path/to/checkpoint": (
        "names a checkpoint of the user's; the same launcher serves the default model here"
    ),
}
# The addresses the README's commands use (make serve's defaults) -> the services that stand for them.
README_ADDRESSES = {"127.0.0.1:50051": "scheduler", "127.0.0.1:8000": "gateway"}
BANNER_START, BANNER_END = "Examples (", "Ctrl-C drains"
START_TIMEOUT_S = 420.0  # a first worker start on a busy 2-core machine
COMMAND_TIMEOUT_S = 180.0

BLOCKS = markdown_blocks(README.read_text(), "README.md")


def _first_line(block: Block) -> str:
    return block.code.splitlines()[0]


def _param(block: Block) -> object:
    reason = SKIPPED.get(_first_line(block))
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return pytest.param(block, marks=marks, id=block.where)


def _free_pair() -> int:
    """A free port whose next one is free too (the launcher checks the scheduler's admin port, + 1)."""
    while True:
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


@pytest.fixture(scope="module")
def served(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The launcher `make serve` execs, on the default model and free ports: its banner,
    and the address of each service."""
    ports = {"scheduler": _free_pair()}
    ports |= {name: free_port() for name in ("worker", "gateway", "metrics")}
    log_path = tmp_path_factory.mktemp("serve") / "launcher.log"
    cmd = [sys.executable, "-m", "tools.local_cluster", "--model", str(default_model), "--drain-timeout-s", "5"]
    cmd += ["--port", str(ports["scheduler"]), "--worker-port", str(ports["worker"])]
    cmd += ["--gateway-port", str(ports["gateway"]), "--metrics-port", str(ports["metrics"])]
    cmd += ["--worker-args", "--num-blocks 256"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while BANNER_END not in (text := log_path.read_text(errors="replace")):
            assert proc.poll() is None, f"the launcher exited with {proc.returncode}:\n{text[-4000:]}"
            assert time.monotonic() < deadline, f"no banner after {START_TIMEOUT_S:g} s:\n{text[-4000:]}"
            time.sleep(0.2)
        yield text, {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _run(block: Block, code: str) -> str:
    """Run as pasted into a shell in the checkout (bash: stopping at the first failure);
    stdout and stderr together, as a terminal shows them."""
    command = ["bash", "-e", "-o", "pipefail", "-c", code] if block.language == "bash" else [sys.executable, "-c", code]
    result = subprocess.run(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    output = result.stdout
    assert result.returncode == 0, f"{block.where} exited with {result.returncode}:\n{code}\n---\n{output}"
    assert "Traceback" not in output and output.strip(), f"{block.where}:\n{code}\n---\n{output!r}"
    return output


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_readme_block_runs_and_prints_what_it_shows(block: Block, served: tuple[str, dict[str, str]]) -> None:
    _, addresses = served
    code = block.code.replace(".venv/bin/python", sys.executable)
    for default, service in README_ADDRESSES.items():
        code = code.replace(default, addresses[service])
    used = set(re.findall(r"127\.0\.0\.1:\d+", code))
    assert used <= set(addresses.values()), f"{block.where} uses an address the test does not map: {used}"
    output = _run(block, code)
    if block.shown is not None:
        assert (why := mismatch(block.shown, output)) is None, f"{block.where}: {why}"


def test_every_readme_block_runs_or_is_skipped_by_name() -> None:
    """The skip list names blocks that exist, and most blocks run, most of those with an output to match."""
    firsts = {_first_line(b) for b in BLOCKS}
    assert set(SKIPPED) <= firsts, f"skipped blocks no longer in README.md: {set(SKIPPED) - firsts}"
    run = [b for b in BLOCKS if _first_line(b) not in SKIPPED]
    assert len(run) >= 5 and sum(b.shown is not None for b in run) >= 4


def test_banner_examples_run_as_printed(served: tuple[str, dict[str, str]]) -> None:
    banner, _ = served
    blocks = banner_blocks(banner, BANNER_START, BANNER_END)
    commands = "\n".join(b.code for b in blocks)
    assert len(blocks) == 6, banner
    for needed in ("scheduler_svc.client", "curl", "httpx.stream", "admin.v1", "observability.top"):
        assert needed in commands, needed
    assert "openai import" not in commands  # make serve does not install it
    failures = []
    for block in blocks:
        try:
            _run(block, block.code)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n\n".join(failures)
