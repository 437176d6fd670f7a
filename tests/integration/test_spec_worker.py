"""Worker.Step verifies drafts (speculative decoding) over real gRPC, fp32: a row
carrying its input and K drafts gets back how many drafts the model agrees with
and the model's own token after them, exactly what greedy decoding one token a
step gives (itself checked against transformers), and the cache it leaves lets
decoding go on from there. Rows that cannot be verified exactly are refused."""

from __future__ import annotations

import grpc
import pytest
import torch

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.worker_client import seq_step, step_request
from tests.helpers.worker_under_test import WorkerUnderTest

TABLE = [9, 3, 17, 5, 30, 11, 2, 40]


@pytest.fixture(scope="module")
def worker():
    w = WorkerUnderTest(tiny_checkpoint("llama"), 1e-4)
    yield w
    w.close()


def greedy(worker: WorkerUnderTest, prompt: list[int], n: int) -> list[int]:
    out = worker.ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def step_with_drafts(worker: WorkerUnderTest, seq_id: int, tokens: list[int], start: int, drafts: int):
    worker.step_id += 1
    request = step_request(worker.step_id, [seq_step(seq_id, tokens, start, TABLE, logits=False)])
    request.seqs.num_drafts.extend([drafts])
    reply = worker.stub.Step(request)
    (accepted,) = reply.sampled.num_accepted
    assert len(reply.sampled.draft_logprobs) == accepted
    return accepted, reply.sampled.token_ids[0], list(reply.sampled.draft_logprobs)


@pytest.mark.parametrize("wrong_at", [0, 3, None])
def test_verification_gives_the_greedy_tokens_and_decoding_goes_on(worker, wrong_at):
    prompt = [5 + (i * 7) % 50 for i in range(21)]
    expected = greedy(worker, prompt, 12)
    seq_id = 100 + (wrong_at or 9)
    first = worker.step([seq_step(seq_id, prompt, 0, TABLE, logits=False)]).sampled.token_ids[0]
    assert first == expected[0]
    drafts = list(expected[1:6])  # 5 drafts, right up to wrong_at
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % worker.info.vocab_size
    accepted, bonus, draft_logprobs = step_with_drafts(worker, seq_id, [first, *drafts], len(prompt), len(drafts))
    assert accepted == (5 if wrong_at is None else wrong_at)
    tokens = [first, *expected[1 : 1 + accepted], bonus]
    assert tokens == expected[: len(tokens)]
    # Each accepted draft's logprob is the one transformers gives that token there.
    ref = torch.log_softmax(torch.from_numpy(worker.ref_logits(prompt + expected[:accepted])), dim=-1)
    want = [float(ref[len(prompt) + i, expected[i + 1]]) for i in range(accepted)]
    assert draft_logprobs == pytest.approx(want, abs=1e-4)
    # The rejected drafts' K/V sit past the context the next steps attend to: decoding goes on exactly.
    while len(tokens) < len(expected):
        start = len(prompt) + len(tokens) - 1
        reply = worker.step([seq_step(seq_id, [tokens[-1]], start, TABLE, logits=False)])
        tokens.append(reply.sampled.token_ids[0])
    assert tokens == expected


def test_the_next_step_cannot_take_a_drafting_rows_token_from_the_worker(worker):
    """Its next input depends on the acceptance, which the scheduler reads first."""
    prompt = [5 + (i * 7) % 50 for i in range(21)]
    worker.step([seq_step(60, prompt, 0, TABLE, logits=False)])
    accepted, _, _ = step_with_drafts(worker, 60, [7, 8, 9], len(prompt), 2)
    row = seq_step(60, [0], len(prompt) + 1 + accepted, TABLE, logits=False)
    row.token_from_previous_step = True
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.Step(step_request(worker.step_id + 1, [row], previous_step_id=worker.step_id))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampled nothing" in err.value.details()


def test_a_step_without_drafts_sends_no_accepted_column(worker):
    reply = worker.step([seq_step(1, [5, 6, 7], 0, TABLE, logits=False)])
    assert list(reply.sampled.num_accepted) == []


@pytest.mark.parametrize(
    "change",
    [
        dict(temperature=0.7),  # sampled rows are not verified (greedy only)
        dict(return_logits=True),
        dict(top_logprobs=2),
        dict(sample=False),
    ],
)
def test_rows_that_cannot_be_verified_exactly_are_refused(worker, change):
    row = seq_step(7, [5, 6, 7, 8], 0, TABLE, logits=False)
    for key, value in change.items():
        setattr(row, key, value)
    request = step_request(999, [row])
    request.seqs.num_drafts.extend([2])
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.Step(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "seqs.num_drafts[row 0]" in err.value.details()


def test_more_drafts_than_the_chunk_holds_are_refused(worker):
    request = step_request(998, [seq_step(7, [5, 6], 0, TABLE, logits=False)])
    request.seqs.num_drafts.extend([2])
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.Step(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "seqs.num_drafts[row 0]" in err.value.details()
