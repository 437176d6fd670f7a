"""Executes one validated step: block copies, one batched forward, sampling.

A step's inputs reach the device in one copy (forward_batch.upload_batch); a
decode-only step replays a captured CUDA graph when the worker has them
(worker_svc/cuda_graphs.py); the only device sync is reading the sampled ids.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from worker_svc.attention import CacheAttention
from worker_svc.cuda_graphs import DecodeGraphs
from worker_svc.forward_batch import (
    ForwardBatch,
    InputUploader,
    check_references,
    plan_batch,
    resolve_references,
    upload_batch,
)
from worker_svc.kv_cache import KVCachePool
from worker_svc.models import DecoderModel
from worker_svc.prompt_logprobs import PromptLogprobsOut, PromptRows
from worker_svc.sampler import Sampler
from worker_svc.step_input import StepInput


@dataclass(slots=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float
    logits: torch.Tensor | None = None
    top_token_ids: list[int] = field(default_factory=list)  # Sampling.top_logprobs most likely
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LastSamples:
    """The token ids the last step sampled, kept where they were sampled (on the
    device) for the decodes of a step planned ahead, which name them instead of
    carrying them. Only the last step's: a worker keeps no other request state."""

    step_id: int
    rows: dict[int, int]  # seq_id -> row of token_ids
    token_ids: torch.Tensor


@dataclass(frozen=True, slots=True)
class SampledRows:
    """A step's samples as columns, one row per sampling sequence in batch order,
    taken out of the sampler's one host copy without a Python object per row."""

    seq_ids: np.ndarray  # [N] int64
    token_ids: np.ndarray  # [N] int64
    logprobs: np.ndarray  # [N] float64
    top: dict[int, np.ndarray] = field(default_factory=dict)  # row -> [k, 2] (id, logprob), rows that asked
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> fp32 [vocab], rows that asked

    @classmethod
    def empty(cls) -> SampledRows:
        return cls.of({})

    @classmethod
    def of(cls, sampled: Mapping[int, tuple[int, float]]) -> SampledRows:
        """From seq_id -> (token id, logprob), e.g. a reply read back (benchmarks)."""
        pairs = np.array(list(sampled.values()), dtype=np.float64).reshape(-1, 2)
        return cls(np.array(list(sampled), dtype=np.int64), pairs[:, 0].astype(np.int64), pairs[:, 1])

    def __len__(self) -> int:
        return len(self.seq_ids)

    def row(self, i: int) -> SampledToken:
        top = self.top.get(i)
        ids, logprobs = ([], []) if top is None else (top[:, 0].astype(int).tolist(), top[:, 1].tolist())
        token_id, logprob = int(self.token_ids[i]), float(self.logprobs[i])
        return SampledToken(int(self.seq_ids[i]), token_id, logprob, self.logits.get(i), ids, logprobs)


@dataclass(slots=True)
class StepOutput:
    step_id: int
    samples: SampledRows
    num_tokens: int
    timings_ms: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[PromptLogprobsOut] = field(default_factory=list)

    @property
    def sampled(self) -> list[SampledToken]:
        """The samples row by row (tests, benchmarks; the server reads the columns)."""
        return [self.samples.row(i) for i in range(len(self.samples))]


class ModelRunner:
    def __init__(
        self, model: DecoderModel, cache: KVCachePool, attention_ops, sampler: Sampler, prefill_route: str = "paged"
    ):
        self.model = model
        self.cache = cache
        self.ops = attention_ops
        self.sampler = sampler
        self.prefill_route = prefill_route  # attention.prefill_route: "paged" | "sdpa"
        self.uploader = InputUploader(model.device)
        self.graphs: DecodeGraphs | None = None  # set by the worker once captured and checked
        self.last_samples: LastSamples | None = None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The eager forward: hidden states [T, hidden] of the batch's rows. Sync-free
        on CUDA with the Triton backend, so cuda_graphs can capture it."""
        scale = self.model.spec.attention_scale
        attention = CacheAttention(self.ops, self.cache, batch, scale, self.prefill_route)
        return self.model.forward(batch.input_ids, batch.positions, attention)

    def _prepare(
        self, step: StepInput, previous: LastSamples | None, use_graphs: bool
    ) -> tuple[ForwardBatch, DecodeGraphs | None]:
        """The step on the device (one copy), through the graphs' buffer when they cover it."""
        host = plan_batch(step, split_fresh=self.prefill_route == "sdpa")
        resolve_references(host, previous)
        graphs = self.graphs if use_graphs and self.graphs is not None and self.graphs.covers(host) else None
        if graphs is not None:
            return graphs.upload(host, previous), graphs
        return upload_batch(host, self.uploader, previous), None

    def _hidden(self, batch: ForwardBatch, graphs: DecodeGraphs | None) -> torch.Tensor:
        """Block copies first (the forward may read the copies), then the forward."""
        if batch.copy_src is not None:
            self.cache.copy_blocks(batch.copy_src, batch.copy_dst)
        return graphs.replay(batch) if graphs is not None else self.forward(batch)

    @torch.inference_mode()
    def logits(self, step: StepInput, use_graphs: bool = True) -> torch.Tensor:
        """fp32 logits of the step's sampling rows, nothing sampled or kept (the
        start-up check of the graphs, benchmarks)."""
        batch, graphs = self._prepare(step, None, use_graphs)
        return self.model.logits(self._hidden(batch, graphs)[batch.sample_rows])

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        t0 = time.perf_counter()
        check_references(step, self.last_samples)  # before anything is touched
        if not step.seqs:  # block copies only (validated: there are some)
            batch, _ = self._prepare(step, None, use_graphs=False)
            self.cache.copy_blocks(batch.copy_src, batch.copy_dst)
            return StepOutput(step.step_id, SampledRows.empty(), 0, {"total_ms": _ms(t0)})
        previous, self.last_samples = self.last_samples, None  # a failed step leaves nothing to name
        batch, graphs = self._prepare(step, previous, use_graphs=True)
        t1 = time.perf_counter()
        hidden = self._hidden(batch, graphs)
        samples = SampledRows.empty()
        prompt_logprobs: list[PromptLogprobsOut] = []
        t2 = time.perf_counter()
        prompt = PromptRows.of(batch.seqs)  # None unless a chunk asks for prompt logprobs
        if batch.sample_seqs or prompt is not None:
            # Sampled positions first, then the prompt-logprob positions: one lm_head call.
            rows = (
                batch.sample_rows
                if prompt is None
                else torch.cat([batch.sample_rows, prompt.rows_on(self.model.device)])
            )
            logits = self.model.logits(hidden[rows])
            t2 = time.perf_counter()
            params = [s.sampling for s in batch.sample_seqs]
            positions = [s.context_len for s in batch.sample_seqs]
            packed = self.sampler.sample_packed(
                logits, params, positions, prompt and prompt.scoring, lambda: batch.input_ids[batch.sample_rows]
            )  # on the device
            # The ids stay on the device for the next step's decodes; one copy brings all results here.
            by_seq = {s.seq_id: i for i, s in enumerate(batch.sample_seqs)}
            self.last_samples = LastSamples(step.step_id, by_seq, packed.token_ids)
            host = packed.tensor.cpu().numpy()
            samples = _sampled_rows(batch, host, packed.layout.top(host), logits)
            if prompt is not None:
                prompt_logprobs = prompt.unpack(host, packed.layout)
        t3 = time.perf_counter()
        timings = {
            "prepare_ms": (t1 - t0) * 1e3,
            "forward_ms": (t2 - t1) * 1e3,
            "sample_ms": (t3 - t2) * 1e3,
            "total_ms": (t3 - t0) * 1e3,
        }
        return StepOutput(step.step_id, samples, len(step.arrays.token_ids), timings, prompt_logprobs)


def _sampled_rows(
    batch: ForwardBatch, host: np.ndarray, tops: dict[int, np.ndarray], logits: torch.Tensor
) -> SampledRows:
    """The samples' columns from the packed host copy: ids and logprobs sliced out
    whole; alternatives (cut to what each row asked) and logits rows only for the
    rows that asked."""
    seqs = batch.sample_seqs
    n = len(seqs)
    return SampledRows(
        seq_ids=np.fromiter((s.seq_id for s in seqs), dtype=np.int64, count=n),
        token_ids=host[:n, 0].astype(np.int64),
        logprobs=host[:n, 1].copy(),
        top={i: block[: seqs[i].sampling.top_logprobs] for i, block in tops.items()},
        logits={i: logits[i].cpu() for i, s in enumerate(seqs) if s.return_logits},
    )


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
