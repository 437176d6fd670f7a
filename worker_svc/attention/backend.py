"""The attention backends: one typed set of ops (`AttentionOps`) over the cache
layouts, and the registry --attention-backend picks from.

`torch` is kernels/reference.py (pure torch: the test oracle, and the forced
fallback); `triton` is kernels/triton/ (compiled on CUDA, or under
TRITON_INTERPRET=1 in tests); `cpu` is kernels/cpu_ops.py (the C++ paged
attention that reads K/V blocks in place, built once per CPU by
kernels/cpu_build.py): three modules with the same signatures, each an
`AttentionOps`. The caches (kv_cache.py) bind one backend's ops at
construction and pick which of them reads their layout; nothing else calls the
ops. A new backend is one more module or object with these six functions,
registered in `BACKENDS`, and tested against kernels/reference.py as the Triton
and C++ kernels are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kernels import reference
from kernels.quant import KVScales

Scales = KVScales | None  # a quantized cache's scales, one layer's (all layers' for copy_blocks)


class WriteKV(Protocol):
    """Store key/value [T, kv_heads, d] at their slots (< 0: skipped); a quantized
    cache quantizes each token and stores its scales beside it."""

    def __call__(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, /, *, scales: Scales
    ) -> None: ...


class RopeWriteKV(Protocol):
    """RoPE on query [T, q_heads, d] and key [T, kv_heads, d] (cos/sin [T, d]), then
    WriteKV of the rotated key and the value; returns the rotated (query, key)."""

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_mapping: Tensor,
        /,
        *,
        scales: Scales,
    ) -> tuple[Tensor, Tensor]: ...


class AddRmsNorm(Protocol):
    """(rms_norm(residual + x) * weight, residual + x); x alone where residual is None."""

    def __call__(self, x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, /) -> tuple[Tensor, Tensor]: ...


class DecodeAttention(Protocol):
    """One query row per sequence, query [S, q_heads, d], over its context: the
    blocks of its row of block_tables [S, W] (paged), or its slot, slots [S]
    (contiguous). softcap > 0 caps the scaled scores, softcap * tanh(s / softcap),
    before the mask and the softmax (Gemma 2); 0: uncapped."""

    def __call__(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        tables_or_slots: Tensor,
        context_lens: Tensor,
        scale: float,
        sliding_window: int = 0,
        /,
        *,
        scales: Scales,
        softcap: float = 0.0,
    ) -> Tensor: ...


class PrefillAttention(Protocol):
    """Causal attention of each sequence's new rows, query [T, q_heads, d] with
    cu_query_lens [S + 1], over its context (as DecodeAttention reads it)."""

    def __call__(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        tables_or_slots: Tensor,
        cu_query_lens: Tensor,
        context_lens: Tensor,
        scale: float,
        sliding_window: int = 0,
        /,
        *,
        scales: Scales,
        softcap: float = 0.0,
    ) -> Tensor: ...


class CopyBlocks(Protocol):
    """Copy whole blocks (or slots) src[i] -> dst[i], with their scales, in every layer."""

    def __call__(self, k_cache: Tensor, v_cache: Tensor, src: Tensor, dst: Tensor, /, *, scales: Scales) -> None: ...


class AttentionOps(Protocol):
    """kernels/reference.py's ops, signatures and semantics (its docstring has the
    cache layouts and the varlen conventions): one layer's cache per call, all
    layers' for copy_blocks. kernels/triton/ and kernels/cpu_ops.py are ones
    too. The set also carries the decoder's other fused element-wise op,
    add_rms_norm, which the model takes from its backend (models/decoder.py:
    LayerOps), so that one backend choice picks every kernel of a layer."""

    @property
    def write_kv(self) -> WriteKV: ...

    @property
    def rope_write_kv(self) -> RopeWriteKV: ...

    @property
    def add_rms_norm(self) -> AddRmsNorm: ...

    @property
    def paged_decode_attention(self) -> DecodeAttention: ...

    @property
    def paged_prefill_attention(self) -> PrefillAttention: ...

    @property
    def contiguous_decode_attention(self) -> DecodeAttention: ...

    @property
    def contiguous_prefill_attention(self) -> PrefillAttention: ...

    @property
    def copy_blocks(self) -> CopyBlocks: ...


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    ops: AttentionOps
    # Its ops read no value on the host (no .item(), no data-dependent shape), so a
    # CUDA graph can capture a forward through them.
    graph_safe: bool


def _torch() -> AttentionBackend:
    return AttentionBackend("torch", reference, graph_safe=False)  # reads lengths on the host


def _triton() -> AttentionBackend:
    from kernels import triton as triton_ops  # imported lazily: triton is heavy and optional on CPU

    return AttentionBackend("triton", triton_ops, graph_safe=True)


def _cpu() -> AttentionBackend:
    from kernels import cpu_ops

    # Its ops fall back to the reference's where the kernel could not be built (one
    # warning), so a forced `cpu` still serves; `auto` picks it only where it is built.
    return AttentionBackend("cpu", cpu_ops, graph_safe=False)


# --attention-backend's choices (config.py lists them, and "auto").
BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": _torch, "triton": _triton, "cpu": _cpu}


def resolve_backend(name: str, device: torch.device) -> str:
    """auto: triton on CUDA; on the CPU, cpu where its C++ kernels are built
    (kernels.cpu_ops.available: built once per CPU, or one warning and no), else torch."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton"
    from kernels import cpu_ops

    return "cpu" if cpu_ops.available() else "torch"


def load_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {sorted(BACKENDS)} or auto, got {name!r}")
    return BACKENDS[name]()
