"""The CPU op set: the reference ops' signatures, with attention read from the blocks
in place by the C++ kernel (kernels/csrc/paged_attention_cpu.cpp) instead of a
gather of every sequence's whole context.

A drop-in for kernels.reference wherever the worker picks an op module (like
kernels.triton_ops on CUDA): the attention ops of both layouts go to the kernel (a
contiguous slot is one block of max_seq_len tokens), the other ops are the
reference's. Where the kernel cannot be built (kernels/cpu_build.py warns once), or
for tensors off the CPU, every op is the reference's. The reference stays the
oracle: tests/unit/test_cpu_ops.py compares the two for every cache dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import cpu_build, reference
from kernels.quant import KVScales
from kernels.reference import copy_blocks, write_kv

__all__ = [
    "available",
    "contiguous_decode_attention",
    "contiguous_prefill_attention",
    "copy_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]


def available() -> bool:
    """Whether the compiled kernel serves (built on first call, then cached)."""
    return cpu_build.load()


def _kernel_takes(query: Tensor) -> bool:
    return query.device.type == "cpu" and available()


def _int32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _scale_args(scales: KVScales | None) -> tuple[Tensor | None, ...]:
    """The kernel's four optional scale arguments (k/v scales, k/v zero points)."""
    if scales is None:
        return (None, None, None, None)
    return (scales.k_scale, scales.v_scale, scales.k_zero, scales.v_zero)


def _attend(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_query_lens: Tensor | None,
    context_lens: Tensor,
    scale: float,
    sliding_window: int,
    scales: KVScales | None,
) -> Tensor:
    if query.stride(-1) != 1:
        query = query.contiguous()
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 else _int32(block_tables)
    out: Tensor = torch.ops.pagedserve_cpu.paged_attention(
        query,
        k_cache,
        v_cache,
        tables,
        None if cu_query_lens is None else _int32(cu_query_lens),
        _int32(context_lens),
        float(scale),
        int(sliding_window),
        *_scale_args(scales),
    )
    return out


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
) -> Tensor:
    """reference.paged_decode_attention, reading the blocks in place."""
    if not _kernel_takes(query):
        return reference.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
            scales=scales,
        )  # fmt: skip
    return _attend(query, k_cache, v_cache, block_tables, None, context_lens, scale, sliding_window, scales)


def paged_prefill_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_query_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
) -> Tensor:
    """reference.paged_prefill_attention, reading the blocks in place."""
    if not _kernel_takes(query):
        return reference.paged_prefill_attention(
            query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, sliding_window,
            scales=scales,
        )  # fmt: skip
    return _attend(query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, sliding_window, scales)


def contiguous_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
) -> Tensor:
    """reference.contiguous_decode_attention: each slot is one block of max_seq_len tokens."""
    return paged_decode_attention(
        query, k_cache, v_cache, slots[:, None], context_lens, scale, sliding_window,
        scales=scales,
    ) if _kernel_takes(query) else reference.contiguous_decode_attention(
        query, k_cache, v_cache, slots, context_lens, scale, sliding_window,
        scales=scales,
    )  # fmt: skip


def contiguous_prefill_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    cu_query_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
) -> Tensor:
    """reference.contiguous_prefill_attention: each slot is one block of max_seq_len tokens."""
    return paged_prefill_attention(
        query, k_cache, v_cache, slots[:, None], cu_query_lens, context_lens, scale, sliding_window,
        scales=scales,
    ) if _kernel_takes(query) else reference.contiguous_prefill_attention(
        query, k_cache, v_cache, slots, cu_query_lens, context_lens, scale, sliding_window,
        scales=scales,
    )  # fmt: skip
