"""The worker's second KV tier (worker_svc/kv_offload.py): whole blocks, values and
scales, copied down and up in the Step's order (offloads, then onloads), a
file-backed pool that leaves no file behind, and the step checks on tier copies."""

import numpy as np
import pytest
import torch

from worker_svc.attention.kv_cache import PagedKVCache
from worker_svc.kv_offload import OffloadPool
from worker_svc.step.errors import InvalidStep
from worker_svc.step.input import SeqColumns, StepInput, TierCopies
from worker_svc.step.validation import Limits, validate


def pairs(*copies):
    return np.array(copies, dtype=np.int64).reshape(-1, 2)


def filled_cache(dtype):
    cache = PagedKVCache(2, 4, 2, 8, 16, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for tensor in cache.tensors:
        tensor.copy_((torch.randn(tensor.shape, generator=generator) * 20).to(tensor.dtype))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8-with-scales"])
def test_blocks_go_down_and_come_back_whole(tmp_path, dtype):
    cache = filled_cache(dtype)
    assert len(cache.tensors) == (6 if dtype == torch.int8 else 2)  # K and V scales and zero points travel too
    pool = OffloadPool(cache.tensors, 3, str(tmp_path))
    assert pool.medium == "DISK" and list(tmp_path.iterdir()) == []  # mapped, then unlinked
    original = [t.clone() for t in cache.tensors]
    timings = pool.run(TierCopies(offloads=pairs((1, 0), (3, 2))))
    assert set(timings) == {"offload_ms"}
    for tensor in cache.tensors:
        tensor.zero_()
    pool.run(TierCopies(onloads=pairs((2, 0), (0, 3))))
    for before, after in zip(original, cache.tensors):
        assert torch.equal(after[:, 0], before[:, 3]) and torch.equal(after[:, 3], before[:, 1])
        assert not after[:, 1].any() and not after[:, 2].any()  # untouched


def test_an_onload_reads_what_the_same_steps_offload_wrote(tmp_path):
    cache = filled_cache(torch.float32)
    block1 = [t[:, 1].clone() for t in cache.tensors]
    pool = OffloadPool(cache.tensors, 2, str(tmp_path))
    # Offloads first: tier-2 block 0 takes tier-1 block 1 before block 1 is overwritten by the onload.
    pool.run(TierCopies(offloads=pairs((1, 0)), onloads=pairs((0, 2), (0, 1))))
    for want, tensor in zip(block1, cache.tensors):
        assert torch.equal(tensor[:, 2], want) and torch.equal(tensor[:, 1], want)


def step_with(tiers):
    return StepInput(0, pairs(), SeqColumns.empty(), tiers=tiers)


@pytest.mark.parametrize(
    ("tiers", "field"),
    [
        (TierCopies(offloads=pairs((4, 0))), "offloads[0].src"),
        (TierCopies(offloads=pairs((0, 3))), "offloads[0].dst"),
        (TierCopies(onloads=pairs((0, 0), (-1, 1))), "onloads[1].src"),
        (TierCopies(onloads=pairs((0, 4))), "onloads[0].dst"),
        (TierCopies(onloads=pairs((0, 1), (2, 1))), "onloads"),
    ],
)
def test_tier_copies_are_checked_by_name(tiers, field):
    with pytest.raises(InvalidStep) as err:
        validate(step_with(tiers), Limits(100, 4, 8, 64, num_offload_blocks=3))
    assert err.value.field == field


def test_a_worker_without_a_second_tier_refuses_tier_copies():
    with pytest.raises(InvalidStep, match="no second KV tier"):
        validate(step_with(TierCopies(onloads=pairs((0, 1)))), Limits(100, 4, 8, 64))
    validate(step_with(TierCopies(offloads=pairs((0, 1)))), Limits(100, 4, 8, 64, num_offload_blocks=2))
