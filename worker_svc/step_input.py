"""What a Step asks for, as plain data (converted from proto in server.py), and
its validation: a step that fails here touches nothing."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass(slots=True)
class SeqInput:
    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    slot_mapping: list[int]
    sample: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    return_logits: bool = False

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class StepInput:
    step_id: int
    copies: list[tuple[int, int]]
    seqs: list[SeqInput]


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    num_blocks: int  # ids a block table may name: blocks, or the slots of a contiguous cache
    block_size: int  # tokens per id: a contiguous slot holds max_seq_len
    max_model_len: int
    kv_layout: str = "paged"  # contiguous: a block table is exactly [slot]


class InvalidStep(ValueError):
    """A malformed step; `field` names the offending request field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def validate(step: StepInput, limits: Limits) -> None:
    if not step.seqs and not step.copies:
        raise InvalidStep("seqs", "a step needs at least one sequence or block copy")
    _validate_copies(step.copies, limits)
    seen: set[int] = set()
    for i, seq in enumerate(step.seqs):
        if seq.seq_id in seen:
            raise InvalidStep(f"seqs[{i}].seq_id", f"seq_id {seq.seq_id} appears twice in one step")
        seen.add(seq.seq_id)
        _validate_seq(f"seqs[{i}]", seq, limits)


def _validate_copies(copies: list[tuple[int, int]], limits: Limits) -> None:
    dsts = set()
    for i, (src, dst) in enumerate(copies):
        for name, block in (("src", src), ("dst", dst)):
            if not 0 <= block < limits.num_blocks:
                raise InvalidStep(f"copies[{i}].{name}", f"block {block} outside [0, {limits.num_blocks})")
        if src == dst or dst in dsts:
            raise InvalidStep(f"copies[{i}].dst", f"block {dst} is copied onto twice or onto itself")
        dsts.add(dst)
    if dsts & {src for src, _ in copies}:
        raise InvalidStep("copies", "a block is both a copy source and a copy destination")


def _validate_seq(name: str, seq: SeqInput, limits: Limits) -> None:
    n = len(seq.token_ids)
    if n == 0:
        raise InvalidStep(f"{name}.token_ids", "empty")
    if seq.start_pos < 0:
        raise InvalidStep(f"{name}.start_pos", f"negative ({seq.start_pos})")
    if seq.context_len > limits.max_model_len:
        raise InvalidStep(f"{name}.start_pos", f"start_pos + len(token_ids) = {seq.context_len} exceeds max model length {limits.max_model_len}")
    bad = next((t for t in seq.token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidStep(f"{name}.token_ids", f"token id {bad} outside the vocabulary [0, {limits.vocab_size})")
    needed = -(-seq.context_len // limits.block_size)
    if limits.kv_layout == "contiguous" and len(seq.block_table) != 1:
        raise InvalidStep(f"{name}.block_table", f"a contiguous cache takes exactly one slot per sequence "
                                                 f"([slot]), got {len(seq.block_table)} entries")
    if len(seq.block_table) < needed:
        raise InvalidStep(f"{name}.block_table", f"{len(seq.block_table)} blocks cannot hold {seq.context_len} tokens (need {needed})")
    bad = next((b for b in seq.block_table if not 0 <= b < limits.num_blocks), None)
    if bad is not None:
        raise InvalidStep(f"{name}.block_table", f"block {bad} outside [0, {limits.num_blocks})")
    if len(seq.slot_mapping) != n:
        raise InvalidStep(f"{name}.slot_mapping", f"{len(seq.slot_mapping)} slots for {n} tokens")
    bs = limits.block_size
    for offset, slot in enumerate(seq.slot_mapping):
        pos = seq.start_pos + offset
        # A slot must be where the block table says the token lives, or attention
        # would read other data than was written (and could clobber a shared block).
        if slot >= 0 and slot != seq.block_table[pos // bs] * bs + pos % bs:
            raise InvalidStep(f"{name}.slot_mapping", f"slot {slot} for position {pos} does not match block_table")
    s = seq.sampling
    if seq.sample and (s.temperature < 0 or not 0 <= s.top_p <= 1 or s.top_k < 0):
        raise InvalidStep(f"{name}.sampling", "need temperature >= 0, top_p in [0, 1], top_k >= 0")
