"""Executes one validated step: block copies, one batched forward, sampling.

A step's inputs reach the device in one copy (upload.upload_batch); a
decode-only step replays a captured CUDA graph when the runner has them
(cuda_graphs.py); the only device sync is reading the sampled ids. The step
stays columns throughout: the batch is laid out from the step's columns, the
sampler reads the sampled rows' parameter columns, and the samples come back as
columns (SampledRows).

Entry points: `execute(step)` (a step, sampled), `logits(step)` (the sampling
rows' logits, nothing sampled or kept: start-up check, benchmarks),
`forward(batch)` (the eager forward a graph captures), and
`capture_graphs` / `drop_graphs` (the runner owns its graphs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.attention.cache_attention import CacheAttention
from worker_svc.attention.kv_cache import KVCachePool
from worker_svc.lora import LoraSlots
from worker_svc.models import DecoderModel
from worker_svc.runner.batch import ForwardBatch, HostBatch, check_references, plan_batch
from worker_svc.runner.cuda_graphs import DecodeGraphs, GraphBackend
from worker_svc.runner.last_samples import LastSamples
from worker_svc.runner.late_masks import LateMasks
from worker_svc.runner.pooling import pool_rows
from worker_svc.runner.upload import InputUploader, upload_batch
from worker_svc.sampling.packed import HostPairs, Packed, TokenSampler
from worker_svc.sampling.params import LogprobIndices, SamplingParams
from worker_svc.sampling.prompt_logprobs import PromptRows
from worker_svc.sampling.verify import verify_drafts
from worker_svc.step.input import BoolArray, IntArray, SeqColumns, StepInput, TokenMasks, UIntArray, ranges
from worker_svc.step.output import PromptLogprobsOut, SampledRows, StepOutput
from worker_svc.step.validation import check_late_rows

_NONE = np.zeros(0, dtype=np.int64)


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        cache: KVCachePool,
        sampler: TokenSampler,
        prefill_route: str = "paged",
        lora: LoraSlots | None = None,
    ):
        """`lora`: the adapter slots the model's projections were built with (its hook)."""
        self.model = model
        self.lora = lora
        self.cache = cache
        self.sampler = sampler
        self.prefill_route = prefill_route  # prefill_route.prefill_route: "paged" | "sdpa"
        self.uploader = InputUploader(model.device)
        self._graphs: DecodeGraphs | None = None
        self.last_samples: LastSamples | None = None
        self.late_masks = LateMasks()  # filled by StepMasks calls (Worker.deliver_masks)

    # ---- decode graphs ------------------------------------------------------------
    @property
    def graphs(self) -> DecodeGraphs | None:
        """The captured decode graphs that steps replay (None: every step runs eager)."""
        return self._graphs

    def capture_graphs(self, backend: GraphBackend, max_num_seqs: int, table_width: int) -> DecodeGraphs:
        """Captures a decode graph per ladder size over this runner's forward; from
        now on the decode-only steps they cover replay them."""
        graphs = DecodeGraphs(self.forward, backend, self.model.device, max_num_seqs, table_width)
        with torch.inference_mode():
            graphs.capture()
        self._graphs = graphs
        return graphs

    def drop_graphs(self) -> None:
        self._graphs = None

    # ---- forward ------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The eager forward: hidden states [T, hidden] of the batch's rows. Sync-free
        on CUDA with the Triton backend, so cuda_graphs can capture it."""
        spec = self.model.spec
        attention = CacheAttention(
            self.cache, batch.attention, spec.attention_scale, self.prefill_route, spec.attn_softcap
        )
        if self.lora is not None:  # read by the adapted projections (in a captured graph: this buffer)
            self.lora.token_slots = batch.lora_slots
        return self.model.forward(batch.input_ids, batch.positions, attention)

    def _prepare(
        self, step: StepInput, previous: LastSamples | None, ref_sources: IntArray | None, use_graphs: bool
    ) -> tuple[HostBatch, ForwardBatch, DecodeGraphs | None]:
        """The step on the device (one copy), through the graphs' buffer when they cover it."""
        host = plan_batch(step, self.prefill_route == "sdpa", ref_sources)
        batch, graphs = self._upload(host, previous, use_graphs)
        return host, batch, graphs

    def _upload(
        self,
        host: HostBatch,
        previous: LastSamples | None,
        use_graphs: bool,
        extra: Sequence[npt.NDArray[np.int64]] = (),
    ) -> tuple[ForwardBatch, DecodeGraphs | None]:
        graphs = self._graphs if use_graphs and self._graphs is not None and self._graphs.covers(host) else None
        if graphs is not None:
            return graphs.upload(host, previous, extra), graphs
        return upload_batch(host, self.uploader, previous, extra=extra), None

    def _hidden(self, batch: ForwardBatch, graphs: DecodeGraphs | None) -> torch.Tensor:
        """Block copies first (the forward may read the copies), then the forward."""
        if batch.copy_src is not None and batch.copy_dst is not None:
            self.cache.copy_blocks(batch.copy_src, batch.copy_dst)
        return graphs.replay(batch) if graphs is not None else self.forward(batch)

    def _verify(
        self,
        inner: torch.Tensor,
        verify_rows: torch.Tensor,
        batch: ForwardBatch,
        host: HostBatch,
        packed: Packed,
        seqs: SeqColumns,
    ) -> torch.Tensor:
        """Verification of the rows with drafts (sampling/verify.py) from the logits
        `inner` at their positions before the last (verify_rows, host.verify_rows on the
        device): each one's bonus token replaces its sample in `packed` (in place, so
        LastSamples and the host copy see it); returns what rides in that copy after it:
        [R + D, 2] float64, a row (accepted, 0) per drafting row, then (0, logprob) per
        inner position."""
        device = inner.device
        drafts = batch.input_ids[verify_rows + 1]  # each inner position's next token is a draft
        rows = torch.from_numpy(host.draft_rows).to(device)
        params = SamplingParams.of_drafted_positions(seqs, host.sample_order[host.draft_rows])
        accepted, bonus, inner_logprobs = verify_drafts(
            self.sampler, inner, params, packed.tensor[rows], drafts, host.draft_counts
        )
        packed.tensor[rows] = bonus
        counted = torch.stack([accepted.double(), torch.zeros_like(accepted, dtype=torch.float64)], dim=1)
        return torch.cat([counted, torch.stack([torch.zeros_like(inner_logprobs), inner_logprobs], dim=1)])

    # ---- steps --------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, step: StepInput, use_graphs: bool = True) -> torch.Tensor:
        """fp32 logits of the step's sampling rows, nothing sampled or kept (the
        start-up check of the graphs, benchmarks)."""
        _, batch, graphs = self._prepare(step, None, None, use_graphs)
        return self.model.logits(self._hidden(batch, graphs)[batch.sample_rows])

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        t0 = time.perf_counter()
        ref_sources = check_references(step, self.last_samples)  # before anything is touched
        if not len(step.seqs):  # block copies only (validated: there are some)
            self.cache.copy_blocks(step.copies[:, 0], step.copies[:, 1])
            return StepOutput(step.step_id, SampledRows.empty(), 0, {"total_ms": _ms(t0)})
        previous, self.last_samples = self.last_samples, None  # a failed step leaves nothing to name
        host = plan_batch(step, self.prefill_route == "sdpa", ref_sources)
        prompt = PromptRows.of(step.seqs, host.order)  # None unless a chunk asks for prompt logprobs
        params = SamplingParams.of_rows(
            step.seqs,
            host.sample_order,
            None if prompt is None else prompt.scoring,
            lambda: batch.input_ids[batch.sample_rows],
            self._token_masks(step),
        )
        # The logprob paths' indices (and the prompt rows' batch rows) ride in the step's one upload.
        extra = (
            [*params.index_arrays(), prompt.rows if prompt is not None else _NONE]
            if params.asks_logprob_indices
            else []
        )
        batch, graphs = self._upload(host, previous, use_graphs=True, extra=extra)
        t1 = time.perf_counter()
        hidden = self._hidden(batch, graphs)
        samples = SampledRows.empty()
        prompt_logprobs: list[PromptLogprobsOut] = []
        t2 = time.perf_counter()
        if host.sample_order.size or prompt is not None:
            # Sampled positions first, then the prompt-logprob positions, then the drafting
            # rows' inner positions: one lm_head call (its weights read once, not twice).
            rows = batch.sample_rows
            if extra:
                *indices, prompt_rows = batch.extra
                params = dataclasses.replace(params, indices=LogprobIndices(*indices))
                if prompt is not None:
                    rows = torch.cat([rows, prompt_rows])
            scored = len(rows)
            verify_rows = torch.from_numpy(host.verify_rows).to(rows.device) if host.verify_rows.size else None
            if verify_rows is not None:
                rows = torch.cat([rows, verify_rows])
            everything_logits = self.model.logits(hidden[rows])
            logits, inner = everything_logits[:scored], everything_logits[scored:]
            t2 = time.perf_counter()
            packed = self.sampler.sample_packed(logits, params)  # on the device
            accepted = None
            if verify_rows is not None:
                accepted = self._verify(inner, verify_rows, batch, host, packed, step.seqs)
            # The ids stay on the device for the next step's decodes; one copy brings all results here.
            seq_ids = step.seqs.seq_ids[host.sample_order]
            self.last_samples = _last_samples(step.step_id, seq_ids, packed.token_ids, host.draft_rows)
            everything = packed.tensor if accepted is None else torch.cat([packed.tensor, accepted])
            pairs = everything.cpu().numpy()
            pairs, drafted = pairs[: len(packed.tensor)], _drafted(pairs[len(packed.tensor) :], host)
            return_logits = step.seqs.return_logits[host.sample_order]
            samples = _sampled_rows(seq_ids, pairs, packed, params, return_logits, logits, *drafted)
            if prompt is not None:
                prompt_logprobs = prompt.unpack(pairs, packed.layout)
        pooled = pool_rows(step.seqs, host.order, hidden)
        t3 = time.perf_counter()
        timings = {
            "prepare_ms": (t1 - t0) * 1e3,
            "forward_ms": (t2 - t1) * 1e3,
            "sample_ms": (t3 - t2) * 1e3,
            "total_ms": (t3 - t0) * 1e3,
        }
        return StepOutput(step.step_id, samples, len(step.seqs.token_ids), timings, prompt_logprobs, pooled)

    def _token_masks(self, step: StepInput) -> Callable[[], TokenMasks] | None:
        """The step's masks for the sampler: those it carries, and those of its
        SEQ_FLAG_MASK_FOLLOWS rows, waited for only when the sampler asks."""
        inline, late_rows = step.seqs.masks, step.seqs.late_mask_rows
        if not late_rows.size:
            return None if inline is None else (lambda: inline)

        def with_late() -> TokenMasks:
            late, field_name = self.late_masks.take(step.step_id)
            check_late_rows(field_name, step.step_id, late, late_rows)
            return late if inline is None else TokenMasks.join([inline, late])

        return with_late


def _last_samples(step_id: int, seq_ids: UIntArray, token_ids: torch.Tensor, draft_rows: IntArray) -> LastSamples:
    """What the next step may name: not the rows that verified drafts, whose next input
    depends on how many were accepted (and which only rank 0 of a tensor-parallel
    worker verifies: the other ranks' ids there are not the model's)."""
    if not draft_rows.size:
        return LastSamples(step_id, seq_ids, token_ids)
    keep = np.ones(len(seq_ids), dtype=bool)
    keep[draft_rows] = False
    rows = np.flatnonzero(keep)
    return LastSamples(step_id, seq_ids[rows], token_ids[torch.from_numpy(rows).to(token_ids.device)])


def _drafted(rows: HostPairs, host: HostBatch) -> tuple[IntArray, npt.NDArray[np.float64]]:
    """From _verify's rows of the host copy: [N] drafts accepted per sampled row, and
    the accepted drafts' logprobs, row after row; both empty without drafts."""
    if not host.draft_rows.size:
        return _NONE, np.zeros(0)
    num = len(host.draft_rows)
    accepted = rows[:num, 0].astype(np.int64)
    out = np.zeros(len(host.sample_order), dtype=np.int64)
    out[host.draft_rows] = accepted
    starts = np.cumsum(host.draft_counts) - host.draft_counts
    return out, rows[num:, 1][ranges(starts, accepted)]


def _sampled_rows(
    seq_ids: UIntArray,
    pairs: HostPairs,
    packed: Packed,
    params: SamplingParams,
    return_logits: BoolArray,
    logits: torch.Tensor,
    num_accepted: IntArray,
    draft_logprobs: npt.NDArray[np.float64],
) -> SampledRows:
    """The samples' columns from the packed host copy: ids and logprobs sliced out
    whole; alternatives (cut to what each row asked) and logits rows only for the
    rows that asked."""
    n = len(seq_ids)
    return SampledRows(
        seq_ids=seq_ids,
        token_ids=pairs[:n, 0].astype(np.int64),
        logprobs=pairs[:n, 1].copy(),
        top={i: block[: params.extras[i].top_logprobs] for i, block in packed.layout.top(pairs).items()},
        logits=_logits_rows(logits, np.flatnonzero(return_logits)),
        num_accepted=num_accepted,
        draft_logprobs=draft_logprobs,
    )


def _logits_rows(logits: torch.Tensor, rows: IntArray) -> dict[int, torch.Tensor]:
    """The asked rows' logits on the host, in one copy (after the step's sync)."""
    if not rows.size:
        return {}
    host = logits[torch.from_numpy(rows).to(logits.device)].cpu()
    return {int(i): row for i, row in zip(rows, host)}


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
