"""Sizing the KV pool from device memory (issue 27, fault 3; runner/memory.py):
the arithmetic, and that the profile runs what the worst step runs (a prefill of
--max-num-batched-tokens tokens, a sampling step of --max-num-seqs rows, a decode
of --max-num-seqs rows for the graphs), read through a fake device memory."""

from __future__ import annotations

import pytest

from tests.helpers.checkpoints import tiny_checkpoint
from worker_svc.config import WorkerConfig
from worker_svc.runner.memory import MB, KVPoolPlan, MemoryBaseline, kv_pool_bytes, plan_kv_pool, prefill_profile_step
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.sampling.sampler import Sampler
from worker_svc.worker import CPU_KV_CACHE_MB, Worker

GB = 2**30


def test_the_pool_gets_what_utilization_leaves():
    # 80 GB at 0.9 = 72 GB: weights 2.5, activations 6, graphs 0.5, outside torch 1 -> 62 GB.
    args = dict(total=80 * GB, utilization=0.9, weights=5 * GB // 2, activations=6 * GB, graphs=GB // 2)
    assert kv_pool_bytes(**args, outside_torch=GB, free=76 * GB) == 62 * GB
    # Another process holds 30 GB: only what is free beside the steps' activations and graphs.
    assert kv_pool_bytes(**args, outside_torch=GB, free=46 * GB) == 46 * GB - 6 * GB - GB // 2
    # --kv-cache-memory-mb caps it; nothing left gives 0, never a negative pool.
    assert kv_pool_bytes(**args, outside_torch=GB, free=76 * GB, requested=4 * GB) == 4 * GB
    assert kv_pool_bytes(**args, outside_torch=GB, free=5 * GB) == 0
    assert kv_pool_bytes(80 * GB, 0.1, 5 * GB // 2, 6 * GB, GB // 2, GB, 76 * GB) == 0


class FakeMemory:
    """A device whose allocator's peak over each profiled run is scripted (bytes
    above what was allocated before it), in the order the runs come."""

    def __init__(self, peaks: list[int]):
        self.peaks = list(peaks)
        self.current = 0
        self.resets = 0

    def info(self):
        return 70 * GB, 80 * GB  # free, total, after the profile

    def allocated(self):
        return 3 * GB  # the weights

    def reserved(self):
        return 4 * GB

    def reset_peak(self):
        self.resets += 1
        self.current = self.peaks.pop(0) if self.peaks else 0

    def peak(self):
        return self.allocated() + self.current


@pytest.fixture(scope="module")
def scratch() -> ModelRunner:
    worker = Worker(WorkerConfig(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=1))
    return ModelRunner(worker.model, worker.cache, Sampler(0))


def test_the_profile_runs_the_largest_step_and_the_widest_sampling(scratch, monkeypatch):
    forwards: list[int] = []
    sampled: list[int] = []
    real_forward, real_sample = scratch.forward, Sampler.sample_packed
    monkeypatch.setattr(
        scratch, "forward", lambda batch: forwards.append(batch.input_ids.numel()) or real_forward(batch)
    )
    monkeypatch.setattr(
        Sampler,
        "sample_packed",
        lambda self, logits, params: sampled.append(logits.shape[0]) or real_sample(self, logits, params),
    )
    memory = FakeMemory([6 * GB, 2 * GB, GB])  # prefill, sampling, graphs' decode
    baseline = MemoryBaseline(used=GB, reserved=0)  # the context, before loading
    plan = plan_kv_pool(scratch, memory, baseline, 0.9, 0, 1000, 24, 300, graphs_table_width=8)
    # The prefill: 1000 tokens in sequences of at most max_model_len (300); the sampling
    # step: 24 rows; the graphs' decode: 24 rows.
    assert forwards == [1000, 24] and sampled == [24]
    assert (plan.prefill_peak, plan.sampler_peak, plan.graphs) == (6 * GB, 2 * GB, GB)
    # Used now 10 GB, 1 GB before; torch holds 4 GB of it: 5 GB outside torch.
    assert plan.outside_torch == 5 * GB and plan.weights == 3 * GB
    assert plan.kv_cache == int(80 * GB * 0.9) - (3 + 6 + 1 + 5) * GB
    assert plan.bound == "--gpu-memory-utilization"
    fields = plan.log_fields()
    assert fields["kv_cache_mb"] == plan.kv_cache // MB and fields["sized_by"] == "--gpu-memory-utilization"
    without_graphs = plan_kv_pool(scratch, FakeMemory([6 * GB, 2 * GB]), baseline, 0.9, 8 * GB, 1000, 24, 300, None)
    assert without_graphs.graphs == 0 and without_graphs.kv_cache == 8 * GB
    assert without_graphs.bound == "--kv-cache-memory-mb"


def test_the_profile_prefill_is_as_large_as_a_step_may_be():
    step = prefill_profile_step(8192, 3000, 16, 500)
    assert step.seqs.num_tokens.tolist() == [3000, 3000, 2192]
    assert (step.seqs.slot_mapping == -1).all() and (step.seqs.block_tables == 0).all()
    assert step.seqs.table_lens.tolist() == [188, 188, 137] and step.seqs.sample.all()


def test_a_cpu_worker_keeps_its_512_mb_default():
    worker = Worker(WorkerConfig(model=str(tiny_checkpoint("llama")), dtype="float32"))
    assert worker.info.num_blocks == CPU_KV_CACHE_MB * MB // worker.info.kv_bytes_per_block
    sized = Worker(WorkerConfig(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory_mb=3))
    assert sized.info.num_blocks == 3 * MB // sized.info.kv_bytes_per_block


@pytest.mark.parametrize(
    "flag,value",
    [
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("max_num_batched_tokens", 0),
        ("kv_cache_memory_mb", -1),
    ],
)
def test_memory_flags_are_validated(flag, value):
    with pytest.raises(ValueError, match="--" + flag.replace("_", "-")):
        WorkerConfig(model=str(tiny_checkpoint("llama")), **{flag: value}).validate()


def test_the_plan_names_what_sized_the_pool():
    plan = KVPoolPlan(80 * GB, 0.9, 3 * GB, 6 * GB, 2 * GB, GB, GB, 10 * GB, 0, 3 * GB)
    assert plan.bound == "free device memory" and plan.activations == 6 * GB
