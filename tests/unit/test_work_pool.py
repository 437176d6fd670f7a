"""The work pool of the weight-streaming kernels (kernels/csrc/work_pool.h): with it on,
every kernel returns the bits it returns on one thread (each output is computed by one
thread, as before), for every GGUF format, int8 activations, the packed fp32/bf16
linear, the INT4/INT8/FP8 kernels, the decode attention and the C++ layer loop; the helpers really take
chunks (the chunks are made tiny so that small weights are cut into many); the pool
stays out of the way where torch runs a team of threads; an idle helper is parked, not
spinning; a forked child and a process's exit are clean."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kernels import cpu_ops, quant_cpu_ops, wquant_cpu
from kernels.gguf_quant import BLOCK_FORMATS
from tests.helpers.attention_caches import make_cache
from tests.helpers.gguf_blocks import random_blocks
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.worker_steps import Seq, sampled, step_input
from tests.helpers.wquant_weights import WEIGHTS
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels are not built here")

REPO = Path(__file__).resolve().parents[2]
TINY_CHUNK = 64  # weights per chunk: a few output rows of a test's weights


@pytest.fixture
def pool() -> Iterator[None]:
    """One torch thread (where the pool serves), tiny chunks; restored after."""
    if cpu_ops.work_pool_info().helpers == 0:
        pytest.skip("one core: the pool has no helper")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    chunk = cpu_ops.work_pool_chunk(TINY_CHUNK)
    was = cpu_ops.use_work_pool(True)
    yield
    cpu_ops.use_work_pool(was)
    cpu_ops.work_pool_chunk(chunk)
    torch.set_num_threads(threads)


def pooled_and_alone(call: Callable[[], torch.Tensor], seconds: float = 10.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The call with the pool off, then on until a helper took a chunk of it: a parked
    helper wakes after the first calls are over (tens of us, longer on a loaded
    machine), then spins and takes chunks of the next."""
    cpu_ops.use_work_pool(False)
    alone = call()
    cpu_ops.use_work_pool(True)
    calls, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = cpu_ops.work_pool_info().helper_chunks
        pooled = call()
        calls += 1
        assert torch.equal(pooled, alone)
        if cpu_ops.work_pool_info().helper_chunks > before:
            return pooled, alone
    raise AssertionError(f"no helper took a chunk in {calls} calls ({seconds} s)")


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 40])  # the decode tiles, the batch tiles
def test_pooled_gguf_kernels_return_the_single_thread_bits(pool, qtype, rows):
    k = 2 * BLOCK_FORMATS[qtype][0]
    weight = random_blocks(qtype, out_features=203, in_features=k, seed=rows)  # 203: a partial group at the end
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    pooled_and_alone(lambda: quant_cpu_ops.quant_linear(x, weight))
    pooled_and_alone(lambda: quant_cpu_ops.quant_linear(x.bfloat16(), weight))
    pooled_and_alone(lambda: quant_cpu_ops.quant_linear_int8(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["", "silu"])
@pytest.mark.parametrize("rows", [1, 5])
def test_pooled_packed_linear_returns_the_single_thread_bits(pool, dtype, activation, rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(2 * 300 if activation else 300, 96, generator=g).to(dtype)
    packed = cpu_ops.pack_linear(weight, gated=bool(activation))
    x = torch.randn(rows, 96, generator=g).to(dtype)
    pooled_and_alone(lambda: cpu_ops.linear(x, packed, 300, 96, activation))


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_pooled_wquant_kernels_return_the_single_thread_bits(pool, name):
    weight = WEIGHTS[name]()
    if not wquant_cpu.takes(weight):
        pytest.skip("not a format the C++ kernel takes")
    x = torch.randn(2, weight.in_features, generator=torch.Generator().manual_seed(5))
    pooled_and_alone(lambda: wquant_cpu.wquant_linear(x, weight))


@pytest.mark.parametrize("seqs", [1, 3])
def test_pooled_decode_attention_returns_the_single_thread_bits(pool, seqs):
    """One item per KV head and sequence, each attended by one thread."""
    k_cache, v_cache, _ = make_cache(16, 3, 64, torch.float32, block_size=16)
    tables = torch.randperm(16, generator=torch.Generator().manual_seed(seqs))[: 4 * seqs].view(seqs, 4).int()
    context_lens = torch.tensor([50, 17, 64][:seqs], dtype=torch.int32)
    query = torch.randn(seqs, 9, 64, generator=torch.Generator().manual_seed(seqs))
    pooled_and_alone(lambda: cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.3))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K"])
def test_the_layer_loop_pooled_returns_the_single_thread_bits(pool, tmp_path, qtype, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_LAYER_LOOP", "1")
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, seed=3)
    w = Worker(WorkerConfig(model=str(path), dtype="float32", num_blocks=8, block_size=16, num_threads=1))
    assert w.model.layer_loop is not None

    def steps() -> torch.Tensor:
        prompt = Seq(0, [5, 17, 99, 3, 250, 42, 8], 0, [0], list(range(7)), sample=True, return_logits=True)
        logits = [sampled(w.step(step_input(1, [], [prompt])))[0].logits]
        for i, token in enumerate([7, 8, 9]):
            decode = Seq(0, [token], 7 + i, [0], [7 + i], sample=True, return_logits=True)
            logits.append(sampled(w.step(step_input(2 + i, [], [decode])))[0].logits)
        return torch.stack(logits)  # type: ignore[arg-type]

    pooled_and_alone(steps)


def test_a_torch_team_keeps_the_static_split(pool):
    """Where torch runs more than one thread (the thread plan's big steps), its team owns
    the cores: the pool's helpers take nothing."""
    weight = random_blocks("Q4_1", out_features=512, in_features=64, seed=1)
    x = torch.randn(1, 64)
    torch.set_num_threads(2)
    before = cpu_ops.work_pool_info().helper_chunks
    for _ in range(20):
        quant_cpu_ops.quant_linear(x, weight)
    assert cpu_ops.work_pool_info().helper_chunks == before


def helper_cpu_ticks() -> int:
    """utime + stime of this process's pool helpers (named ps-work-pool)."""
    ticks = 0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "ps-work-pool":
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that just ended
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return ticks


def test_an_idle_helper_is_parked_not_spinning(pool):
    weight = random_blocks("Q4_1", out_features=512, in_features=64, seed=2)
    x = torch.randn(1, 64)
    pooled_and_alone(lambda: quant_cpu_ops.quant_linear(x, weight))
    assert cpu_ops.work_pool_info().running >= 1
    time.sleep(0.2)  # past its spin (5 ms by default)
    before = helper_cpu_ticks()
    time.sleep(1.0)
    # A spinning helper would burn ~100 ticks a second; a parked one none (1: a tick's edge).
    assert helper_cpu_ticks() - before <= 1


CHILD = """
import os, sys, time, torch
from kernels import cpu_ops, quant_cpu_ops
from tests.helpers.gguf_blocks import random_blocks

assert cpu_ops.available()
torch.set_num_threads(1)
cpu_ops.work_pool_chunk(64)
weight = random_blocks("Q4_1", out_features=1024, in_features=256, seed=7)
x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1))
cpu_ops.use_work_pool(False)
alone = quant_cpu_ops.quant_linear(x, weight)
cpu_ops.use_work_pool(True)

def pooled_equal() -> bool:
    # by time, not calls: on a loaded machine a parked helper wakes late, and after a long
    # wait for it the pool goes alone for up to a second
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        before = cpu_ops.work_pool_info().helper_chunks
        if not torch.equal(quant_cpu_ops.quant_linear(x, weight), alone):
            return False
        if cpu_ops.work_pool_info().helper_chunks > before:
            return True
    return False

assert pooled_equal(), "the parent's pool"
if sys.argv[1] == "fork":
    pid = os.fork()
    if pid == 0:
        # The parent's helpers are not here: the child starts its own at its first call.
        ok = pooled_equal() and cpu_ops.work_pool_info().running >= 1
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert pooled_equal(), "the parent's pool after the fork"
print("ok", flush=True)
"""


@pytest.mark.parametrize("mode", ["exit", "fork"])
def test_a_process_with_the_pool_forks_and_exits_cleanly(mode):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), mode],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
