"""Flatten a validated step into the tensors one batched forward needs.

Token order: all single-token sequences (decodes) first, then the prefill
chunks, so each layer runs the decode op on one slice and the prefill op on the
other without gathering.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.step_input import SeqInput


@dataclass
class AttentionGroup:
    block_tables: torch.Tensor      # [S, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor      # [S] int32: cached + new tokens
    cu_query_lens: torch.Tensor     # [S + 1] int32
    num_tokens: int


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor         # [T]
    positions: torch.Tensor         # [T]
    slot_mapping: torch.Tensor      # [T] int64
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    seqs: list[SeqInput]            # in token order
    sample_rows: torch.Tensor       # row in [T] of the last token of each sampling sequence
    sample_seqs: list[SeqInput]


def build_forward_batch(seqs: list[SeqInput], device: torch.device) -> ForwardBatch:
    decodes = [s for s in seqs if len(s.token_ids) == 1]
    prefills = [s for s in seqs if len(s.token_ids) > 1]
    ordered = decodes + prefills
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    for seq in ordered:
        ids.extend(seq.token_ids)
        positions.extend(range(seq.start_pos, seq.context_len))
        slots.extend(seq.slot_mapping)
        if seq.sample:
            sample_rows.append(len(ids) - 1)
    as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
    return ForwardBatch(
        input_ids=as_tensor(ids, torch.long),
        positions=as_tensor(positions, torch.long),
        slot_mapping=as_tensor(slots, torch.long),
        decode=_group(decodes, device),
        prefill=_group(prefills, device),
        seqs=ordered,
        sample_rows=as_tensor(sample_rows, torch.long),
        sample_seqs=[s for s in ordered if s.sample],
    )


def _group(seqs: list[SeqInput], device: torch.device) -> AttentionGroup | None:
    if not seqs:
        return None
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    lens = [len(s.token_ids) for s in seqs]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return AttentionGroup(
        block_tables=tables.to(device),
        context_lens=torch.tensor([s.context_len for s in seqs], dtype=torch.int32, device=device),
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        num_tokens=cu[-1],
    )
