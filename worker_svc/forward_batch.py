"""Flatten a validated step into the tensors one batched forward needs.

Token order: all single-token sequences (decodes) first, then the prefill
chunks, so each layer runs the decode op on one slice and the prefill op on the
other without gathering. Everything is built from the step's flat arrays with
numpy and crosses to the device in one copy per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from worker_svc.step_input import InvalidStep, SeqInput, StepArrays, StepInput, ranges

if TYPE_CHECKING:
    from worker_svc.model_runner import LastSamples


@dataclass
class AttentionGroup:
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [S] int32: cached + new tokens
    cu_query_lens: torch.Tensor  # [S + 1] int32
    num_tokens: int


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] int64
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    seqs: list[SeqInput]  # in token order
    sample_rows: torch.Tensor  # row in [T] of the last token of each sampling sequence
    sample_seqs: list[SeqInput]


def build_forward_batch(step: StepInput, device: torch.device, previous: LastSamples | None = None) -> ForwardBatch:
    """`previous`: the samples of the step run last, for the decodes that take
    their input from it (checked by check_references)."""
    a = step.arrays
    is_decode = a.seq_lens == 1
    order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
    token_starts = np.cumsum(a.seq_lens) - a.seq_lens
    rows = ranges(token_starts[order], a.seq_lens[order])  # step token index of each batch row
    seqs = [step.seqs[i] for i in order]
    samples = np.array([s.sample for s in seqs], dtype=bool)
    last_rows = np.cumsum(a.seq_lens[order]) - 1
    num_decodes = int(is_decode.sum())
    as_tensor = lambda values: torch.from_numpy(np.ascontiguousarray(values)).to(device)
    input_ids = as_tensor(a.token_ids[rows])
    referring = [k for k, seq in enumerate(seqs) if seq.token_from_previous_step]
    if referring and previous is not None:
        # Resolved on the device: the sampled ids never went through the host for this.
        source = [previous.rows[seqs[k].seq_id] for k in referring]
        input_ids[as_tensor(last_rows[referring])] = previous.token_ids[as_tensor(np.array(source))]
    return ForwardBatch(
        input_ids=input_ids,
        positions=as_tensor(a.positions[rows]),
        slot_mapping=as_tensor(a.slot_mapping[rows]),
        decode=_group(a, order[:num_decodes], device),
        prefill=_group(a, order[num_decodes:], device),
        seqs=seqs,
        sample_rows=as_tensor(last_rows[samples]),
        sample_seqs=[s for s in seqs if s.sample],
    )


def _group(a: StepArrays, members: np.ndarray, device: torch.device) -> AttentionGroup | None:
    """The attention metadata of the sequences `members` (indices into the step), in that order."""
    if members.size == 0:
        return None
    table_lens = a.table_lens[members]
    table_starts = (np.cumsum(a.table_lens) - a.table_lens)[members]
    tables = np.zeros((members.size, int(table_lens.max())), dtype=np.int32)
    row_of = np.repeat(np.arange(members.size), table_lens)
    tables[row_of, ranges(np.zeros_like(table_lens), table_lens)] = a.block_tables[ranges(table_starts, table_lens)]
    query_lens = a.seq_lens[members]
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    to = lambda values: torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)).to(device)
    return AttentionGroup(
        block_tables=to(tables),
        context_lens=to(a.context_lens[members]),
        cu_query_lens=to(cu),
        num_tokens=int(cu[-1]),
    )


def check_references(step: StepInput, previous: LastSamples | None) -> None:
    """Every decode that names the previous step's sample must find it there."""
    for i, seq in enumerate(step.seqs):
        if not seq.token_from_previous_step:
            continue
        if previous is None or previous.step_id != step.previous_step_id or seq.seq_id not in previous.rows:
            raise InvalidStep(
                f"seqs[{i}].token_from_previous_step",
                f"seq_id {seq.seq_id} sampled nothing in step {step.previous_step_id}",
            )
