"""bench/gpu_serving.py (`make bench-gpu`) where no GPU is needed: it exits 0
without one, its checkpoint has issue 17's shape, its formulas, and its report
over results shaped as the sections return them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench import gpu_serving
from tools.processes import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    results = REPO / "bench" / "results" / "gpu_serving.md"
    before = results.stat().st_mtime if results.exists() else None
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_serving", "--quick"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "needs a CUDA GPU" in proc.stdout
    assert (results.stat().st_mtime if results.exists() else None) == before
    assert not gpu_serving.CHECKPOINT.exists() or before is not None  # nothing built either


def test_checkpoint_is_issue_17s_1b_llama():
    config = gpu_serving.llama_1b_config()
    assert (config["hidden_size"], config["num_hidden_layers"]) == (2048, 16)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 64)
    assert config["vocab_size"] == 49152 and config["model_type"] == "llama" and config["tie_word_embeddings"]
    params = sum(torch.Size(s).numel() for s in gpu_serving.llama_weight_shapes(config).values())
    assert 1.05e9 < params < 1.1e9, params  # Llama 3.2 1B's layers (intermediate 8192), a 49k vocabulary


def test_formulas():
    # 1 x 4k context, 8 KV heads of 64, bf16: K and V.
    assert gpu_serving.decode_bytes([4096], 8, 64, 2) == 2 * 4096 * 8 * 64 * 2
    # Causal L = 2: QK^T and PV, 2 flops per multiply-add, over L^2 / 2 pairs.
    assert gpu_serving.causal_flops([2], 1, 1) == 8
    assert gpu_serving.causal_flops([4096] * 4, 32, 128) == 4 * gpu_serving.causal_flops([4096], 32, 128)


def test_report_over_every_section(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    args = gpu_serving.argparse.Namespace(streams=[1, 256], max_tokens=256)
    decode = {"case": "1 x 32k", "splits": 64, "split_gbs": 1600.0, "single_gbs": 150.0, "max_err": 1e-3}
    prefill = {"case": "4 x 4k, d64", "triton_tflops": 200.0, "sdpa_tflops": 330.0, "routed_tflops": 320.0}
    step = {"batch": 256, "graphs": True, "wall_ms": 5.0, "gpu_ms": 4.5, "busy": 0.9, "kernels": 300}
    step |= {"prepare_ms": 0.5, "forward_ms": 0.1, "sample_ms": 4.0}
    results = {
        "kernels": {"copy_gbs": 3000.0, "decode": [decode], "prefill": [prefill]},
        "step": [step],
        "serving": {
            "start_s": 40.0,
            "ttft_first_ms": 30.0,
            "ttft_warm_ms": 20.0,
            "runs": {
                1: {"tok_s": 260.0, "itl_p50": 3.8, "itl_p99": 5.0},
                256: {"tok_s": 26000.0, "itl_p50": 9.0, "itl_p99": 20.0},
            },
        },
        "generate": {1: 14.0, 256: 2780.0},
        "continuous": {"implementation": "paged|sdpa", 1: 13.0, 256: 1611.0},
    }
    text = gpu_serving.report(args, results, {"continuous": "TypeError: no"}, 0.0)
    assert "Fake H100" in text and "| 256 | 26000 | 2780 | 1611 |" in text
    for target in gpu_serving.TARGETS:
        assert f"| {target} |" in text, target
    assert "**missed**" not in text and "continuous: `TypeError: no`" in text
    saved = []
    monkeypatch.setattr(gpu_serving, "save_plot", lambda fig, name: saved.append(name))
    gpu_serving.plot(args, results)
    assert saved == ["gpu_serving"]
