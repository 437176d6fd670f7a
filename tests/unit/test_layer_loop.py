"""The C++ layer loop (kernels/decoder_loop.py) against the Python loop it replaces:
two workers on the same tiny checkpoint, one with PAGEDSERVE_LAYER_LOOP=0, run the
same steps (a fresh prefill, decodes, a decode beside a prefill chunk, a chunk over
cached context alone, a two-sequence decode), and every step's logits and the KV
caches they wrote are equal bit for bit; the loop really ran. Models whose layer is
not the plain pre-norm one keep the Python loop and say why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from kernels import cpu_ops
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.worker_steps import Seq, sampled, step_input
from worker_svc.config import WorkerConfig
from worker_svc.models.layer_loop import TAKEN
from worker_svc.worker import Worker

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels are not built here")

BLOCK = 16
PROMPT_A = [5, 17, 99, 3, 250, 42, 8, 77, 130, 19, 61]
PROMPT_B = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
TABLES = {0: [3, 0], 1: [5, 6]}
SLOTS = {0: [2], 1: [0]}  # a contiguous cache: one slot of max_model_len positions per sequence


def seq(w: Worker, seq_id: int, tokens: list[int], start: int) -> Seq:
    table = SLOTS[seq_id] if w.info.kv_layout == "contiguous" else TABLES[seq_id]
    bs = w.info.block_size
    slots = [table[p // bs] * bs + p % bs for p in range(start, start + len(tokens))]
    return Seq(seq_id, tokens, start, table, slots, sample=True, return_logits=True)


# (sequence, tokens, start) per step; each step's rows are taken in this order.
STEPS = [
    [(0, PROMPT_A, 0)],  # a fresh prefill alone
    [(0, [7], 11)],  # one decode
    [(0, [8], 12), (1, PROMPT_B[:12], 0)],  # a decode beside a fresh chunk: two groups
    [(1, PROMPT_B[12:], 12)],  # a chunk over cached context alone
    [(0, [9], 13), (1, [40], 20)],  # two sequences decoding
    [(0, [10], 14), (1, [41], 21)],
]


def worker(model: Path, dtype: str, loop: bool, monkeypatch: pytest.MonkeyPatch, **fields: object) -> Worker:
    monkeypatch.setenv("PAGEDSERVE_LAYER_LOOP", "1" if loop else "0")
    config = WorkerConfig(model=str(model), dtype=dtype, num_blocks=8, block_size=BLOCK)
    for key, value in fields.items():
        setattr(config, key, value)
    return Worker(config)


def run(w: Worker) -> tuple[list[torch.Tensor], int]:
    """Every step's logits (fp32, the rows sampled), and how many steps the loop took."""
    calls = 0
    loop = w.model.layer_loop
    if loop is not None:
        inner = loop.__call__

        def counted(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal calls
            calls += 1
            return inner(*args)  # type: ignore[arg-type]

        w.model.layer_loop = counted  # type: ignore[assignment]
    logits = []
    for step_id, rows in enumerate(STEPS, start=1):
        out = w.step(step_input(step_id, [], [seq(w, *row) for row in rows]))
        sampled_logits = [s.logits for s in sampled(out)]
        assert all(r is not None for r in sampled_logits)
        logits.append(torch.stack(sampled_logits))  # type: ignore[arg-type]
    return logits, calls


def assert_same(model: Path, dtype: str, monkeypatch: pytest.MonkeyPatch, **fields: object) -> None:
    with capture_logs() as logs:
        fast = worker(model, dtype, True, monkeypatch, **fields)
    [compute] = [e for e in logs if e["event"] == "worker compute"]
    assert compute["layer_loop"] == TAKEN
    slow = worker(model, dtype, False, monkeypatch, **fields)
    assert slow.model.layer_loop is None and slow.model.layer_loop_label == "python: PAGEDSERVE_LAYER_LOOP=0"
    fast_logits, calls = run(fast)
    slow_logits, _ = run(slow)
    # Decodes and the lone chunk take the loop; the two-group step runs the Python loop.
    assert calls >= 3
    for step, (a, b) in enumerate(zip(fast_logits, slow_logits, strict=True)):
        assert torch.equal(a, b), f"step {step + 1}: the loop's logits differ from the Python loop's"
    assert torch.equal(fast.cache.k, slow.cache.k) and torch.equal(fast.cache.v, slow.cache.v)


@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        ("llama", "float32"),  # GQA, llama3 RoPE
        ("llama", "bfloat16"),
        ("llama_bias", "float32"),  # q/k/v, o and MLP biases: the gate-up bias before the activation
        ("qwen2", "float32"),  # q/k/v bias
        ("mistral", "float32"),  # a sliding window on every layer
    ],
)
def test_loop_equals_the_python_loop_on_safetensors(family, dtype, monkeypatch):
    assert_same(tiny_checkpoint(family), dtype, monkeypatch)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_loop_equals_the_python_loop_on_gguf_blocks(tmp_path, qtype, monkeypatch):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, seed=3, overrides={"attn_v.weight": "Q8_0"})
    assert_same(path, "float32", monkeypatch)


def test_loop_equals_the_python_loop_with_int8_activations(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny-Q4_1.gguf", "Q4_1", seed=4)
    assert_same(path, "float32", monkeypatch, quant_activations="int8")


def test_loop_equals_the_python_loop_over_a_contiguous_cache(monkeypatch):
    assert_same(tiny_checkpoint("llama"), "float32", monkeypatch, kv_layout="contiguous", max_batch=4, max_model_len=64)


def test_a_quantized_cache_keeps_the_python_loop_step_by_step(monkeypatch):
    """The loop is chosen at load; a step over a cache it does not write (int8, with
    scales) runs the Python loop."""
    w = worker(tiny_checkpoint("llama"), "float32", True, monkeypatch, kv_dtype="int8")
    assert w.model.layer_loop_label == TAKEN
    _, calls = run(w)
    assert calls == 0


@pytest.mark.parametrize(
    ("family", "fields", "why"),
    [
        ("gemma2", {}, "python: norms"),
        ("qwen3", {}, "python: qk_norm"),
        ("granite", {}, "python: residual_scale"),
        ("llama", {"enforce_eager": True}, "python: not the CPU's C++ ops"),
    ],
)
def test_other_layers_keep_the_python_loop_and_say_why(family, fields, why, monkeypatch):
    w = worker(tiny_checkpoint(family), "float32", True, monkeypatch, **fields)
    assert w.model.layer_loop_label == why
