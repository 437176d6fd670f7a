"""The CPU op set: the reference ops' signatures, run by the C++ kernels in
kernels/csrc/ (built once per CPU by kernels/cpu_build.py):

* attention read from the blocks in place (paged_attention_cpu.cpp) instead of a
  gather of every sequence's whole context, for both layouts (a contiguous slot is
  one block of max_seq_len tokens);
* the fused element-wise ops of a decoder layer (elementwise_cpu.cpp):
  ``add_rms_norm`` and ``rope_write_kv`` (an unquantized cache; a quantized one takes
  the reference's write, which quantizes);
* and, outside the reference's op set, the linear layers the CPU decoder streams its
  weights through (linear_cpu.cpp): ``pack_linear`` once at load, ``linear`` per call;
  and the mixture-of-experts op over the selected experts only (moe_cpu.cpp):
  ``pack_experts`` once at load, ``fused_moe`` (kernels/moe_reference.py's) per call;
  and the batched LoRA op, grouped by adapter slot (lora_cpu.cpp): ``lora``
  (kernels/lora_reference.py's); and a sampled row's argmax and log-sum-exp in one read
  of its logits (sampling_cpu.cpp): ``argmax_logsumexp``;
* the work pool those weight-streaming kernels share at small steps
  (kernels/csrc/work_pool.h): ``work_pool_info``, ``use_work_pool``,
  ``work_pool_chunk`` (tests and benchmarks switch it; the worker leaves it on); and
  their software prefetch of the weight rows ahead (kernels/csrc/weight_prefetch.h):
  ``use_weight_prefetch`` (likewise).

A drop-in for kernels.reference wherever the worker picks an op module (like
kernels.triton on CUDA); write_kv and copy_blocks are the reference's. Where the
kernels cannot be built (kernels/cpu_build.py warns once), or for tensors off the
CPU, every op is the reference's. The reference stays the oracle:
tests/unit/test_cpu_ops.py compares the two for every cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import cpu_build, lora_reference, reference
from kernels.quant import KVScales
from kernels.reference import copy_blocks, write_kv

__all__ = [
    "add_rms_norm",
    "available",
    "contiguous_decode_attention",
    "contiguous_prefill_attention",
    "copy_blocks",
    "fused_moe",
    "gated_act",
    "linear",
    "lora",
    "pack_experts",
    "pack_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rope_write_kv",
    "use_weight_prefetch",
    "use_work_pool",
    "work_pool_chunk",
    "work_pool_info",
    "write_kv",
]

# What the element-wise and linear kernels take (the attention kernel also takes fp16).
_ELEMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LINEAR_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether the compiled kernel serves (built on first call, then cached)."""
    return cpu_build.load()


def _kernel_takes(query: Tensor) -> bool:
    return query.is_cpu and available()  # is_cpu: .device builds a torch.device per call


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
    softcap: float,
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
        float(softcap),
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
    softcap: float = 0.0,
) -> Tensor:
    """reference.paged_decode_attention, reading the blocks in place."""
    if not _kernel_takes(query):
        return reference.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
            scales=scales, softcap=softcap,
        )  # fmt: skip
    return _attend(query, k_cache, v_cache, block_tables, None, context_lens, scale, sliding_window, scales, softcap)


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
    softcap: float = 0.0,
) -> Tensor:
    """reference.paged_prefill_attention, reading the blocks in place."""
    if not _kernel_takes(query):
        return reference.paged_prefill_attention(
            query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, sliding_window,
            scales=scales, softcap=softcap,
        )  # fmt: skip
    return _attend(
        query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, sliding_window, scales, softcap
    )


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
    softcap: float = 0.0,
) -> Tensor:
    """reference.contiguous_decode_attention: each slot is one block of max_seq_len tokens."""
    return paged_decode_attention(
        query, k_cache, v_cache, slots[:, None], context_lens, scale, sliding_window,
        scales=scales, softcap=softcap,
    ) if _kernel_takes(query) else reference.contiguous_decode_attention(
        query, k_cache, v_cache, slots, context_lens, scale, sliding_window,
        scales=scales, softcap=softcap,
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
    softcap: float = 0.0,
) -> Tensor:
    """reference.contiguous_prefill_attention: each slot is one block of max_seq_len tokens."""
    return paged_prefill_attention(
        query, k_cache, v_cache, slots[:, None], cu_query_lens, context_lens, scale, sliding_window,
        scales=scales, softcap=softcap,
    ) if _kernel_takes(query) else reference.contiguous_prefill_attention(
        query, k_cache, v_cache, slots, cu_query_lens, context_lens, scale, sliding_window,
        scales=scales, softcap=softcap,
    )  # fmt: skip


def fp32(t: Tensor) -> Tensor:
    """t as contiguous fp32. Checked first: .float() and .contiguous() are dispatched ops
    even where they return t, host time of every layer of every step."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def _dense(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """reference.add_rms_norm in one pass per row."""
    if not _kernel_takes(x) or x.dtype not in _ELEMENT_DTYPES or x.stride(-1) != 1:
        return reference.add_rms_norm(x, residual, weight, eps)
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    normed, summed = torch.ops.pagedserve_cpu.add_rms_norm(x, residual, fp32(weight), float(eps))
    return normed, summed


def gated_act(y: Tensor, activation: str) -> Tensor:
    """reference.gated_act in one pass per row (fp32 and bf16)."""
    if not _kernel_takes(y) or y.dtype not in LINEAR_DTYPES or y.dim() != 2 or y.stride(-1) != 1:
        return reference.gated_act(y, activation)
    out: Tensor = torch.ops.pagedserve_cpu.gated_act(y, activation)
    return out


def rope_write_kv(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    scales: KVScales | None = None,
) -> tuple[Tensor, Tensor]:
    """reference.rope_write_kv in one pass over the step's rows (unquantized caches;
    a quantized cache is written by the reference's write_kv, which quantizes)."""
    plain = scales is None and k_cache.dtype in _ELEMENT_DTYPES
    strided = query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    if not (_kernel_takes(query) and plain and strided and query.dtype in _ELEMENT_DTYPES):
        return reference.rope_write_kv(
            query, key, value, cos, sin, k_cache, v_cache, slot_mapping, scales=scales
        )  # fmt: skip
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    q, k = torch.ops.pagedserve_cpu.rope_write_kv(
        query, key, value, _dense(cos), _dense(sin), k_cache, v_cache, _dense(slots)
    )
    return q, k


def pack_linear(weight: Tensor, gated: bool = False) -> Tensor:
    """The weight [out, in] (fp32 or bf16; gated: [gate; up] rows) in the layout
    `linear` streams: a 1-D tensor of its own, made once at load."""
    packed: Tensor = torch.ops.pagedserve_cpu.pack_linear(weight.contiguous(), gated)
    return packed


def linear(x: Tensor, packed: Tensor, out_features: int, in_features: int, activation: str = "") -> Tensor:
    """x [M, in] @ W.T -> [M, out] over `pack_linear(W)`; with `activation` ("silu",
    "gelu_tanh") over `pack_linear(W, gated=True)`: act(x @ gate.T) * (x @ up.T),
    [M, out] for out gate columns. fp32 sums in k order, rounded once to x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y: Tensor = torch.ops.pagedserve_cpu.linear(x, packed, out_features, in_features, activation)
    return y


def pack_experts(weights: Tensor, gated: bool) -> Tensor:
    """Every expert's [N, K] weight of `weights` [E, N, K] packed as `pack_linear`
    does: [E, packed] (gated: each expert's [gate; up] rows)."""
    return torch.stack([pack_linear(w, gated) for w in weights])


def fused_moe(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str = "silu",
    intermediate_size: int | None = None,
) -> Tensor:
    """moe_reference.fused_moe over `pack_experts` weights (w_gate_up gated), computing
    only the selected experts; intermediate_size is required (the packed rows do not
    say it)."""
    assert intermediate_size is not None, "the packed experts need intermediate_size"
    y: Tensor = torch.ops.pagedserve_cpu.fused_moe(
        x, topk_ids, topk_weights, w_gate_up, w_down, intermediate_size, activation
    )
    return y


def lora(x: Tensor, a: Tensor, b: Tensor, slots: Tensor) -> Tensor:
    """lora_reference.lora, grouped by slot in C++ (fp32 or bf16; the reference elsewhere)."""
    if x.device.type != "cpu" or x.dtype not in LINEAR_DTYPES or not available():
        return lora_reference.lora(x, a, b, slots)
    y: Tensor = torch.ops.pagedserve_cpu.lora(x, a, b, slots)
    return y


def argmax_logsumexp(logits: Tensor) -> tuple[Tensor, Tensor]:
    """reference.argmax_logsumexp in one read of the logits (csrc/sampling_cpu.cpp)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.shape[1] or not _kernel_takes(logits):
        return reference.argmax_logsumexp(logits)
    index, lse = torch.ops.pagedserve_cpu.argmax_logsumexp(logits if logits.stride(1) == 1 else logits.contiguous())
    return index, lse


@dataclass(frozen=True)
class WorkPoolInfo:
    helpers: int  # threads beside the caller: the cores this process may use, but one (capped)
    enabled: bool  # PAGEDSERVE_WORK_POOL=0 at start, or use_work_pool(False), turn it off
    running: int  # helpers started (at the first pooled call)
    helper_chunks: int  # chunks the helpers have run, ever: how much of the work they took
    backoffs: int  # times a caller waited long for a descheduled helper and went alone for a while


def work_pool_info() -> WorkPoolInfo:
    helpers, enabled, running, chunks, backoffs = torch.ops.pagedserve_cpu.work_pool_info()
    return WorkPoolInfo(helpers, bool(enabled), running, chunks, backoffs)


def use_work_pool(on: bool) -> bool:
    """Turns the pool on or off for this process; whether it was on."""
    was: bool = torch.ops.pagedserve_cpu.work_pool_enable(on)
    return was


def use_weight_prefetch(on: bool) -> bool:
    """Turns the weight-streaming kernels' software prefetch (csrc/weight_prefetch.h) on or
    off for this process; whether it was on. Results are the same bits either way."""
    was: bool = torch.ops.pagedserve_cpu.weight_prefetch_enable(on)
    return was


def work_pool_chunk(weights: int) -> int:
    """Sets the weights per chunk (0: leaves it); the previous value."""
    previous: int = torch.ops.pagedserve_cpu.work_pool_chunk(weights)
    return previous
