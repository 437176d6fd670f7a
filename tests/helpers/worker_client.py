"""worker.v1 steps in tests, described per sequence and laid out as the wire's
columns: `Seq` is one row as a test reads it, `step_request` builds the
columnar StepRequest from rows exactly as described (a malformed row stays
malformed), `seqs_of` reads a request's columns back into rows (the fake
worker), and `sampled_rows` / `by_seq` read a reply's sampled columns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from proto import worker_pb2

BLOCK_SIZE = 16


@dataclass
class Seq:
    """One sequence of a step. The extras (top_logprobs and after) go into
    SeqColumns.extras only for a row that sets one of them."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    slot_mapping: list[int]
    sample: bool = True
    return_logits: bool = False
    token_from_previous_step: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    top_logprobs: int = 0
    blocked_token_ids: list[int] = field(default_factory=list)
    logit_bias_token_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    penalties: worker_pb2.Penalties | None = None
    prompt_logprob_targets: list[int] = field(default_factory=list)
    prompt_top_logprobs: int = 0
    # Structured outputs: the row's allowed-token bitmask words (SeqColumns.masks), or
    # mask_follows: it comes in a StepMasks call.
    mask: list[int] | None = None
    mask_follows: bool = False
    num_drafts: int = 0  # the last num_drafts of token_ids are drafts (speculative decoding)
    lora_slot: int = 0  # the adapter slot the row runs through (0: the base model)

    @property
    def flags(self) -> int:
        return (
            (worker_pb2.SEQ_FLAG_SAMPLE if self.sample else 0)
            | (worker_pb2.SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP if self.token_from_previous_step else 0)
            | (worker_pb2.SEQ_FLAG_RETURN_LOGITS if self.return_logits else 0)
            | (worker_pb2.SEQ_FLAG_SEEDED if self.seed is not None else 0)
            | (worker_pb2.SEQ_FLAG_MASK_FOLLOWS if self.mask_follows else 0)
        )

    def extras(self) -> worker_pb2.SeqExtras | None:
        extras = worker_pb2.SeqExtras(
            top_logprobs=self.top_logprobs,
            blocked_token_ids=self.blocked_token_ids,
            logit_bias_token_ids=self.logit_bias_token_ids,
            logit_bias_values=self.logit_bias_values,
            penalties=self.penalties,
            prompt_logprob_targets=self.prompt_logprob_targets,
            prompt_top_logprobs=self.prompt_top_logprobs,
        )
        return extras if extras.ByteSize() else None


def slots_for(table: list[int], start: int, end: int, block_size: int = BLOCK_SIZE) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def seq_step(
    seq_id: int,
    token_ids: list[int],
    start_pos: int,
    table: list[int],
    *,
    sample: bool = True,
    logits: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Seq:
    """A well-formed row over a paged cache: the table cut to what the context
    needs, one slot per token where the table puts it."""
    needed = -(-(start_pos + len(token_ids)) // BLOCK_SIZE)
    return Seq(
        seq_id,
        list(token_ids),
        start_pos,
        list(table[:needed]),
        slots_for(table, start_pos, start_pos + len(token_ids)),
        sample=sample,
        return_logits=logits,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
    )


def step_request(
    step_id: int,
    seqs: Sequence[Seq] = (),
    copies: Sequence[tuple[int, int]] = (),
    previous_step_id: int | None = None,
) -> worker_pb2.StepRequest:
    columns = worker_pb2.SeqColumns(
        seq_ids=[s.seq_id for s in seqs],
        start_pos=[s.start_pos for s in seqs],
        num_tokens=[len(s.token_ids) for s in seqs],
        table_lens=[len(s.block_table) for s in seqs],
        flags=[s.flags for s in seqs],
        temperature=[s.temperature for s in seqs],
        top_p=[s.top_p for s in seqs],
        top_k=[s.top_k for s in seqs],
        seeds=[s.seed or 0 for s in seqs],
        min_p=[s.min_p for s in seqs],
        token_ids=[t for s in seqs for t in s.token_ids],
        slot_mapping=[slot for s in seqs for slot in s.slot_mapping],
        block_tables=[b for s in seqs for b in s.block_table],
    )
    for row, s in enumerate(seqs):
        if (extras := s.extras()) is not None:
            columns.extras[row].CopyFrom(extras)
    masked = [(row, s.mask) for row, s in enumerate(seqs) if s.mask is not None]
    if masked:
        columns.masks.CopyFrom(token_masks([row for row, _ in masked], [mask for _, mask in masked]))
    if any(s.num_drafts for s in seqs):
        columns.num_drafts.extend(s.num_drafts for s in seqs)
    if any(s.lora_slot for s in seqs):
        columns.lora_slots.extend(s.lora_slot for s in seqs)
    return worker_pb2.StepRequest(
        step_id=step_id,
        copies=[worker_pb2.BlockCopy(src=src, dst=dst) for src, dst in copies],
        seqs=columns,
        previous_step_id=previous_step_id,
    )


def token_masks(rows: Sequence[int], words: Sequence[Sequence[int]]) -> worker_pb2.TokenMasks:
    """The TokenMasks column of `rows`, each row's words as given (width: the first row's)."""
    packed = np.array(words, dtype="<i4").reshape(len(rows), -1)
    return worker_pb2.TokenMasks(rows=rows, width_words=packed.shape[1], words=packed.tobytes())


def seqs_of(request: worker_pb2.StepRequest) -> list[Seq]:
    """The rows of a request's columns (the fake worker's view; a malformed
    request fails an assertion)."""
    c = request.seqs
    rows = len(c.seq_ids)
    for name in ("start_pos", "num_tokens", "table_lens", "flags", "temperature", "top_p", "top_k", "seeds"):
        assert len(getattr(c, name)) == rows, f"seqs.{name}: {len(getattr(c, name))} entries for {rows} rows"
    assert len(c.token_ids) == len(c.slot_mapping) == sum(c.num_tokens), "token_ids / slot_mapping vs num_tokens"
    assert len(c.block_tables) == sum(c.table_lens), "block_tables vs table_lens"
    assert all(row < rows for row in c.extras), "extras of a row that does not exist"
    token_ends, table_ends = np.cumsum(c.num_tokens, dtype=np.int64), np.cumsum(c.table_lens, dtype=np.int64)
    seqs = []
    for row in range(rows):
        tokens = slice(int(token_ends[row] - c.num_tokens[row]), int(token_ends[row]))
        table = slice(int(table_ends[row] - c.table_lens[row]), int(table_ends[row]))
        flags = c.flags[row]
        extras = c.extras[row] if row in c.extras else worker_pb2.SeqExtras()
        seqs.append(
            Seq(
                c.seq_ids[row],
                list(c.token_ids[tokens]),
                c.start_pos[row],
                list(c.block_tables[table]),
                list(c.slot_mapping[tokens]),
                sample=bool(flags & worker_pb2.SEQ_FLAG_SAMPLE),
                return_logits=bool(flags & worker_pb2.SEQ_FLAG_RETURN_LOGITS),
                token_from_previous_step=bool(flags & worker_pb2.SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP),
                temperature=c.temperature[row],
                top_p=c.top_p[row],
                top_k=c.top_k[row],
                seed=c.seeds[row] if flags & worker_pb2.SEQ_FLAG_SEEDED else None,
                top_logprobs=extras.top_logprobs,
                blocked_token_ids=list(extras.blocked_token_ids),
                logit_bias_token_ids=list(extras.logit_bias_token_ids),
                logit_bias_values=list(extras.logit_bias_values),
                penalties=extras.penalties if extras.HasField("penalties") else None,
                prompt_logprob_targets=list(extras.prompt_logprob_targets),
                prompt_top_logprobs=extras.prompt_top_logprobs,
                num_drafts=c.num_drafts[row] if c.num_drafts else 0,
                lora_slot=c.lora_slots[row] if c.lora_slots else 0,
            )
        )
    return seqs


@dataclass(frozen=True)
class Sampled:
    """One row of a reply's sampled columns."""

    seq_id: int
    token_id: int
    logprob: float
    logits: bytes  # little-endian float32[vocab]; empty unless the row asked
    top_token_ids: list[int]
    top_logprobs: list[float]


def sampled_rows(response: worker_pb2.StepResponse) -> list[Sampled]:
    c = response.sampled
    rows = len(c.seq_ids)
    assert len(c.token_ids) == len(c.logprobs) == len(c.top_counts) == rows, "sampled columns of unequal length"
    assert len(c.top_token_ids) == len(c.top_logprobs) == sum(c.top_counts), "alternatives vs top_counts"
    assert all(row < rows for row in c.logits), "logits of a row that does not exist"
    ends = np.cumsum(c.top_counts, dtype=np.int64)
    return [
        Sampled(
            c.seq_ids[row],
            c.token_ids[row],
            c.logprobs[row],
            c.logits[row] if row in c.logits else b"",
            list(c.top_token_ids[ends[row] - c.top_counts[row] : ends[row]]),
            list(c.top_logprobs[ends[row] - c.top_counts[row] : ends[row]]),
        )
        for row in range(rows)
    ]


def step_response(
    step_id: int,
    instance_id: str,
    sampled: dict[int, tuple[int, float]],
    num_accepted: Sequence[int] = (),
    draft_logprobs: Sequence[float] = (),
) -> worker_pb2.StepResponse:
    """A reply carrying (token id, logprob) per seq_id, and the drafts accepted if the
    step had some, nothing else (the fake worker's)."""
    return worker_pb2.StepResponse(
        step_id=step_id,
        instance_id=instance_id,
        sampled=worker_pb2.SampledColumns(
            seq_ids=list(sampled),
            token_ids=[token for token, _ in sampled.values()],
            logprobs=[logprob for _, logprob in sampled.values()],
            top_counts=[0] * len(sampled),
            num_accepted=num_accepted,
            draft_logprobs=draft_logprobs,
        ),
    )


def logits_of(token: Sampled) -> np.ndarray:
    return np.frombuffer(token.logits, dtype="<f4")


def by_seq(response: worker_pb2.StepResponse) -> dict[int, Sampled]:
    rows = sampled_rows(response)
    by_id = {t.seq_id: t for t in rows}
    assert len(by_id) == len(rows), "a seq_id sampled twice in one step"
    return by_id
