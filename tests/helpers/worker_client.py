"""Build worker.v1 steps in tests: block tables, slot mappings, and logits decoding."""

from __future__ import annotations

import numpy as np

from proto import worker_pb2

BLOCK_SIZE = 16


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
) -> worker_pb2.SequenceStep:
    needed = -(-(start_pos + len(token_ids)) // BLOCK_SIZE)
    sampling = worker_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    if seed is not None:
        sampling.seed = seed
    return worker_pb2.SequenceStep(
        seq_id=seq_id,
        token_ids=token_ids,
        start_pos=start_pos,
        block_table=table[:needed],
        slot_mapping=slots_for(table, start_pos, start_pos + len(token_ids)),
        sample=sample,
        sampling=sampling,
        return_logits=logits,
    )


def logits_of(token: worker_pb2.SampledToken) -> np.ndarray:
    return np.frombuffer(token.logits, dtype="<f4")


def by_seq(response: worker_pb2.StepResponse) -> dict[int, worker_pb2.SampledToken]:
    return {t.seq_id: t for t in response.sampled}
