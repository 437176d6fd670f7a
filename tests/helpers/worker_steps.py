"""Worker steps written row by row, as tests read best, and their samples read
back row by row. The worker itself keeps a step as columns; these build them
(step.builder.StepBuilder) and take them apart.

    step = step_input(1, [], [Seq(7, [5, 6], 0, [3], [48, 49], sample=True)])
    [token] = sampled(worker.step(step))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from worker_svc.sampling.params import PromptScoring, SamplingParams
from worker_svc.sampling.sampler import Sampler
from worker_svc.step.builder import StepBuilder
from worker_svc.step.input import Penalties, RowExtras, SamplingColumns, StepInput
from worker_svc.step.output import StepOutput

if TYPE_CHECKING:
    from worker_svc.worker import Worker


@dataclass(frozen=True)
class Sampling:
    """One row's sampling options, as a request states them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    top_logprobs: int = 0
    blocked_token_ids: Sequence[int] = ()
    logit_bias_token_ids: Sequence[int] = ()
    logit_bias_values: Sequence[float] = ()
    penalties: Penalties | None = None

    def extras(self, prompt_targets: Sequence[int] = (), prompt_top: int = 0) -> RowExtras | None:
        extras = RowExtras(
            self.top_logprobs,
            self.blocked_token_ids,
            self.logit_bias_token_ids,
            self.logit_bias_values,
            self.penalties,
            prompt_targets,
            prompt_top,
        )
        return None if extras == RowExtras() else extras

    @property
    def processes_logits(self) -> bool:
        extras = self.extras()
        return extras is not None and extras.processes_logits

    def step_row(self) -> dict[str, float | int | None]:
        """StepBuilder.add's sampling keywords."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed, min_p=self.min_p)


def sampling_params(
    rows: Sequence[Sampling],
    positions: Sequence[int],
    prompt: PromptScoring | None = None,
    input_ids: Callable[[], torch.Tensor] | None = None,
) -> SamplingParams:
    """The columns the sampler reads, for rows sampled at `positions`."""
    columns = SamplingColumns(
        np.array([r.temperature for r in rows], dtype=np.float32),
        np.array([r.top_p for r in rows], dtype=np.float32),
        np.array([r.top_k for r in rows], dtype=np.int64),
        np.array([r.seed or 0 for r in rows], dtype=np.uint64),
        np.array([r.seed is not None for r in rows], dtype=bool),
        np.array([r.min_p for r in rows], dtype=np.float32),
    )
    extras = {i: e for i, r in enumerate(rows) if (e := r.extras()) is not None}
    return SamplingParams(columns, np.array(positions, dtype=np.int64).reshape(-1), extras, prompt, input_ids)


def sample(
    sampler: Sampler, logits: torch.Tensor, rows: Sequence[Sampling], positions: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> on the host (token ids [N], logprobs [N] under the unscaled distribution)."""
    packed = sampler.sample_packed(logits, sampling_params(rows, positions)).tensor[: len(rows)].cpu()
    return packed[:, 0].long(), packed[:, 1].float()


@dataclass
class Seq:
    """One row of a step."""

    seq_id: int
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    slot_mapping: Sequence[int]
    sample: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    return_logits: bool = False
    # The input is the token this sequence sampled in the previous step (token_ids holds a placeholder).
    token_from_previous_step: bool = False
    prompt_logprob_targets: Sequence[int] = ()
    prompt_top_logprobs: int = 0


def step_input(
    step_id: int, copies: Sequence[tuple[int, int]], seqs: Sequence[Seq], previous_step_id: int | None = None
) -> StepInput:
    builder = StepBuilder()
    for s in seqs:
        extras = s.sampling.extras(s.prompt_logprob_targets, s.prompt_top_logprobs)
        rows = (s.seq_id, s.token_ids, s.start_pos, s.block_table, s.slot_mapping)
        flags = dict(sample=s.sample, return_logits=s.return_logits, from_previous=s.token_from_previous_step)
        builder.add(*rows, **flags, **s.sampling.step_row(), extras=extras)
    return builder.build(step_id, copies, previous_step_id)


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float
    logits: torch.Tensor | None = None
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


def sampled(out: StepOutput) -> list[SampledToken]:
    """A step's samples row by row, in the worker's batch order."""
    rows = out.samples
    tokens = []
    for i in range(len(rows)):
        top = rows.top.get(i)
        ids, logprobs = ([], []) if top is None else (top[:, 0].astype(int).tolist(), top[:, 1].tolist())
        token = SampledToken(int(rows.seq_ids[i]), int(rows.token_ids[i]), float(rows.logprobs[i]))
        token.logits, token.top_token_ids, token.top_logprobs = rows.logits.get(i), ids, logprobs
        tokens.append(token)
    return tokens


def chunked_greedy(
    worker: Worker, prompt: Sequence[int], chunk: int, table: Sequence[int], seq_id: int, decode_steps: int
) -> tuple[list[torch.Tensor | None], list[int]]:
    """One sequence through `worker` (16-token blocks `table`): its prompt prefilled in
    `chunk`-token steps, then `decode_steps` greedy decodes: (each sample's logits, tokens)."""

    def slots(start: int, end: int) -> list[int]:
        return [table[p // 16] * 16 + p % 16 for p in range(start, end)]

    logits: list[torch.Tensor | None] = []
    tokens: list[int] = []
    pos, step_id = 0, seq_id * 1000
    while pos < len(prompt):
        end = min(pos + chunk, len(prompt))
        sample = end == len(prompt)
        rows = [Seq(seq_id, prompt[pos:end], pos, table, slots(pos, end), sample, return_logits=sample)]
        out = worker.step(step_input(step_id, [], rows))
        step_id, pos = step_id + 1, end
    for _ in range(decode_steps):
        token = sampled(out)[0]
        logits.append(token.logits)
        tokens.append(token.token_id)
        rows = [Seq(seq_id, [token.token_id], pos, table, slots(pos, pos + 1), True, return_logits=True)]
        out = worker.step(step_input(step_id, [], rows))
        step_id, pos = step_id + 1, pos + 1
    return logits, tokens
