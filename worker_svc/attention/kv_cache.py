"""The K/V tensors a worker owns, behind one cache-pool protocol (KVCachePool).

Two layouts, chosen by --kv-layout:

* paged (default): [layers, blocks, kv_heads, block_size, head_dim]. A sequence's
  tokens live in the blocks its block table names; blocks are shared, copied
  (copy-on-write) and reused as the scheduler decides.
* contiguous (the baseline the seeds compare against): [layers, max_batch,
  kv_heads, max_seq_len, head_dim]. A sequence owns one whole slot of
  max_seq_len positions for its life, whatever its length.

The contiguous layout is the paged one with one block of max_seq_len tokens per
sequence, and the Step contract is the same for both: a contiguous sequence's
block table is [slot index] and its slot mapping is slot * max_seq_len +
position. So each cache reports the ids a block table may name (num_blocks: the
slots of a contiguous cache) and the tokens per id (block_size: max_seq_len),
the step validation and KV writes are shared, and only reading K/V for attention
differs (a gather through the block tables vs a direct read of each slot).

A quantized cache (FP8 e4m3 or INT8, kernels/quant.py) also owns its per-token,
per-KV-head scales (fp32) and, for INT8, zero points (int8), shaped like the
values without head_dim (one quant.KVScales): written with their token by
write_kv, read by the attention ops, copied with their block (or slot) by
copy_blocks.

A cache is built with one backend's ops (backend.AttentionOps) and calls them
itself: callers say what to do with a layer (write, decode, prefill), never
which op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from kernels import quant, reference
from kernels.quant import KVScales
from worker_svc.attention.backend import AttentionOps, DecodeAttention, PrefillAttention
from worker_svc.attention.metadata import AttentionGroup

BlockIds = Sequence[int] | npt.NDArray[np.int64] | torch.Tensor


@runtime_checkable
class KVCachePool(Protocol):
    """What the model runner and the attention callable use of a KV cache."""

    layout: str  # "paged" | "contiguous"
    num_blocks: int  # ids a block table may name: blocks, or contiguous slots
    block_size: int  # tokens per id: the block size, or max_seq_len
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one id (block or slot), all layers, K and V, scales included."""
        ...

    @property
    def scale_block_bytes(self) -> int:
        """The scales' and zero points' part of block_bytes (0 unquantized)."""
        ...

    @property
    def total_bytes(self) -> int:
        """What the cache's tensors take (== num_blocks * block_bytes)."""
        ...

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K/V [T, kv_heads, d] of one layer at their slots."""

    def rope_write(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on this step's query and key, the rotated key and the value stored at
        their slots (one op): the rotated (query, key)."""
        ...

    def decode(
        self,
        layer: int,
        query: torch.Tensor,
        group: AttentionGroup,
        scale: float,
        sliding_window: int,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention of one query row per sequence of `group` [S, q_heads, d] over its
        context; softcap > 0 caps the scores (backend.DecodeAttention)."""
        ...

    def prefill(
        self,
        layer: int,
        query: torch.Tensor,
        group: AttentionGroup,
        scale: float,
        sliding_window: int,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Causal attention of `group`'s chunks [T, q_heads, d] over their contexts."""
        ...

    def copy_blocks(self, src: BlockIds, dst: BlockIds) -> None:
        """Copy whole blocks (or slots) src[i] -> dst[i] in every layer."""

    def zero_blocks(self, ids: Sequence[int]) -> None:
        """Zero whole blocks (or slots), values and scales, in every layer."""


class _KVTensors:
    """K/V values (+ scales) shaped [layers, ids, kv_heads, tokens per id, head_dim]
    and what both layouts do alike: write, copy, zero, and attend through the ops
    of their layout."""

    layout = ""

    def __init__(
        self,
        num_layers: int,
        num_ids: int,
        num_kv_heads: int,
        tokens_per_id: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: AttentionOps = reference,
    ):
        shape = (num_layers, num_ids, num_kv_heads, tokens_per_id, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scales = KVScales.zeros(shape, dtype, device)  # None unquantized
        # Each layer's views, made once: indexing the pool per call was two select ops
        # (and four more for scales) per layer and op, host time of every decode step.
        self._layers = [(self.k[i], self.v[i]) for i in range(num_layers)]
        self._scales = [None if self.scales is None else self.scales[i] for i in range(num_layers)]
        self.num_blocks = num_ids
        self.block_size = tokens_per_id
        self.dtype = dtype
        self.ops = ops

    @staticmethod
    def scale_bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block's scales and zero points, all layers, K and V (0 unquantized)."""
        return 2 * num_layers * num_kv_heads * block_size * quant.scale_bytes_per_token_head(dtype)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block, all layers, K and V, scales included: what a block costs
        when sizing the pool from a memory budget. A contiguous slot is a block of
        max_seq_len tokens."""
        element = torch.empty((), dtype=dtype).element_size()
        values = 2 * num_layers * num_kv_heads * block_size * head_dim * element
        return values + _KVTensors.scale_bytes_per_block(num_layers, num_kv_heads, block_size, dtype)

    @property
    def block_bytes(self) -> int:
        num_layers, _, num_kv_heads, block_size, head_dim = self.k.shape
        return self.bytes_per_block(num_layers, num_kv_heads, block_size, head_dim, self.dtype)

    @property
    def scale_block_bytes(self) -> int:
        num_layers, _, num_kv_heads, block_size, _ = self.k.shape
        return self.scale_bytes_per_block(num_layers, num_kv_heads, block_size, self.dtype)

    @property
    def total_bytes(self) -> int:
        """What the pool's tensors take, scales included (== num_blocks * block_bytes)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the pool: K, V, then the scales and zero points if any."""
        return (self.k, self.v, *(self.scales.tensors if self.scales is not None else ()))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def layer_scales(self, i: int) -> KVScales | None:
        """Layer i's scales (and zero points), as the ops take them; None unquantized."""
        return self._scales[i]

    def copy_blocks(self, src: BlockIds, dst: BlockIds) -> None:
        if len(src):
            # A step's copies arrive as device tensors (its one upload); others become them here.
            src_t, dst_t = (torch.as_tensor(ids, dtype=torch.long, device=self.k.device) for ids in (src, dst))
            self.ops.copy_blocks(self.k, self.v, src_t, dst_t, scales=self.scales)

    def zero_blocks(self, ids: Sequence[int]) -> None:
        for tensor in self.tensors:
            tensor[:, list(ids)] = 0

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # slot // tokens_per_id, slot % tokens_per_id: the same op for blocks and slots.
        k_cache, v_cache = self.layer(layer)
        self.ops.write_kv(key, value, k_cache, v_cache, slot_mapping, scales=self.layer_scales(layer))

    def rope_write(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # slot // tokens_per_id, slot % tokens_per_id: the same op for blocks and slots.
        k_cache, v_cache = self.layer(layer)
        scales = self.layer_scales(layer)
        return self.ops.rope_write_kv(query, key, value, cos, sin, k_cache, v_cache, slot_mapping, scales=scales)

    def decode(
        self, layer: int, query: torch.Tensor, group: AttentionGroup, scale: float, window: int, softcap: float = 0.0
    ) -> torch.Tensor:
        k_cache, v_cache = self.layer(layer)
        index, scales = self._index(group), self.layer_scales(layer)
        return self._decode_op(
            query, k_cache, v_cache, index, group.context_lens, scale, window, scales=scales, softcap=softcap
        )

    def prefill(
        self, layer: int, query: torch.Tensor, group: AttentionGroup, scale: float, window: int, softcap: float = 0.0
    ) -> torch.Tensor:
        k_cache, v_cache = self.layer(layer)
        index, lens, scales = self._index(group), (group.cu_query_lens, group.context_lens), self.layer_scales(layer)
        return self._prefill_op(query, k_cache, v_cache, index, *lens, scale, window, scales=scales, softcap=softcap)

    # What differs between the layouts: the ops that read them, and what a sequence's
    # table says (its blocks, or its slot).
    @property
    def _decode_op(self) -> DecodeAttention:
        raise NotImplementedError

    @property
    def _prefill_op(self) -> PrefillAttention:
        raise NotImplementedError

    def _index(self, group: AttentionGroup) -> torch.Tensor:
        raise NotImplementedError


class PagedKVCache(_KVTensors):
    """[layers, num_blocks, kv_heads, block_size, head_dim]; attention gathers
    each sequence's blocks through its block table."""

    layout = "paged"

    @property
    def _decode_op(self) -> DecodeAttention:
        return self.ops.paged_decode_attention

    @property
    def _prefill_op(self) -> PrefillAttention:
        return self.ops.paged_prefill_attention

    def _index(self, group: AttentionGroup) -> torch.Tensor:
        return group.block_tables


class ContiguousKVCache(_KVTensors):
    """[layers, max_batch, kv_heads, max_seq_len, head_dim]: one slot of
    max_seq_len positions per sequence (num_blocks slots of block_size
    positions). A sequence's block table is [slot], and attention reads that
    slot's first context_len positions directly."""

    layout = "contiguous"

    @property
    def _decode_op(self) -> DecodeAttention:
        return self.ops.contiguous_decode_attention

    @property
    def _prefill_op(self) -> PrefillAttention:
        return self.ops.contiguous_prefill_attention

    def _index(self, group: AttentionGroup) -> torch.Tensor:
        return group.block_tables[:, 0]


KV_LAYOUTS: dict[str, type[PagedKVCache | ContiguousKVCache]] = {
    "paged": PagedKVCache,
    "contiguous": ContiguousKVCache,
}


def kv_cache_class(layout: str) -> type[PagedKVCache | ContiguousKVCache]:
    """--kv-layout's cache: num_ids blocks of tokens_per_id tokens (paged), or
    num_ids slots of tokens_per_id = max_seq_len positions (contiguous)."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"kv layout must be one of {tuple(KV_LAYOUTS)}, got {layout!r}")
    return KV_LAYOUTS[layout]
