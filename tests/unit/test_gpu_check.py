"""`make gpu-check` (bench/gpu_check.py, issue 27) where there is no GPU: it fails
loudly and non-zero, before touching anything, whether started through make or
as a module; its report names the GPU and every step."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench import gpu_check
from tools.processes import REPO

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def _result_mtime() -> float | None:
    return gpu_check.RESULT.stat().st_mtime if gpu_check.RESULT.exists() else None


@no_gpu
@pytest.mark.parametrize("command", [[sys.executable, "-m", "bench.gpu_check"], ["make", "-s", "gpu-check"]])
def test_without_cuda_it_fails_loudly_and_writes_nothing(command):
    before = _result_mtime()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "make gpu-check FAILED: it needs a CUDA GPU: no CUDA device" in proc.stderr
    assert f"torch: {torch.__version__}" in proc.stdout and "triton:" in proc.stdout  # what it found, printed first
    assert _result_mtime() == before


def test_the_interpreter_is_refused_even_with_a_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "TRITON_INTERPRET" in (gpu_check.cuda_problem() or "")


def test_runs_of_some_steps_add_up_per_gpu(tmp_path):
    """Three calls of `--only` some steps (a lease's 10-minute commands) make one
    report; another GPU's record is not mixed in."""
    state = tmp_path / "gpu_check.json"
    h100 = {"GPU 0": "NVIDIA H100 80GB HBM3, sm_90"}
    first = gpu_check.Report(h100, [gpu_check.StepResult("smoke", True, 90, "ok")])
    gpu_check.merge_recorded(first, state)
    second = gpu_check.Report(h100, [gpu_check.StepResult("tests", False, 60, "1 failed")])
    merged = gpu_check.merge_recorded(second, state)
    assert [(s.name, s.ok) for s in merged.steps] == [("tests", False), ("smoke", True)]  # in STEPS order
    other = gpu_check.merge_recorded(gpu_check.Report({"GPU 0": "NVIDIA A100"}, []), state)
    assert other.steps == []


def test_the_report_names_the_gpu_and_every_step(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "RESULT", tmp_path / "gpu_check.md")
    report = gpu_check.Report({"torch": "2.11", "GPU 0": "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79.1 GiB"})
    report.steps = [
        gpu_check.StepResult("tests", True, 61, "120 passed"),
        gpu_check.StepResult("sanitizer", False, 30, "ERROR SUMMARY: 2 errors", "```\ninvalid read\n```"),
    ]
    text = gpu_check.write_report(report, 0.0).read_text()
    assert text.startswith("# make gpu-check on NVIDIA H100 80GB HBM3")
    assert "| tests | pass | 61 | 120 passed |" in text and "| sanitizer | **FAIL** | 30 |" in text
    assert "## sanitizer" in text and "invalid read" in text


def test_every_test_file_it_runs_exists_and_collects():
    """The tests step runs these on the GPU; here (no GPU) they must at least exist and
    import, so a renamed or broken file is not found first on a lent machine."""
    assert all((REPO / f).is_file() for f in gpu_check.TEST_FILES)
    assert {"tests/unit/test_moe_kernels.py", "tests/unit/test_families_on_device.py"} <= set(gpu_check.TEST_FILES)
    command = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *gpu_check.TEST_FILES]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
