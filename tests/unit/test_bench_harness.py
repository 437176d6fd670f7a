"""bench/harness, the one harness every benchmark uses: the machine line names the
CPU's matmul flags, every results file starts with it, `make bench` knows every
bench/*.py, and no benchmark carries a harness of its own."""

from __future__ import annotations

import ast
from pathlib import Path

from bench import run_all
from bench.harness import machine, results

BENCH = Path(run_all.__file__).resolve().parent


def test_the_cpu_line_names_model_cores_and_matmul_flags(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu sse avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n\n"
        "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu\n"
    )
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k)
    )
    cpu = machine.cpu()
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu.flags == ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    assert cpu.cores >= 1 and f"{cpu.cores} cores" in cpu.describe()
    assert "matmul flags: avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 amx_int8" in cpu.describe()


def test_a_results_file_starts_with_the_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    path = results.write_result("probe", "A probe", results.markdown_table(["a", "b"], [[1, 2]]), "notes")
    text = path.read_text()
    assert text.startswith("# A probe\n\nmachine: ") and machine.cpu().describe() in text
    assert "| a | b |\n|---|---|\n| 1 | 2 |" in text and text.rstrip().endswith("notes")


def test_make_bench_lists_every_benchmark_file():
    assert run_all.unlisted() == []


def test_benchmarks_share_the_harness():
    """No benchmark file starts processes, opens worktrees or writes results but through bench/harness."""
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not imported & {"tools.processes", "subprocess", "tempfile"} or path.stem in run_all.HELPERS, (
            f"{path.name} launches processes itself: use bench/harness/services.py"
        )
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        assert not defined & {"markdown_table", "write_result", "save_plot", "machine", "percentile", "drive"}, (
            f"{path.name} carries its own harness"
        )


def test_an_openai_server_is_started_driven_and_stopped(tmp_path):
    """bench/peers.py's path through the harness: a server process (here a stub that
    streams at a known pace) is ready at its first completion, N streams through the
    `openai` client give its TTFT, time between tokens and tokens, and stop() ends it."""
    import asyncio
    import sys

    from bench.harness import openai_servers
    from tests.helpers import openai_stub
    from tools.ports import free_port

    port = free_port()
    server = openai_servers.HttpServer(
        name="stub",
        weights_dtype_bytes=2,
        command=[sys.executable, "-m", "tests.helpers.openai_stub", str(port)],
        base_url=f"http://127.0.0.1:{port}/v1",
    )
    running = openai_servers.RunningServer(server, tmp_path / "stub.log")
    try:
        ready_s, model = running.wait_ready(timeout_s=60)
        assert model == openai_stub.MODEL and ready_s > 0
        prompts = [f"prompt {i}" for i in range(6)]
        result = asyncio.run(openai_servers.drive_completions(server.base_url, model, prompts, 3, 8))
    finally:
        running.stop()
    assert running.proc.returncode is not None  # the process group is gone
    assert result.requests == 6 and result.tokens == 6 * 8
    assert openai_stub.FIRST_S <= result.ttft_p50 < openai_stub.FIRST_S + 2.0
    assert openai_stub.GAP_S * 0.9 <= result.itl_p50 < openai_stub.GAP_S + 0.5
    # Three streams, two requests each, one after the other: at least two requests' time.
    assert result.wall_s >= 2 * (openai_stub.FIRST_S + 7 * openai_stub.GAP_S)
    assert result.tok_s == result.tokens / result.wall_s
