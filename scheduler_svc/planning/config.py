"""The planner's settings (the scheduler's flags of the same names) and their checks."""

from __future__ import annotations

from dataclasses import dataclass, fields

from scheduler_svc.planning import budget
from scheduler_svc.planning.validation import SCHEDULING_POLICIES
from scheduler_svc.speculative.ngram import NgramConfig


@dataclass(slots=True)
class PlannerConfig:
    max_num_batched_tokens: int = 8192  # tokens per step, all sequences together
    max_num_seqs: int = 256  # sequences per step, and running at once
    chunk_size: int = 8192  # largest prefill chunk of one request per step
    max_model_len: int = 8192  # prompt + output tokens of one request
    max_waiting: int = 1024
    block_size: int = 16
    # Dynamic chunking: the prefill chunk shrinks from max to min as free KV
    # blocks run out (less memory taken per step while the pool is tight) and
    # grows back when plenty are free. Off: every chunk is up to chunk_size.
    dynamic_chunking: bool = False
    dynamic_chunk_min: int = 512
    dynamic_chunk_max: int = 2048
    speculative: NgramConfig | None = None  # n-gram drafts (speculation.can_draft: whose); None: off
    # Structured outputs: plan a constrained request's decode ahead of the token it
    # follows (its mask is sent late, once that token is known); off: such a decode
    # waits for the next plan made with nothing in flight ahead of it.
    constrained_ahead: bool = True
    # fcfs: admission in arrival order, the newest running request preempted first;
    # priority: by (priority, arrival) both ways (vLLM's --scheduling-policy).
    scheduling_policy: str = "fcfs"

    _MINIMUMS = {"max_model_len": 2}  # a prompt token plus a generated one

    def validate(self) -> PlannerConfig:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy (--scheduling-policy) must be one of {', '.join(SCHEDULING_POLICIES)}")
        for f in fields(self):
            value, low = getattr(self, f.name), self._MINIMUMS.get(f.name, 1)
            flag = "--" + f.name.replace("_", "-")
            if f.name in ("dynamic_chunking", "constrained_ahead", "scheduling_policy", "speculative"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(
                    f"{f.name} ({flag}) must be an integer >= {low} (valid range [{low}, inf)), got {value!r}"
                )
        if self.dynamic_chunk_min > self.dynamic_chunk_max:
            raise ValueError(
                f"dynamic_chunk_min (--dynamic-chunk-min) {self.dynamic_chunk_min} must be <= "
                f"dynamic_chunk_max (--dynamic-chunk-max) {self.dynamic_chunk_max} "
                f"(valid range [1, {self.dynamic_chunk_max}])"
            )
        if self.speculative is not None and (problems := self.speculative.problems()):
            raise ValueError("; ".join(problems))
        return self

    def chunk_limit(self, free_fraction: float) -> int:
        """Largest prefill chunk of one request this step, given the free share of the pool."""
        return budget.chunk_limit(
            free_fraction,
            fixed=self.chunk_size,
            dynamic=self.dynamic_chunking,
            minimum=self.dynamic_chunk_min,
            maximum=self.dynamic_chunk_max,
            block_size=self.block_size,
        )
