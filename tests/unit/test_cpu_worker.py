"""The CPU worker's machine-chosen defaults (issue 25): the C++ attention backend
picked by --attention-backend auto where it builds (the torch reference ops
otherwise, and always with --attention-backend torch), --dtype auto from the CPU's
instruction set, the worker's threads from the thread plan, all printed at start.
The C++ backend's steps give the reference backend's tokens and logits (fp32),
mixed steps of every kind included. (Token-exactness against transformers with
the C++ backend: tests/integration/test_worker_exactness.py, whose workers run
--attention-backend auto.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from kernels import cpu_ops
from svc_common.cpu_features import BUSY_STEP_TOKENS, CpuFeatures, thread_plan
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.worker_steps import Seq, sampled, step_input
from worker_svc.attention.backend import load_backend, resolve_backend
from worker_svc.config import WorkerConfig
from worker_svc.models.linear import Linear
from worker_svc.step.builder import StepBuilder
from worker_svc.step.input import StepInput
from worker_svc.worker import Worker
from worker_svc.worker import core as worker_mod

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels could not be built here")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def fake_cpu(*flags: str, cores: int = 2) -> CpuFeatures:
    return CpuFeatures(model="Test CPU", cores=cores, flags=frozenset({"avx2", "fma", *flags}))


def test_auto_picks_the_cpp_backend_where_it_builds(monkeypatch):
    monkeypatch.setattr(cpu_ops, "available", lambda: True)
    assert resolve_backend("auto", CPU) == "cpu"
    assert resolve_backend("torch", CPU) == "torch"  # the reference, forced
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    assert resolve_backend("auto", CPU) == "torch"
    assert load_backend("cpu").ops is cpu_ops and not load_backend("cpu").graph_safe


def run_steps(workers: dict[str, Worker]) -> None:
    """Two prefill steps (fresh prompts, a chunk over a cached context longer than the
    kernel's 16-row tile, a one-token chunk) and two decode steps, on scattered
    blocks: every worker samples the same tokens, logits within fp32 round-off."""
    info = next(iter(workers.values())).info
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, info.vocab_size, (n,), generator=g).tolist() for n in (40, 23, 57)]
    tables = {0: [9, 2, 30, 11, 17], 1: [5, 19, 0, 23, 8], 2: [4, 28, 13, 1, 26]}
    if info.kv_layout == "contiguous":  # one slot of block_size (= max_model_len) positions each
        tables = {0: [2], 1: [0], 2: [3]}

    def seq(i, tokens, start):
        bs = info.block_size
        slots = [tables[i][p // bs] * bs + p % bs for p in range(start, start + len(tokens))]
        return Seq(i, tokens, start, tables[i], slots, sample=True, return_logits=True)

    def compare(step_id: int, seqs: list[Seq]) -> dict[int, int]:
        outs = {name: w.step(step_input(step_id, [], seqs)) for name, w in workers.items()}
        ref = sampled(outs.pop("torch"))
        for out in outs.values():
            for want, got in zip(ref, sampled(out), strict=True):
                assert (got.seq_id, got.token_id) == (want.seq_id, want.token_id)
                torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        return {s.seq_id: s.token_id for s in ref}

    next_ids = compare(1, [seq(0, prompts[0], 0), seq(1, prompts[1][:1], 0), seq(2, prompts[2][:20], 0)])
    next_ids |= compare(2, [seq(1, prompts[1][1:], 1), seq(2, prompts[2][20:], 20)])
    lens = {0: 40, 1: 23, 2: 57}
    for step_id in (3, 4):
        next_ids = compare(step_id, [seq(i, [next_ids[i]], lens[i]) for i in lens])
        lens = {i: n + 1 for i, n in lens.items()}


@needs_kernels
@pytest.mark.parametrize(
    "family,kv_dtype,layout",
    [
        ("llama", "auto", "paged"),
        ("gemma3", "auto", "paged"),
        ("qwen3", "int8", "paged"),
        ("llama", "auto", "contiguous"),
    ],
    ids=["llama", "gemma3-window", "qwen3-int8", "llama-contiguous"],
)
def test_the_cpp_backend_serves_the_reference_tokens(family, kv_dtype, layout, restore_threads):
    model = str(tiny_checkpoint(family))
    extra = {"max_batch": 4, "max_model_len": 128} if layout == "contiguous" else {"num_blocks": 32}
    workers = {
        backend: Worker(
            WorkerConfig(
                model=model, dtype="float32", kv_dtype=kv_dtype, kv_layout=layout, attention_backend=backend, **extra
            )
        )
        for backend in ("torch", "auto")
    }
    assert workers["auto"].backend == "cpu" and workers["torch"].backend == "torch"
    run_steps(workers)


def test_without_the_kernels_auto_runs_the_reference(monkeypatch, restore_threads):
    """The eager fallback: where the C++ kernels cannot be built, auto serves with the
    torch reference ops (kernels/cpu_build.py has warned once), same tokens."""
    model = str(tiny_checkpoint("llama"))
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    fallback = Worker(WorkerConfig(model=model, dtype="float32", num_blocks=32))
    assert fallback.backend == "torch" and fallback.info.attention_backend == "torch"
    monkeypatch.undo()
    workers = {"torch": Worker(WorkerConfig(model=model, dtype="float32", num_blocks=32, attention_backend="torch"))}
    workers["fallback"] = fallback
    run_steps(workers)


@pytest.mark.parametrize(
    "flags,device,expected",
    [
        (("avx512f", "avx512_bf16"), "cpu", "bfloat16"),
        (("amx_bf16", "amx_tile"), "cpu", "bfloat16"),
        (("avx512f",), "cpu", "float32"),
        ((), "cpu", "float32"),
    ],
    ids=["avx512-bf16", "amx", "avx512-no-bf16", "avx2"],
)
def test_dtype_auto_follows_the_cpu(monkeypatch, flags, device, expected, restore_threads):
    monkeypatch.setattr(worker_mod, "read_cpu_features", lambda: fake_cpu(*flags))
    with capture_logs() as logs:
        worker = Worker(WorkerConfig(model=str(tiny_checkpoint("llama")), num_blocks=16))
    assert worker.dtype == expected and worker.info.dtype == expected
    assert worker.model.dtype == getattr(torch, expected)
    [started] = [e for e in logs if e["event"] == "worker compute"]
    assert started["dtype"] == expected and started["dtype_requested"] == "auto"
    assert started["cpu"] == fake_cpu(*flags).describe()
    assert started["attention_backend"] == worker.backend


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_threads_follow_the_plan_unless_given(monkeypatch, cores, restore_threads):
    monkeypatch.setattr(worker_mod, "read_cpu_features", lambda: fake_cpu(cores=cores))
    model = str(tiny_checkpoint("llama"))
    torch.set_num_threads(3)
    with capture_logs() as logs:
        Worker(WorkerConfig(model=model, dtype="float32", num_blocks=16))
    assert torch.get_num_threads() == thread_plan(cores).worker_threads == max(1, cores - 1)
    [started] = [e for e in logs if e["event"] == "worker compute"]
    assert started["threads"] == torch.get_num_threads() and started["threads_reason"] == thread_plan(cores).reason
    Worker(WorkerConfig(model=model, dtype="float32", num_blocks=16, num_threads=3))
    assert torch.get_num_threads() == 3


def test_each_step_takes_the_threads_its_size_asks(monkeypatch, restore_threads):
    """The plan on 2 cores: one thread for a decode, both for a prefill chunk of
    BUSY_STEP_TOKENS tokens, one again for the decode after; --num-threads fixes it."""
    monkeypatch.setattr(worker_mod, "read_cpu_features", lambda: fake_cpu(cores=2))
    model = str(tiny_checkpoint("llama"))
    worker = Worker(WorkerConfig(model=model, dtype="float32", num_blocks=16))
    seen = []
    monkeypatch.setattr(worker.runner, "execute", lambda step: seen.append(torch.get_num_threads()))
    prompt = list(range(10, 10 + BUSY_STEP_TOKENS))
    for step in (_one_row(1, prompt[:1], 0), _one_row(2, prompt, 0), _one_row(3, prompt[:1], 0)):
        worker.execute(step)
    assert seen == [1, 2, 1]
    fixed = Worker(WorkerConfig(model=model, dtype="float32", num_blocks=16, num_threads=1))
    monkeypatch.setattr(fixed.runner, "execute", lambda step: seen.append(torch.get_num_threads()))
    fixed.execute(_one_row(4, prompt, 0))
    assert seen[-1] == 1


def _one_row(step_id: int, tokens: list[int], start: int) -> StepInput:
    builder = StepBuilder(16)
    builder.add(0, tokens, start, [0, 1], sample=True)
    return builder.build(step_id)


def test_bfloat16_loads_where_onednn_cannot_reorder_it(restore_threads):
    """oneDNN's bf16 weight reorder needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT and raised at
    load on an AVX2-only CPU (issue 38 item 4): there the bf16 weights stay plain (torch's
    own bf16 matmul), elsewhere they are packed; both multiply as F.linear does, and a
    --dtype bfloat16 --enforce-eager worker (the path that packs them) loads and steps."""
    weight, x = torch.randn(48, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    linear = Linear(weight)
    assert linear.packed == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    torch.testing.assert_close(linear(x), F.linear(x, weight))
    worker = Worker(
        WorkerConfig(model=str(tiny_checkpoint("llama")), dtype="bfloat16", enforce_eager=True, num_blocks=32)
    )
    bs, blocks, prompt = worker.info.block_size, [3, 7], list(range(5, 25))
    slots = [blocks[p // bs] * bs + p % bs for p in range(len(prompt))]
    seq = Seq(0, prompt, 0, blocks, slots, sample=True)
    (token,) = sampled(worker.step(step_input(1, [], [seq])))
    assert 0 <= token.token_id < worker.info.vocab_size
