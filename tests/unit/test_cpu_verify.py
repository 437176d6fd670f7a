"""Verification chunks (speculative decoding: a row's input and its K drafts, K + 1
positions over its cached context) on the CPU's fused path (--attention-backend auto:
the C++ linears taking the chunk's rows in one pass over the weights, add+RMSNorm,
RoPE+KV-write, the paged attention) give the reference path's logits at every
position (--attention-backend torch --enforce-eager: the per-op torch forward), fp32,
and the same accepted drafts, bonus tokens and draft logprobs. The step mixes a plain
decode, two drafting rows (one accepting all its drafts, one a single one) and a
prefill chunk over its cached context, on a sliding-window model (Gemma3's window of
8 is shorter than every context) and over INT8 and FP8 caches too."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kernels import cpu_ops
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.worker_steps import Seq, sampled, step_input
from worker_svc.config import WorkerConfig
from worker_svc.runner.batch import plan_batch
from worker_svc.runner.upload import upload_batch
from worker_svc.step.input import StepInput
from worker_svc.worker import Worker

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels could not be built here")

PATHS = {"reference": dict(attention_backend="torch", enforce_eager=True), "fused": dict(attention_backend="auto")}
TABLES = {0: [9, 2, 30, 11, 17], 1: [5, 19, 0, 23, 8], 2: [4, 28, 13, 1, 26], 3: [7, 14, 21, 3, 10]}
PROMPT_LENS = {0: 40, 1: 23, 2: 57, 3: 45}
FIRST_CHUNK = {3: 25}  # seq 3 prefills the rest of its prompt beside the drafts
DRAFTS = {1: 4, 2: 2}  # per drafting row


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def seq(worker: Worker, i: int, tokens: list[int], start: int, sample: bool = True) -> Seq:
    bs = worker.info.block_size
    slots = [TABLES[i][p // bs] * bs + p % bs for p in range(start, start + len(tokens))]
    return Seq(i, tokens, start, TABLES[i], slots, sample=sample)


def with_drafts(step: StepInput, drafts: dict[int, int]) -> StepInput:
    """The step with each row's last drafts[seq_id] tokens marked as drafts."""
    counts = np.array([drafts.get(int(s), 0) for s in step.seqs.seq_ids], dtype=np.int64)
    return dataclasses.replace(step, seqs=dataclasses.replace(step.seqs, num_drafts=counts))


def every_logit(worker: Worker, step: StepInput) -> torch.Tensor:
    """fp32 logits at every position of the step, in batch order (the forward alone:
    nothing sampled; it writes the step's K/V, as the step itself will again)."""
    runner = worker.runner
    with torch.inference_mode():
        batch = upload_batch(plan_batch(step), runner.uploader, None)
        return runner.model.logits(runner.forward(batch))


def chunk_rows(step: StepInput) -> dict[int, int]:
    """Each chunk row's first batch row (decodes come first in batch order)."""
    host = plan_batch(step)
    starts = np.cumsum(step.seqs.num_tokens[host.order]) - step.seqs.num_tokens[host.order]
    return {int(step.seqs.seq_ids[r]): int(start) for r, start in zip(host.order, starts, strict=True)}


@needs_kernels
@pytest.mark.parametrize(
    "family,kv_dtype",
    [("llama", "auto"), ("gemma3", "auto"), ("qwen3", "int8"), ("llama", "fp8")],
    ids=["llama", "gemma3-window", "qwen3-int8", "llama-fp8"],
)
def test_verification_chunks_match_the_reference(family, kv_dtype, restore_threads):
    model = str(tiny_checkpoint(family))
    workers = {
        name: Worker(WorkerConfig(model=model, dtype="float32", kv_dtype=kv_dtype, num_blocks=32, **flags))
        for name, flags in PATHS.items()
    }
    assert workers["fused"].backend == "cpu" and workers["reference"].backend == "torch"
    assert workers["fused"].runner.model.lm_head.kernel == "cpu"  # type: ignore[attr-defined]
    ref = workers["reference"]
    g = torch.Generator().manual_seed(0)
    prompts = {i: torch.randint(3, ref.info.vocab_size, (n,), generator=g).tolist() for i, n in PROMPT_LENS.items()}
    first = {i: p[: FIRST_CHUNK.get(i, len(p))] for i, p in prompts.items()}
    outs = {
        name: sampled(w.step(step_input(1, [], [seq(w, i, p, 0) for i, p in first.items()])))
        for name, w in workers.items()
    }
    assert [t.token_id for t in outs["fused"]] == [t.token_id for t in outs["reference"]]
    next_ids = {t.seq_id: t.token_id for t in outs["reference"]}

    def verification_step(drafts: dict[int, list[int]]) -> StepInput:
        rows = [seq(ref, 0, [next_ids[0]], PROMPT_LENS[0])]
        rows += [seq(ref, i, [next_ids[i], *drafts[i]], PROMPT_LENS[i]) for i in DRAFTS]
        rows.append(seq(ref, 3, prompts[3][FIRST_CHUNK[3] :], FIRST_CHUNK[3]))
        return with_drafts(step_input(2, [], rows), DRAFTS)

    # The reference's greedy continuation as drafts, found one position at a time (each
    # position's logits depend on the drafts before it only); row 2's last one is wrong.
    drafts = {i: [3] * k for i, k in DRAFTS.items()}
    for k in range(max(DRAFTS.values())):
        step = verification_step(drafts)
        logits, rows = every_logit(ref, step), chunk_rows(step)
        for i, count in DRAFTS.items():
            if k < count:
                drafts[i][k] = int(logits[rows[i] + k].argmax())
    drafts[2][-1] = (drafts[2][-1] + 1) % ref.info.vocab_size
    step = verification_step(drafts)

    logits = {name: every_logit(w, step) for name, w in workers.items()}
    torch.testing.assert_close(logits["fused"], logits["reference"], atol=1e-4, rtol=1e-4)
    results = {name: w.step(step).samples for name, w in workers.items()}
    want, got = results["reference"], results["fused"]
    assert got.token_ids.tolist() == want.token_ids.tolist()
    accepted = dict(zip(want.seq_ids.tolist(), want.num_accepted.tolist(), strict=True))
    assert accepted == {0: 0, 1: 4, 2: 1, 3: 0}
    assert got.num_accepted.tolist() == want.num_accepted.tolist()
    np.testing.assert_allclose(got.draft_logprobs, want.draft_logprobs, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4, rtol=1e-4)
