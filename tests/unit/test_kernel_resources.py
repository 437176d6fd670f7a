"""The attention kernels fit the GPU they are compiled for (issue 27, fault 4):
for head_dim 64, 128 and 256 on sm_80 (A100) and sm_90 (H100) the tiles the
launcher picks (kernels/triton/launch.attention_tiles) compile within the
architecture's shared memory, with at most 255 registers and nothing spilled; so
do the quantized-weight GEMV and GEMM (kernels/triton/wquant.py) for each format.
Triton compiles for a CUDA target without a GPU (ptxas ships in its wheel), so
this runs here; `make gpu-check` runs the same report on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="make gpu-check reports the kernels compiled for its GPU")
def test_attention_and_wquant_tiles_fit_sm80_and_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "bench.kernel_resources", "--arch", "80", "90", "--quick", "--json"]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    covered = {(r["arch"], r["head_dim"], r["kernel"]) for r in rows}
    for arch in (80, 90):
        for head_dim in (64, 128, 256):
            assert {(arch, head_dim, k) for k in ("prefill", "decode", "split decode")} <= covered
    weights = {(r["arch"], r["kernel"], r["dtype"]) for r in rows if r["kernel"].startswith("wquant")}
    formats = {80: ("int4", "int4 g_idx", "int8"), 90: ("int4", "int4 g_idx", "int8", "fp8")}
    assert weights == {(a, f"wquant {k}", f"bf16/{f}") for a in (80, 90) for f in formats[a] for k in ("GEMV", "GEMM")}
    too_big = [r for r in rows if r["shared_bytes"] > r["shared_limit"]]
    spilled = [r for r in rows if r["spill_bytes"] or r["registers"] > 255]
    assert not too_big and not spilled, "\n".join(json.dumps(r) for r in too_big + spilled)
    assert proc.returncode == 0, proc.stderr[-3000:]
