"""The Step messages as plain data and back: a step's columns from a StepRequest, a
StepOutput as a StepResponse (the worker's only conversions of them: the unary call,
the stream and the benchmarks' wire figures all go through here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from proto import worker_pb2
from worker_svc.step.input import (
    BoolArray,
    Penalties,
    RowExtras,
    SamplingColumns,
    SeqColumns,
    StepInput,
    TierCopies,
    TokenMasks,
)
from worker_svc.step.output import StepOutput
from worker_svc.step.validation import check_columns, check_mask_shape

T = TypeVar("T")

# Per-row columns (seq_ids sets the row count); the flat ones are checked against their counts.
_PER_ROW = ("start_pos", "num_tokens", "table_lens", "flags", "temperature", "top_p", "top_k", "seeds")
# Per-row columns added since: absent (a scheduler that predates them) means 0 on every row.
_LATER_PER_ROW = ("min_p", "num_drafts", "pooling", "lora_slots")
_KNOWN_FLAGS = sum(worker_pb2.SeqFlag.values())  # the bits are distinct powers of two
_SAMPLE = worker_pb2.SEQ_FLAG_SAMPLE
_FROM_PREVIOUS = worker_pb2.SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP
_RETURN_LOGITS = worker_pb2.SEQ_FLAG_RETURN_LOGITS
_SEEDED = worker_pb2.SEQ_FLAG_SEEDED
_MASK_FOLLOWS = worker_pb2.SEQ_FLAG_MASK_FOLLOWS


def step_from_proto(req: worker_pb2.StepRequest) -> StepInput:
    """One numpy array per column (numpy copies a packed repeated field in one
    go), their shapes checked before any is read; the step stays columns. Only
    the rows with extras get an object (RowExtras)."""
    c = req.seqs
    num_tokens, table_lens, flags = (np.array(x, np.int64) for x in (c.num_tokens, c.table_lens, c.flags))
    token_ids, slot_mapping, block_tables = (
        np.array(x, np.int64) for x in (c.token_ids, c.slot_mapping, c.block_tables)
    )
    rows = len(c.seq_ids)
    check_columns(
        rows,
        {name: len(getattr(c, name)) for name in _PER_ROW}
        | {name: len(getattr(c, name)) or rows for name in _LATER_PER_ROW},
        {
            "token_ids": (len(token_ids), "num_tokens", num_tokens),
            "slot_mapping": (len(slot_mapping), "num_tokens", num_tokens),
            "block_tables": (len(block_tables), "table_lens", table_lens),
        },
        flags,
        _KNOWN_FLAGS,
        c.extras.keys(),
    )
    sample, from_previous, return_logits, seeded, mask_follows = (
        (flags & bit) != 0 for bit in (_SAMPLE, _FROM_PREVIOUS, _RETURN_LOGITS, _SEEDED, _MASK_FOLLOWS)
    )
    temperature, top_p = np.array(c.temperature, np.float32), np.array(c.top_p, np.float32)
    min_p = np.array(c.min_p, np.float32) if len(c.min_p) else np.zeros(rows, np.float32)
    top_k, seeds = np.array(c.top_k, np.int64), np.array(c.seeds, np.uint64)
    sampling = SamplingColumns(temperature, top_p, top_k, seeds, seeded, min_p)
    seqs = SeqColumns(
        seq_ids=np.array(c.seq_ids, dtype=np.uint64),
        start_pos=np.array(c.start_pos, dtype=np.int64),
        num_tokens=num_tokens,
        table_lens=table_lens,
        sample=sample,
        from_previous=from_previous,
        return_logits=return_logits,
        sampling=sampling,
        token_ids=token_ids,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        extras={row: _extras(more, from_previous, row) for row, more in c.extras.items()},
        num_drafts=np.array(c.num_drafts, np.int64),
        masks=masks_from_proto("seqs.masks", c.masks) if c.HasField("masks") else None,
        draft_masks=masks_from_proto("seqs.draft_masks", c.draft_masks) if c.HasField("draft_masks") else None,
        late_mask_rows=np.flatnonzero(mask_follows),
        pooling=np.array(c.pooling, np.int64),
        lora_slots=np.array(c.lora_slots, np.int64),
    )
    copies = np.array([(copy.src, copy.dst) for copy in req.copies], dtype=np.int64).reshape(-1, 2)
    previous = req.previous_step_id if req.HasField("previous_step_id") else None
    late = (
        masks_from_proto("previous_step_masks", req.previous_step_masks)
        if req.HasField("previous_step_masks")
        else None
    )
    tiers = TierCopies(
        np.array([(c.src, c.dst) for c in req.offloads], dtype=np.int64).reshape(-1, 2),
        np.array([(c.src, c.dst) for c in req.onloads], dtype=np.int64).reshape(-1, 2),
    )
    return StepInput(req.step_id, copies, seqs, previous, late, tiers)


def masks_from_proto(field_name: str, m: worker_pb2.TokenMasks) -> TokenMasks:
    """The words as one [rows, W] int32 array read straight from the bytes (one copy, no varints)."""
    check_mask_shape(field_name, len(m.rows), m.width_words, len(m.words))
    words = np.frombuffer(m.words, dtype="<i4").astype(np.int32).reshape(len(m.rows), m.width_words)
    return TokenMasks(np.array(m.rows, dtype=np.int64), words)


def _extras(extras: worker_pb2.SeqExtras, from_previous: BoolArray, row: int) -> RowExtras:
    penalties = None
    if extras.HasField("penalties"):
        p = extras.penalties
        penalties = Penalties(
            p.presence,
            p.frequency,
            p.repetition,
            _plain(p.output_token_ids),
            _plain(p.prompt_token_ids),
            bool(from_previous[row]),
        )
    return RowExtras(
        extras.top_logprobs,
        _plain(extras.blocked_token_ids),
        _plain(extras.logit_bias_token_ids),
        _plain(extras.logit_bias_values),
        penalties,
        _plain(extras.prompt_logprob_targets),
        extras.prompt_top_logprobs,
    )


def _plain(field: Sequence[T]) -> tuple[T, ...]:
    """A repeated field as a tuple: the step stays plain data (a tensor-parallel
    worker pickles it to its other ranks) and outlives the request message."""
    return tuple(field) if field else ()


def step_to_proto(out: StepOutput, instance_id: str) -> worker_pb2.StepResponse:
    """The samples as columns; alternatives and logits rows only for the rows that asked."""
    rows = out.samples
    top_counts = [0] * len(rows)
    for i, block in rows.top.items():
        top_counts[i] = len(block)
    tops = [rows.top[i] for i in sorted(rows.top)]
    top = np.concatenate(tops) if tops else np.zeros((0, 2))
    sampled = worker_pb2.SampledColumns(
        seq_ids=rows.seq_ids.tolist(),
        token_ids=rows.token_ids.tolist(),
        logprobs=rows.logprobs.tolist(),
        top_counts=top_counts,
        top_token_ids=top[:, 0].astype(np.int64).tolist(),
        top_logprobs=top[:, 1].tolist(),
        logits={row: t.float().numpy().astype("<f4").tobytes() for row, t in rows.logits.items()},
        num_accepted=rows.num_accepted.tolist(),
        draft_logprobs=rows.draft_logprobs.tolist(),
    )
    prompt_logprobs = [
        worker_pb2.PromptLogprobs(
            seq_id=p.seq_id,
            logprobs=p.logprobs.tolist(),
            top_token_ids=p.top_token_ids.tolist(),
            top_logprobs=p.top_logprobs.tolist(),
        )
        for p in out.prompt_logprobs
    ]
    t = out.timings_ms
    timings = worker_pb2.StepTimings(
        prepare_ms=t.get("prepare_ms", 0.0),
        forward_ms=t.get("forward_ms", 0.0),
        sample_ms=t.get("sample_ms", 0.0),
        total_ms=t.get("total_ms", 0.0),
        offload_ms=t.get("offload_ms", 0.0),
        onload_ms=t.get("onload_ms", 0.0),
    )
    reply = worker_pb2.StepResponse(
        step_id=out.step_id,
        sampled=sampled,
        timings=timings,
        instance_id=instance_id,
        num_tokens=out.num_tokens,
        prompt_logprobs=prompt_logprobs,
    )
    if out.pooled is not None:
        values = out.pooled.values
        reply.pooled.seq_ids.extend(out.pooled.seq_ids.tolist())
        reply.pooled.hidden_size = values.shape[1]
        reply.pooled.values = values.astype("<f4", copy=False).tobytes()
    return reply
