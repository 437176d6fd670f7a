"""The batched LoRA op (kernels/lora_reference.py, the oracle) and its kernels: the
C++ CPU op (kernels/cpu_ops.py, lora_cpu.cpp) and Triton (kernels/triton/lora.py:
under TRITON_INTERPRET=1 without a GPU, on the GPU in `make gpu-check`), for fp32
and bf16, a mix of slots with the base's slot 0 among them, adapters of lower rank
than the padding, and batches of one slot and of none."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import cpu_ops, lora_reference
from kernels.triton.common import interpreter_enabled

TRITON_DEVICE = torch.device("cpu" if interpreter_enabled() else "cuda")

# bf16: a shrink rounded one way or the other moves an output by an ulp (2^-7 relative)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2)}
IN, OUT, RANK, SLOTS = 72, 100, 24, 5  # none a multiple of the kernels' blocks


def problem(slots: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), IN, generator=g).to(dtype)
    a = torch.randn(SLOTS, RANK, IN, generator=g) * IN**-0.5
    b = torch.randn(SLOTS, OUT, RANK, generator=g) * RANK**-0.5
    a[0], b[0] = 0, 0  # the base
    a[2, 5:], b[2, :, 5:] = 0, 0  # an adapter of rank 5, padded
    return x, a.to(dtype), b.to(dtype), torch.tensor(slots, dtype=torch.int64)


def per_token(x, a, b, slots):
    """Each token through its own slot's matrices, one at a time: an independent
    oracle for the reference's grouping by slot."""
    rows = [(x[t : t + 1] @ a[s].T) @ b[s].T for t, s in enumerate(slots.tolist())]
    return torch.cat(rows) if rows else x.new_zeros(0, b.shape[1])


def backends():
    from kernels.triton import lora as triton_lora

    def on_triton_device(*args: torch.Tensor) -> torch.Tensor:
        return triton_lora.lora(*(t.to(TRITON_DEVICE) for t in args)).cpu()

    ops = {"triton": on_triton_device}
    if cpu_ops.available():
        ops["cpu"] = cpu_ops.lora
    return ops


MIXES = {"mixed": [0, 3, 1, 1, 4, 0, 2, 3, 1], "one slot": [2, 2, 2], "base only": [0, 0], "none": []}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_the_reference_is_each_token_through_its_slot(dtype, mix):
    x, a, b, slots = problem(MIXES[mix], dtype)
    got = lora_reference.lora(x, a, b, slots)
    assert got.dtype == dtype and got.shape == (len(slots), OUT)
    torch.testing.assert_close(got, per_token(x, a, b, slots), **TOL[dtype])
    assert not got[slots == 0].any()  # the base adds exact zeros


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_each_backend_matches_the_reference(backend, dtype, mix):
    op = backends().get(backend)
    if op is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    x, a, b, slots = problem(MIXES[mix], dtype, seed=1)
    want = lora_reference.lora(x, a, b, slots)
    got = op(x, a, b, slots)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert not got[slots == 0].any()


def test_the_cpp_op_refuses_a_slot_out_of_range():
    if not cpu_ops.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    x, a, b, _ = problem([1], torch.float32)
    with pytest.raises(RuntimeError, match="slot 5 out of range"):
        cpu_ops.lora(x, a, b, torch.tensor([5]))
