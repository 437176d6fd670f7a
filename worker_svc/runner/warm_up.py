"""What a runner does before its worker serves: capture the decode graphs, then
the start-up check: an eager prefill and decode (every kernel a first request
runs gets compiled here), and the same decode through a graph, which must agree
with eager or the runner drops its graphs (one warning) and serves eager."""

from __future__ import annotations

import time

import numpy as np
import structlog
import torch

from worker_svc.runner.cuda_graphs import GraphBackend, padding_batch
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.upload import upload_batch
from worker_svc.sampling.params import SamplingParams
from worker_svc.sampling.sampler import Sampler
from worker_svc.step.builder import StepBuilder
from worker_svc.step.input import SamplingColumns, StepInput

log = structlog.get_logger(__name__)

CHECK_SEQS = 3  # padded to the rung of 4: the check covers padding too
CHECK_PROMPT = 5  # tokens per sequence before the checked decode (within one block of any size)
CHECK_FIRST_CHUNK = 3  # the prompt goes in two chunks
LOGIT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 5e-2}  # of max |logit|


def warm_up(
    runner: ModelRunner, graph_backend: GraphBackend | None, max_num_seqs: int, table_width: int, num_ids: int
) -> None:
    """Captures the decode graphs (if any), then runs start_up_check; a capture that
    raises or a graph that differs from eager leaves the runner without graphs."""
    start = time.perf_counter()
    if graph_backend is not None:
        try:
            runner.capture_graphs(graph_backend, max_num_seqs, table_width)
        except Exception as exc:  # a capture this torch/driver refuses: serve eager
            log.warning("cuda graphs off: capture failed", error=f"{type(exc).__name__}: {exc}")
    problem = start_up_check(runner, num_ids)
    if runner.graphs is not None and problem is not None:
        log.warning("cuda graphs off: a captured decode differs from eager", problem=problem)
        runner.drop_graphs()
    log.info(
        "warm-up done",
        seconds=round(time.perf_counter() - start, 2),
        cuda_graphs=runner.graphs.ladder if runner.graphs is not None else [],
    )


def start_up_check(runner: ModelRunner, num_blocks: int) -> str | None:
    """An eager prefill (in two chunks) and decode of a few sequences (compiling
    the kernels a first request runs, and sampling once), then the same decode
    through the runner's graphs: None when they agree (compare_logits) or there
    are none, else what differs. Uses blocks (or contiguous slots) 0..n-1 and
    zeroes them after: the pool is unused at start."""
    graphs = runner.graphs
    n = min(CHECK_SEQS, graphs.max_num_seqs if graphs else CHECK_SEQS, num_blocks)
    prompt = CHECK_PROMPT  # block sizes are >= 8: the prompt and the decoded token fit one block
    vocab = runner.model.spec.vocab_size

    def step(step_id: int, start: int, length: int) -> StepInput:
        builder = StepBuilder(runner.cache.block_size)
        for i in range(n):
            tokens = [(7 + 13 * i + 31 * p) % vocab for p in range(start, start + length)]
            builder.add(i, tokens, start, [i], sample=True)
        return builder.build(step_id)

    try:
        # Two chunks: the first starts at 0 (the SDPA route where it is on), the second continues it (paged).
        runner.logits(step(0, 0, CHECK_FIRST_CHUNK), use_graphs=False)
        runner.logits(step(0, CHECK_FIRST_CHUNK, prompt - CHECK_FIRST_CHUNK), use_graphs=False)
        decode = step(1, prompt, 1)
        eager = runner.logits(decode, use_graphs=False)
        # A throwaway sampler: the worker's own generator must not move.
        Sampler(0).sample_packed(eager.repeat(2, 1), mixed_sampling(n, prompt)).tensor.cpu()
        if runner.model.device.type == "cuda":
            _compile_split_variants(runner)
        if graphs is None:
            return None
        graph = runner.logits(decode, use_graphs=True)
    finally:
        runner.cache.zero_blocks(range(n))
    return compare_logits(graph, eager, runner.model.dtype)


def mixed_sampling(n: int, position: int) -> SamplingParams:
    """2n rows, alternately greedy and seeded temperature 0.8 with top-p 0.9, top-k 20 and min-p 0.05."""
    columns = SamplingColumns(
        np.tile(np.array([0.0, 0.8], dtype=np.float32), n),
        np.tile(np.array([1.0, 0.9], dtype=np.float32), n),
        np.tile(np.array([0, 20], dtype=np.int64), n),
        np.zeros(2 * n, dtype=np.uint64),
        np.tile(np.array([False, True]), n),
        np.tile(np.array([0.0, 0.05], dtype=np.float32), n),
    )
    return SamplingParams(columns, np.full(2 * n, position, dtype=np.int64))


def _compile_split_variants(runner: ModelRunner) -> None:
    """Eager decodes (those of mixed steps) pick their split-KV partition count
    from their table width: compile each count's merge kernel now, through one
    1-row decode per power of two over a table that wide (reading block 0)."""
    from kernels.triton.launch import MAX_SPLITS, MIN_SPLIT_TOKENS

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
