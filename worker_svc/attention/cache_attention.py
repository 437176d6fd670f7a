"""The attention the decoder runs per layer for one step: RoPE on this step's q
and k with the K/V write into the cache (one op), then attend, group by group
(decodes, fresh prefill chunks, other prefill chunks), each through the cache's
own ops, or SDPA where prefill_route allows it."""

from __future__ import annotations

import torch

from kernels import cpu_ops
from kernels.decoder_loop import LoopStep
from worker_svc.attention.kv_cache import ContiguousKVCache, KVCachePool, PagedKVCache
from worker_svc.attention.metadata import AttentionGroup, AttentionMetadata
from worker_svc.attention.prefill_route import fresh_prefill_attention, sdpa_takes

# The caches the C++ element-wise ops write in place (cpu_ops.rope_write_kv's).
_LOOP_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


class CacheAttention:
    """models.decoder.Attention over `cache` for the step described by `metadata`."""

    def __init__(
        self,
        cache: KVCachePool,
        metadata: AttentionMetadata,
        scale: float,
        route: str = "paged",
        softcap: float = 0.0,
    ):
        self.cache = cache
        self.metadata = metadata
        self.scale = scale
        self.route = route
        self.softcap = softcap  # the model's score soft-cap (Gemma 2), 0: none
        # Each group's rows, worked out once per step rather than once per layer.
        self._groups: list[tuple[str, AttentionGroup, slice]] = []
        start = 0
        for kind, group in metadata.groups:
            self._groups.append((kind, group, slice(start, start + group.num_tokens)))
            start += group.num_tokens

    def loop_step(self) -> LoopStep | None:
        """This step as the C++ layer loop takes it (kernels/decoder_loop.py), or None
        where its layers attend otherwise: several groups (each attended apart), a fresh
        prefill the SDPA route may take, a quantized cache, ops other than the C++ ones."""
        cache = self.cache
        if not isinstance(cache, (PagedKVCache, ContiguousKVCache)) or len(self._groups) != 1:
            return None
        if cache.ops is not cpu_ops or cache.dtype not in _LOOP_CACHE_DTYPES:
            return None
        kind, group, _ = self._groups[0]
        if cache.scales is not None or (kind == "fresh" and self.route == "sdpa") or not cache.k.is_cpu:
            return None
        # A contiguous cache's table is each sequence's slot (the ops read [S, 1]).
        tables = group.block_tables[:, :1] if cache.layout == "contiguous" else group.block_tables
        slots = self.metadata.slot_mapping
        return LoopStep(
            k_cache=cache.k,
            v_cache=cache.v,
            slot_mapping=slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.long().contiguous(),
            block_tables=_int32(tables),
            cu_query_lens=None if kind == "decode" else _int32(group.cu_query_lens),
            context_lens=_int32(group.context_lens),
            scale=float(self.scale),
            softcap=float(self.softcap),
        )

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        window: int,
    ) -> torch.Tensor:
        # FP8/INT8 caches quantize on write and dequantize on read.
        q, k = self.cache.rope_write(layer, q, k, v, cos, sin, self.metadata.slot_mapping)
        if len(self._groups) == 1:  # every decode-only step: the rows as they are, no slices
            kind, group, _ = self._groups[0]
            return self._attend(kind, layer, q, k, v, group, window)
        return torch.cat(
            [self._attend(kind, layer, q[rows], k[rows], v[rows], group, window) for kind, group, rows in self._groups]
        )

    def _attend(
        self,
        kind: str,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: AttentionGroup,
        window: int,
    ) -> torch.Tensor:
        if kind == "decode":
            return self.cache.decode(layer, q, group, self.scale, window, self.softcap)
        longest = max(group.query_lens)
        fresh_sdpa = self.route == "sdpa" and sdpa_takes(self.cache.dtype, q.dtype, window, longest, self.softcap)
        if kind == "fresh" and fresh_sdpa:
            return fresh_prefill_attention(q, k, v, group.cu_query_lens, group.query_lens, self.scale)
        return self.cache.prefill(layer, q, group, self.scale, window, self.softcap)
