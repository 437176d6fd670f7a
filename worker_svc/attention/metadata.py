"""What attention reads of a step, on the device: where this step's K/V go, and
each group's block tables and lengths. Rows are laid out decodes first, then
fresh prefill chunks (starting at position 0), then the other prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    block_tables: torch.Tensor  # [S, W] int32, padded with block 0
    context_lens: torch.Tensor  # [S] int32: cached + new tokens
    cu_query_lens: torch.Tensor  # [S + 1] int32
    num_tokens: int
    query_lens: tuple[int, ...]  # host copy of the query lengths (the SDPA route loops over them)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64; < 0: not written
    decode: AttentionGroup | None
    fresh: AttentionGroup | None  # between the decode and the prefill rows
    prefill: AttentionGroup | None

    @property
    def groups(self) -> tuple[tuple[str, AttentionGroup], ...]:
        """(kind, group) of the groups present, in row order."""
        named = (("decode", self.decode), ("fresh", self.fresh), ("prefill", self.prefill))
        return tuple((kind, group) for kind, group in named if group is not None)
