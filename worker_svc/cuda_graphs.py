"""CUDA graphs for decode-only steps.

A decode step of a small model is hundreds of tiny kernels; launched one by one
from Python the GPU waits on the CPU. A captured graph replays them all in one
launch. Graphs need fixed shapes and fixed addresses, so:

* a ladder of batch sizes (1, 2, 4, 8, then every 8 up to --max-num-seqs) is
  captured at start-up, and a decode batch is padded up to the next rung
  (forward_batch.pad_decode says what a padding row does: writes nothing, reads
  one finite position);
* every input the forward reads (ids, positions, slots, block tables as wide as
  the longest sequence allowed, context lengths) lives in one persistent device
  buffer, which each step fills with its one host->device copy
  (forward_batch.upload_batch into that buffer) before replaying;
* prefill and mixed steps, bigger batches, and steps whose tables or block
  copies do not fit stay eager.

The capture goes through a `GraphBackend`: `CudaGraphBackend` records real
graphs; `EagerReplay` runs the forward again at each replay, so on CPU the same
buffer filling, padding and un-padding run and can be tested against eager.
`check_against_eager` compares one captured size with the eager forward at
start-up; the worker drops its graphs (one warning) if they differ.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import structlog
import torch

from worker_svc.forward_batch import (
    ForwardBatch,
    HostBatch,
    HostGroup,
    InputUploader,
    packed_layout,
    pad_decode,
    upload_batch,
)
from worker_svc.sampler import Sampler
from worker_svc.step_input import Sampling, SeqInput, StepInput

if TYPE_CHECKING:
    from worker_svc.model_runner import LastSamples, ModelRunner

log = structlog.get_logger(__name__)

Replay = Callable[[], torch.Tensor]


def batch_ladder(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then steps of 8, up to max_num_seqs (always included)."""
    assert max_num_seqs >= 1, max_num_seqs
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def ladder_rung(ladder: list[int], num_seqs: int) -> int | None:
    """The smallest captured size holding num_seqs, None past the top."""
    i = bisect.bisect_left(ladder, num_seqs)
    return ladder[i] if i < len(ladder) else None


class GraphBackend(Protocol):
    def capture(self, forward: Replay) -> Replay:
        """Record `forward` (over persistent buffers); the replay returns its output."""


class CudaGraphBackend:
    """torch.cuda.CUDAGraph, all graphs in one memory pool: captured largest first,
    the smaller ones reuse the largest one's activation memory."""

    def __init__(self, device: torch.device):
        assert device.type == "cuda", f"CUDA graphs need a CUDA device, got {device}"
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Replay) -> Replay:
        forward()  # compiles every Triton specialisation this size needs, outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerReplay:
    """No graph: each replay runs the forward again, over the same persistent buffers."""

    def capture(self, forward: Replay) -> Replay:
        forward()
        return forward


class DecodeGraphs:
    """The captured decode forwards, one per ladder size, and their input buffer."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        backend: GraphBackend,
        device: torch.device,
        max_num_seqs: int,
        table_width: int,
    ):
        self.forward = forward
        self.backend = backend
        self.ladder = batch_ladder(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.table_width = table_width  # blocks per table: the longest sequence the worker serves
        self.uploader = InputUploader(device)
        # The top rung's inputs plus the rest of a step's upload (samples, references, copies).
        self.buffer = torch.zeros(_buffer_words(max_num_seqs, table_width), dtype=torch.int32, device=device)
        self.replays: dict[int, Replay] = {}

    def capture(self) -> None:
        for size in reversed(self.ladder):  # largest first: see CudaGraphBackend
            batch = upload_batch(padding_batch(size, self.table_width), self.uploader, into=self.buffer)
            self.replays[size] = self.backend.capture(lambda batch=batch: self.forward(batch))

    def covers(self, host: HostBatch) -> bool:
        """A decode-only batch within the ladder whose tables and copies fit the buffer."""
        return (
            host.decode_only
            and host.decode is not None
            and host.num_tokens <= self.max_num_seqs
            and host.decode.block_tables.shape[1] <= self.table_width
            and host.copies.shape[1] <= self.max_num_seqs
        )

    def upload(self, host: HostBatch, previous: LastSamples | None = None) -> ForwardBatch:
        """The batch padded to its rung, copied into the captured graph's inputs."""
        size = ladder_rung(self.ladder, host.num_tokens)
        assert size is not None and self.covers(host), "not a batch the graphs cover"
        return upload_batch(pad_decode(host, size, self.table_width), self.uploader, previous, into=self.buffer)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of the padded batch [size, hidden]; the real rows come first."""
        return self.replays[batch.input_ids.shape[0]]()


def padding_batch(size: int, table_width: int) -> HostBatch:
    """`size` padding rows and no real ones: what each graph is captured over."""
    empty = np.zeros(0, dtype=np.int64)
    host = HostBatch(
        input_ids=empty,
        positions=empty,
        slot_mapping=empty,
        decode=HostGroup(np.zeros((0, 1), np.int32), np.zeros(0, np.int32), np.zeros(1, np.int32)),
        fresh=None,
        prefill=None,
        sample_rows=empty,
        ref_rows=empty,
        ref_sources=empty,
        copies=np.zeros((2, 0), dtype=np.int64),
        seqs=[],
        sample_seqs=[],
    )
    return pad_decode(host, size, table_width)


def _buffer_words(max_num_seqs: int, table_width: int) -> int:
    """Words of the largest upload a covered step makes: the top rung's inputs, a
    sample and a reference per row, and up to max_num_seqs block copies."""
    rows = np.zeros(max_num_seqs, dtype=np.int64)
    shapes = [
        rows,
        rows,
        rows,
        np.zeros((max_num_seqs, table_width), np.int32),
        np.zeros(max_num_seqs, np.int32),
        np.zeros(max_num_seqs + 1, np.int32),
        rows,
        rows,
        rows,
        np.zeros((2, max_num_seqs), np.int64),
    ]
    return packed_layout(shapes)[1]


def decode_peak_bytes(runner: ModelRunner, max_num_seqs: int, table_width: int) -> int:
    """Device memory a decode of max_num_seqs rows takes beyond what is allocated
    (activations, split-KV partials, logits): what the graphs' shared pool will
    hold, measured by one eager run over `runner`'s (scratch, one-block) cache
    before the KV pool is sized. CUDA only."""
    device = runner.model.device
    assert device.type == "cuda", device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        batch = upload_batch(padding_batch(max_num_seqs, table_width), InputUploader(device))
        runner.model.logits(runner.forward(batch))
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# --------------------------------------------------------------------------- start-up check

CHECK_SEQS = 3  # padded to the rung of 4: the check covers padding too
CHECK_PROMPT = 5  # tokens per sequence before the checked decode (within one block of any size)
CHECK_FIRST_CHUNK = 3  # the prompt goes in two chunks
LOGIT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 5e-2}  # of max |logit|


def start_up_check(runner: ModelRunner, graphs: DecodeGraphs | None, num_blocks: int) -> str | None:
    """An eager prefill (in two chunks) and decode of a few sequences (compiling
    the kernels a first request runs, and sampling once), then the same decode through `graphs`:
    None when they agree (compare_logits), else what differs. Uses blocks (or
    contiguous slots) 0..n-1 and zeroes them after: the pool is unused at start."""
    n = min(CHECK_SEQS, graphs.max_num_seqs if graphs else CHECK_SEQS, num_blocks)
    block_size = runner.cache.block_size
    prompt = CHECK_PROMPT  # block sizes are >= 8: the prompt and the decoded token fit one block
    vocab = runner.model.spec.vocab_size

    def seqs(start: int, length: int) -> list[SeqInput]:
        return [
            SeqInput(
                seq_id=i,
                token_ids=[(7 + 13 * i + 31 * p) % vocab for p in range(start, start + length)],
                start_pos=start,
                block_table=[i],
                slot_mapping=[i * block_size + p for p in range(start, start + length)],
                sample=True,
            )
            for i in range(n)
        ]

    try:
        # Two chunks: the first starts at 0 (the SDPA route where it is on), the second continues it (paged).
        runner.logits(StepInput(0, [], seqs(0, CHECK_FIRST_CHUNK)), use_graphs=False)
        runner.logits(StepInput(0, [], seqs(CHECK_FIRST_CHUNK, prompt - CHECK_FIRST_CHUNK)), use_graphs=False)
        decode = StepInput(1, [], seqs(prompt, 1))
        eager = runner.logits(decode, use_graphs=False)
        # A throwaway sampler: the worker's own generator must not move.
        mixed = [Sampling(), Sampling(temperature=0.8, top_p=0.9, top_k=20, seed=0)]
        Sampler(0).sample_packed(eager.repeat(2, 1), mixed * n, [prompt] * 2 * n).tensor.cpu()
        if runner.model.device.type == "cuda":
            _compile_split_variants(runner)
        if graphs is None:
            return None
        assert runner.graphs is graphs, "the runner must hold the graphs under check"
        graph = runner.logits(decode, use_graphs=True)
    finally:
        runner.cache.zero_blocks(range(n))
    return compare_logits(graph, eager, runner.model.dtype)


def _compile_split_variants(runner: ModelRunner) -> None:
    """Eager decodes (those of mixed steps) pick their split-KV partition count
    from their table width: compile each count's merge kernel now, through one
    1-row decode per power of two over a table that wide (reading block 0)."""
    from kernels.triton_ops import MAX_SPLITS, MIN_SPLIT_TOKENS

    splits = 2
    with torch.inference_mode():
        while splits <= MAX_SPLITS:
            width = -(-splits * MIN_SPLIT_TOKENS // runner.cache.block_size)
            runner.forward(upload_batch(padding_batch(1, width), runner.uploader))
            splits *= 2


def compare_logits(graph: torch.Tensor, eager: torch.Tensor, model_dtype: torch.dtype) -> str | None:
    """None when the graph's logits match eager's: every greedy token the same
    (unless eager's best two are within the tolerance: a near tie either way is
    right), and every logit within the model dtype's tolerance of the largest."""
    tol = LOGIT_TOLERANCE.get(model_dtype, 1e-3) * max(1.0, float(eager.abs().max()))
    if not torch.isfinite(graph).all():
        return "the graph's logits are not finite"
    err = float((graph - eager).abs().max())
    if err > tol:
        return f"max |logit difference| {err:.3g} > {tol:.3g}"
    top2 = eager.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > tol
    if not torch.equal(graph.argmax(-1)[decided], eager.argmax(-1)[decided]):
        return "different greedy tokens"
    return None
