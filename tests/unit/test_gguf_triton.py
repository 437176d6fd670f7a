"""The Triton GEMM over GGUF blocks (kernels/triton/gguf_gemm.py) against the
reference (kernels/gguf_quant.py's quant_linear) for every served format, under
TRITON_INTERPRET=1 without a GPU (compiled on the GPU in `make gpu-check`): its
decode is bit for bit the reference's, through the GEMV (few tokens) and the GEMM;
its products match at odd token counts and output sizes that fit no tile; a
QuantLinear on CUDA dispatches to it, and a tiny GGUF worker through it gives
transformers' greedy tokens; its tiles compile for sm_80 and sm_90 without
spilling (slow); bench/gguf_gemm.py checks and reports what it times."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.gguf_quant import BLOCK_FORMATS, quant_linear
from kernels.triton import gguf_gemm
from kernels.triton.common import interpreter_enabled
from tests.helpers.gguf_blocks import random_blocks
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.gguf_tokens import BLOCK_SIZE, PROMPT, reference_tokens, worker_tokens
from tests.helpers.sweeps import sweep
from tools.processes import REPO
from worker_svc.config import WorkerConfig
from worker_svc.models import linear
from worker_svc.models.linear import QuantLinear, quant_kernel, quant_op
from worker_svc.worker import Worker

DEVICE = torch.device("cpu" if interpreter_enabled() else "cuda")
FORMATS = sorted(BLOCK_FORMATS)
OUT = 70  # a multiple of no output tile (8 for the GEMV, 64 for the GEMM)
# Under the interpreter a super-block format (256 weights, K-quant scales) costs 3-8x a
# 32-weight one per case. There make test keeps every 32-weight format in every case and
# each super-block format where it meets a kernel's path once: its decode bit for bit
# through one of the two kernels (each kernel decodes one super-block format at least),
# its fp32 product through both (1 and 7 tokens); the rest repeat those paths (make
# test-slow). Compiled on a GPU (make gpu-check) every case runs.
SUPER_BLOCK = [q for q in FORMATS if BLOCK_FORMATS[q][0] == 256]
EVERY_CASE = [q for q in FORMATS if q not in SUPER_BLOCK or not interpreter_enabled()]


def weight(qtype: str, seed: int, blocks: int | None = None):
    """OUT rows of `blocks` blocks (default: 3 of 32 weights, or 2 super-blocks of 256)."""
    elems = BLOCK_FORMATS[qtype][0]
    count = blocks if blocks is not None else (3 if elems == 32 else 2)
    return random_blocks(qtype, OUT, count * elems, seed).to(DEVICE)


def run(x: torch.Tensor, w) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return gguf_gemm.quant_linear(x.to(DEVICE), w).cpu()


@pytest.mark.parametrize("qtype", sweep(FORMATS, keep=[*EVERY_CASE, "Q6_K"]))
def test_the_gemm_decodes_every_weight_as_the_reference(qtype):
    """x = I: y = W.T, each output one decoded weight times 1 plus zeros, so exact."""
    w = weight(qtype, seed=1)
    assert not gguf_gemm.gguf_tiles(w.in_features, qtype).gemv
    got = run(torch.eye(w.in_features), w)
    assert torch.equal(got.T, w.dequantize().cpu())


@pytest.mark.parametrize("qtype", sweep(FORMATS, keep=[*EVERY_CASE, "Q4_K", "Q5_K"]))
def test_the_gemv_decodes_every_weight_as_the_reference(qtype):
    w = weight(qtype, seed=2)
    columns = torch.tensor([0, 31, 37, w.in_features - 1])  # block edges, a middle, the last
    assert gguf_gemm.gguf_tiles(len(columns), qtype).gemv
    got = run(torch.eye(w.in_features)[columns], w)
    assert torch.equal(got.T, w.dequantize().cpu()[:, columns])


FP32_CASES = [(q, t) for q in FORMATS for t in (1, 3, 7, 37)]  # GEMV, GEMV, GEMM of 16 rows, of 32


@pytest.mark.parametrize(
    ("qtype", "tokens"),
    sweep(
        FP32_CASES,
        keep=[(q, t) for q, t in FP32_CASES if q in EVERY_CASE or t in (1, 7)],
        ids=[f"{q}-{t}" for q, t in FP32_CASES],
    ),
)
def test_matches_the_reference_fp32(qtype, tokens):
    w = weight(qtype, seed=3)
    x = torch.randn(tokens, w.in_features, generator=torch.Generator().manual_seed(tokens))
    want = quant_linear(x, w.to(torch.device("cpu")))
    got = run(x, w)
    assert got.dtype == torch.float32 and got.shape == (tokens, OUT)
    # fp32 sums in another order: a few ulps of the largest output
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


BF16_CASES = [(q, t) for q in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K") for t in (2, 37)]


# bf16 rounds the decoded weights and x alike: each super-block format once, on either kernel.
@pytest.mark.parametrize(
    ("qtype", "tokens"),
    sweep(
        BF16_CASES,
        keep=[(q, t) for q, t in BF16_CASES if q in EVERY_CASE or (q, t) in (("Q4_K", 37), ("Q6_K", 2))],
        ids=[f"{q}-{t}" for q, t in BF16_CASES],
    ),
)
def test_matches_the_reference_bf16(qtype, tokens):
    w = weight(qtype, seed=4)
    x = torch.randn(tokens, w.in_features, generator=torch.Generator().manual_seed(5)).bfloat16()
    want = quant_linear(x, w.to(torch.device("cpu"))).float()
    got = run(x, w)
    assert got.dtype == torch.bfloat16
    # both round the weights to bf16 and the fp32 sum once; the sums' order differs,
    # so an output can round to the neighbouring bf16 (2^-8 relative)
    torch.testing.assert_close(got.float(), want, atol=1e-2 * float(want.abs().max()), rtol=8e-3)


def test_a_prefill_sized_tile_and_more_k_blocks_than_one_tile():
    w = weight("Q4_K", seed=6, blocks=3)
    x = torch.randn(130, w.in_features, generator=torch.Generator().manual_seed(7))
    tiles = gguf_gemm.gguf_tiles(130, "Q4_K")
    assert (tiles.block_m, tiles.block_n) == (64, 64)
    want = quant_linear(x, w.to(torch.device("cpu")))
    torch.testing.assert_close(run(x, w), want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


def test_leading_dimensions_and_no_tokens():
    w = weight("Q8_0", seed=8)
    x = torch.randn(2, 3, w.in_features, generator=torch.Generator().manual_seed(9))
    got = run(x, w)
    assert got.shape == (2, 3, OUT)
    torch.testing.assert_close(got.reshape(6, OUT), run(x.reshape(6, -1), w), atol=0, rtol=0)
    assert run(torch.zeros(0, w.in_features), w).shape == (0, OUT)


def test_tiles_by_tokens_and_unknown_formats_refused():
    assert gguf_gemm.gguf_tiles(1, "Q4_K").gemv and gguf_gemm.gguf_tiles(gguf_gemm.GEMV_MAX_TOKENS, "Q8_0").gemv
    assert [gguf_gemm.gguf_tiles(t, "Q4_K").block_m for t in (5, 16, 17, 64, 65, 2048)] == [16, 16, 32, 32, 64, 128]
    assert set(gguf_gemm.QTYPE_CODES) == set(BLOCK_FORMATS)  # every served format
    with pytest.raises(ValueError, match="IQ2_XS"):
        gguf_gemm.gguf_tiles(1, "IQ2_XS")


def test_quant_linear_on_cuda_dispatches_to_triton():
    assert quant_kernel(torch.device("cuda", 0), cpu_kernel_takes=False) == "triton"
    assert quant_op("triton") is gguf_gemm.quant_linear
    assert quant_kernel(torch.device("cpu"), cpu_kernel_takes=True) == "cpu"
    assert quant_kernel(torch.device("cpu"), cpu_kernel_takes=False) == ""
    assert quant_op("") is quant_linear
    on_cpu = QuantLinear(random_blocks("Q8_0", 4, 32, seed=10))  # cpu_kernel off: the reference
    assert on_cpu.kernel == "" and on_cpu.op is quant_linear
    if torch.cuda.is_available():
        on_gpu = QuantLinear(random_blocks("Q8_0", 4, 32, seed=10).to(torch.device("cuda")))
        assert on_gpu.kernel == "triton" and on_gpu.op is gguf_gemm.quant_linear


def test_the_bench_skips_cleanly_without_a_gpu(capsys):
    from bench import gguf_gemm as bench

    if bench.skip_reason() is None:
        pytest.skip("a GPU is here: make gpu-check runs the bench")
    before = bench.RESULT.stat().st_mtime if bench.RESULT.exists() else None
    assert bench.main([]) == 0
    assert "bench.gguf_gemm skipped" in capsys.readouterr().out
    assert (bench.RESULT.stat().st_mtime if bench.RESULT.exists() else None) == before


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="make gpu-check compiles them on its GPU")
def test_every_tile_compiles_for_sm80_and_sm90_without_spilling():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "bench.gguf_gemm", "--resources-only"]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {(r["arch"], r["qtype"]) for r in rows} == {(a, q) for a in (80, 90) for q in FORMATS}, proc.stderr[-3000:]
    assert not [r for r in rows if r["spill_bytes"] or r["registers"] > 255]
    assert proc.returncode == 0


def test_the_bench_checks_and_reports_its_kernels():
    """bench/gguf_gemm.py's own code on a tiny shape (under the interpreter here):
    every kernel's output checked against the reference, one row each, and the
    table's arithmetic (TFLOP/s, GB/s, the ratio to bf16)."""
    from bench import gguf_gemm as bench

    calls: list[object] = []

    def timer(fn):  # the call must run: it is what would be timed
        calls.append(fn())
        return 2.0 if len(calls) % 3 == 1 else 1.0  # bf16 first, then each format

    rows = bench.gguf_rows(tokens=(1, 5), shapes=(("tiny", 24, 256),), dev=DEVICE, timer=timer)
    assert [(r.tokens, r.kernel) for r in rows] == [(t, k) for t in (1, 5) for k in ("bf16 cuBLAS", *bench.QTYPES)]
    assert all(isinstance(c, torch.Tensor) and c.shape[-1] == 24 for c in calls)
    q4k = next(r for r in rows if r.kernel == "Q4_K" and r.tokens == 5)
    assert q4k.moved_bytes == 24 * 144 + 2 * 5 * (256 + 24)  # the blocks as stored, x and y in bf16
    assert q4k.tflops == pytest.approx(2 * 5 * 24 * 256 / 1e-3 / 1e12)
    table = bench.gguf_table(rows)
    assert "| tiny | 5 | Q4_K | 1.000 |" in table and table.count("2.00x") == 4


# Slow under the interpreter (a tiny model's 8 steps: ~3 CPU minutes a format), not on a GPU.
WORKER_FORMATS = [pytest.param(q, marks=pytest.mark.slow if interpreter_enabled() else ()) for q in FORMATS]


@pytest.mark.parametrize("qtype", WORKER_FORMATS)
def test_a_gguf_worker_through_the_kernels_gives_transformers_tokens(tmp_path, monkeypatch, qtype):
    """A tiny GGUF worker, fp32, its linears in the Triton kernels (on CUDA by the
    dispatch; here the dispatch is told CUDA's answer and the kernels run in the
    interpreter): transformers' greedy tokens on the same file."""
    calls = []
    kernel = gguf_gemm.quant_linear

    def counted(x, w):
        calls.append(tuple(x.shape))
        return kernel(x, w)

    monkeypatch.setattr(gguf_gemm, "quant_linear", counted)
    if DEVICE.type == "cpu":
        monkeypatch.setattr(linear, "quant_kernel", lambda device, cpu_kernel_takes: "triton")
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, seed=len(qtype) + ord(qtype[1]))
    config = WorkerConfig(model=str(path), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE, device=DEVICE.type)
    assert worker_tokens(Worker(config)) == reference_tokens(path)
    assert {shape[0] for shape in calls} >= {len(PROMPT), 1}  # the prefill's rows (GEMM) and a decode's (GEMV)
