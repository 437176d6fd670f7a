"""A StepInput written row by row: for the worker's start-up check, tests and
benchmarks. A step from the wire never comes through here: server.py turns the
request's columns into SeqColumns directly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from worker_svc.step.input import RowExtras, SamplingColumns, SeqColumns, StepInput


class _Row(NamedTuple):
    seq_id: int
    start_pos: int
    num_tokens: int
    table_len: int
    sample: bool
    from_previous: bool
    return_logits: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int
    seeded: bool
    min_p: float
    pooling: int
    lora_slot: int


class StepBuilder:
    """`add` one sequence at a time, then `build` the step's columns."""

    def __init__(self, block_size: int = 0):
        self.block_size = block_size  # for slot mappings left to `add`
        self._rows: list[_Row] = []
        self._tokens: list[int] = []
        self._slots: list[int] = []
        self._tables: list[int] = []
        self._extras: dict[int, RowExtras] = {}

    def add(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        start_pos: int,
        block_table: Sequence[int],
        slot_mapping: Sequence[int] | None = None,
        *,
        sample: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        return_logits: bool = False,
        from_previous: bool = False,
        extras: RowExtras | None = None,
        pooling: int = 0,
        lora_slot: int = 0,
    ) -> StepBuilder:
        """One sequence; `slot_mapping` defaults to where `block_table` puts its tokens."""
        if slot_mapping is None:
            assert self.block_size, "a slot mapping needs the builder's block_size"
            positions = range(start_pos, start_pos + len(token_ids))
            size = self.block_size
            slot_mapping = [block_table[p // size] * size + p % size for p in positions]
        assert len(slot_mapping) == len(token_ids), (len(slot_mapping), len(token_ids))
        row = len(self._rows)
        self._rows.append(
            _Row(
                seq_id,
                start_pos,
                len(token_ids),
                len(block_table),
                sample,
                from_previous,
                return_logits,
                temperature,
                top_p,
                top_k,
                0 if seed is None else seed,
                seed is not None,
                min_p,
                pooling,
                lora_slot,
            )
        )
        self._tokens.extend(token_ids)
        self._slots.extend(slot_mapping)
        self._tables.extend(block_table)
        if extras is not None:
            self._extras[row] = extras
        return self

    def build(
        self, step_id: int, copies: Sequence[tuple[int, int]] = (), previous_step_id: int | None = None
    ) -> StepInput:
        copy_pairs = np.array(copies, dtype=np.int64).reshape(-1, 2)
        if not self._rows:
            return StepInput(step_id, copy_pairs, SeqColumns.empty(), previous_step_id)
        c = dict(zip(_Row._fields, zip(*self._rows)))  # the rows' columns
        sampling = SamplingColumns(
            np.array(c["temperature"], np.float32),
            np.array(c["top_p"], np.float32),
            np.array(c["top_k"], np.int64),
            np.array(c["seed"], np.uint64),
            np.array(c["seeded"], bool),
            np.array(c["min_p"], np.float32),
        )
        seqs = SeqColumns(
            seq_ids=np.array(c["seq_id"], np.uint64),
            start_pos=np.array(c["start_pos"], np.int64),
            num_tokens=np.array(c["num_tokens"], np.int64),
            table_lens=np.array(c["table_len"], np.int64),
            sample=np.array(c["sample"], bool),
            from_previous=np.array(c["from_previous"], bool),
            return_logits=np.array(c["return_logits"], bool),
            sampling=sampling,
            token_ids=np.array(self._tokens, np.int64),
            slot_mapping=np.array(self._slots, np.int64),
            block_tables=np.array(self._tables, np.int64),
            extras=dict(self._extras),
            pooling=np.array(c["pooling"], np.int64),
            lora_slots=np.array(c["lora_slot"], np.int64),
        )
        return StepInput(step_id, copy_pairs, seqs, previous_step_id)
