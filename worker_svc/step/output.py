"""What a step returns, as columns (server.py converts it to worker.v1)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.step.input import IntArray, UIntArray


@dataclass(frozen=True, slots=True)
class SampledRows:
    """A step's samples as columns, one row per sampling sequence in batch order,
    taken out of the sampler's one host copy without a Python object per row."""

    seq_ids: UIntArray  # [N]
    token_ids: IntArray  # [N]
    logprobs: npt.NDArray[np.float64]  # [N]
    # Only the rows that asked: row -> [k, 2] (id, logprob) alternatives; row -> fp32 [vocab] logits.
    top: dict[int, npt.NDArray[np.float64]] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    # Speculative decoding: [N] drafts accepted per row (token_ids then follows them);
    # empty when the step carried no drafts.
    num_accepted: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # The accepted drafts' logprobs (raw distribution), row after row: sum(num_accepted).
    draft_logprobs: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def empty(cls) -> SampledRows:
        return cls(np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.float64))

    def __len__(self) -> int:
        return len(self.seq_ids)


@dataclass(frozen=True, slots=True)
class PromptLogprobsOut:
    seq_id: int
    logprobs: npt.NDArray[np.float32]  # [targets]
    top_token_ids: IntArray  # [targets * top_n], row after row
    top_logprobs: npt.NDArray[np.float32]  # [targets * top_n]


@dataclass(frozen=True, slots=True)
class PooledRows:
    """The pooling rows' reduced hidden states (runner/pooling.py), in step row order."""

    seq_ids: UIntArray  # [P]
    values: npt.NDArray[np.float32]  # [P, hidden]


@dataclass(slots=True)
class StepOutput:
    step_id: int
    samples: SampledRows
    num_tokens: int
    timings_ms: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[PromptLogprobsOut] = field(default_factory=list)
    pooled: PooledRows | None = None
