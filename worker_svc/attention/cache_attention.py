"""The attention the decoder runs per layer for one step: RoPE on this step's q
and k with the K/V write into the cache (one op), then attend, group by group
(decodes, fresh prefill chunks, other prefill chunks), each through the cache's
own ops, or SDPA where prefill_route allows it."""

from __future__ import annotations

import torch

from worker_svc.attention.kv_cache import KVCachePool
from worker_svc.attention.metadata import AttentionGroup, AttentionMetadata
from worker_svc.attention.prefill_route import fresh_prefill_attention, sdpa_takes


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
