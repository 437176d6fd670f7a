"""Worker.Step verifies drafts (speculative decoding) over real gRPC, fp32: a row
carrying its input and K drafts gets back how many drafts the model agrees with
and the model's own token after them, exactly what decoding one token a step
gives: greedy (checked against transformers), greedy with penalties, logit bias
and blocked ids applied per verified position (against transformers' model
with the same processing), and seeded sampling (the tokens of the same row's
plain seeded decoding: the race at each position is keyed by (seed, position)).
The cache it leaves lets decoding go on from there. Rows that cannot be verified
exactly are refused, and so are malformed per-position masks (draft_masks); each verified
position samples under its own mask."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from proto import worker_pb2
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.logprob_reference import reference_greedy
from tests.helpers.worker_client import Seq, seq_step, step_request, token_masks
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


def step_with_drafts(
    worker: WorkerUnderTest, seq_id: int, tokens: list[int], start: int, drafts: int, row: Seq | None = None
):
    """`row`: the row to send (its options), else a plain greedy one."""
    worker.step_id += 1
    row = row or seq_step(seq_id, tokens, start, TABLE, logits=False)
    row.num_drafts = drafts
    reply = worker.stub.Step(step_request(worker.step_id, [row]))
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
        dict(return_logits=True),
        dict(top_logprobs=2),  # alternatives at verified positions: not carried
        dict(prompt_logprob_targets=[6]),
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


VOCAB_WORDS = 24  # the tiny checkpoint's 768 ids


def one_hot(token: int) -> list[int]:
    words = [0] * VOCAB_WORDS
    words[token // 32] = np.int32(np.uint32(1 << (token % 32)))
    return words


@pytest.mark.parametrize("forced_at", [None, 0, 1, 2])
def test_each_verified_position_samples_under_its_own_mask(worker, forced_at):
    """Masks allowing one token each: the drafts are what they allow, so all are accepted and
    the bonus is what the last mask allows; a mask at position j that allows another token
    than draft j + 1 rejects it there, and that token is the bonus."""
    drafts, last, other = [300, 301, 302], 303, 444
    inner = [one_hot(t) for t in drafts]
    if forced_at is not None:
        inner[forced_at] = one_hot(other)
    row = seq_step(70 + (forced_at or 9), [5, 6, 7, *drafts], 0, TABLE, logits=False)
    row.mask = one_hot(last)
    request = step_request(worker.step_id + 1, [row])
    request.seqs.num_drafts.extend([len(drafts)])
    request.seqs.draft_masks.CopyFrom(token_masks([0] * len(drafts), inner))
    worker.step_id += 1
    reply = worker.stub.Step(request)
    accepted, bonus = reply.sampled.num_accepted[0], reply.sampled.token_ids[0]
    assert (accepted, bonus) == ((3, last) if forced_at is None else (forced_at, other))


@pytest.mark.parametrize(
    "draft_rows,words,field",
    [
        (None, None, "seqs.draft_masks.rows[0]"),  # a masked drafting row without its inner masks
        ([0], None, "seqs.draft_masks.rows[1]"),  # fewer than its drafts
        ([0, 0, 0], None, "seqs.draft_masks.rows[2]"),  # more
        ([0, 0], [[-1] * 23, [-1] * 23], "seqs.draft_masks.width_words"),
        ([0, 0], [[-1] * VOCAB_WORDS, [0] * VOCAB_WORDS], "seqs.draft_masks.words"),  # allows nothing
    ],
)
def test_malformed_draft_masks_are_refused(worker, draft_rows, words, field):
    row = seq_step(7, [5, 6, 7, 8], 0, TABLE, logits=False)
    row.mask = [-1] * VOCAB_WORDS
    request = step_request(997, [row])
    request.seqs.num_drafts.extend([2])
    if draft_rows is not None:
        request.seqs.draft_masks.CopyFrom(token_masks(draft_rows, words or [[-1] * VOCAB_WORDS] * len(draft_rows)))
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.Step(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


def test_draft_masks_of_an_unmasked_row_are_refused(worker):
    request = step_request(996, [seq_step(7, [5, 6, 7, 8], 0, TABLE, logits=False)])
    request.seqs.num_drafts.extend([2])
    request.seqs.draft_masks.CopyFrom(token_masks([0, 0], [[-1] * VOCAB_WORDS] * 2))
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.Step(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "seqs.draft_masks.rows[0]" in err.value.details()


def test_more_drafts_than_the_chunk_holds_are_refused(worker):
    request = step_request(998, [seq_step(7, [5, 6], 0, TABLE, logits=False)])
    request.seqs.num_drafts.extend([2])
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.Step(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "seqs.num_drafts[row 0]" in err.value.details()


PROMPT = [5 + (i * 7) % 50 for i in range(21)]
BIASED = 100  # a bias that makes it win at every step: something for the penalties to work on
# case -> reference_greedy's processing keywords
PROCESSED = {
    "presence and frequency": dict(presence=1.5, frequency=1.0, logit_bias={BIASED: 10.0}),
    "repetition": dict(repetition=2.0, logit_bias={BIASED: 10.0}),
    "logit_bias": dict(logit_bias={BIASED: 6.0, 200: 5.5, 222: -100.0}),
    # min_tokens not reached at any position: the stop ids (here what greedy would pick) blocked at each.
    "blocked ids": dict(min_tokens=100, stop_token_ids=(0,)),
    "all together": dict(presence=0.5, frequency=0.5, repetition=1.3, logit_bias={BIASED: 10.0}),
}


def processed_row(seq_id: int, tokens: list[int], start: int, processing: dict, generated: list[int]) -> Seq:
    """A greedy row with the processing the scheduler would send for it: the blocked ids
    while min_tokens holds, the bias, and penalties over `generated` (the ids generated
    before this chunk: the worker counts the drafts itself)."""
    row = seq_step(seq_id, tokens, start, TABLE, logits=False)
    row.blocked_token_ids = list(processing.get("stop_token_ids", ()))
    bias = processing.get("logit_bias", {})
    row.logit_bias_token_ids, row.logit_bias_values = list(bias), list(bias.values())
    presence, frequency = processing.get("presence", 0.0), processing.get("frequency", 0.0)
    repetition = processing.get("repetition", 1.0)
    if presence or frequency or repetition != 1.0:
        prompt_ids = sorted(set(PROMPT)) if repetition != 1.0 else []
        row.penalties = worker_pb2.Penalties(
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            output_token_ids=generated,
            prompt_token_ids=prompt_ids,
        )
    return row


@pytest.mark.parametrize("wrong_at", [2, None])
@pytest.mark.parametrize("case", list(PROCESSED))
def test_processed_verification_gives_the_tokens_of_plain_decoding(worker, case, wrong_at):
    """Each verified position is processed as its own decode step would be: the
    penalties count the drafts before it (at the last position, all of them), the
    bias and blocked ids hold at each. transformers' model with the same processing,
    one token at a time, is the reference."""
    processing = dict(PROCESSED[case])
    if case == "blocked ids":
        plain, _ = reference_greedy(worker.ref, PROMPT, 12)
        processing["stop_token_ids"] = tuple(sorted(set(plain[1:5])))  # block what plain decoding picks
    expected, _ = reference_greedy(worker.ref, PROMPT, 12, **processing)
    seq_id = 300 + list(PROCESSED).index(case) * 2 + (wrong_at is None)
    first = worker.step([processed_row(seq_id, PROMPT, 0, processing, [])]).sampled.token_ids[0]
    assert first == expected[0]
    drafts = list(expected[1:6])
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % worker.info.vocab_size
    row = processed_row(seq_id, [first, *drafts], len(PROMPT), processing, [first])
    accepted, bonus, _ = step_with_drafts(worker, seq_id, [], 0, len(drafts), row)
    assert accepted == (5 if wrong_at is None else wrong_at)
    tokens = [first, *expected[1 : 1 + accepted], bonus]
    assert tokens == expected[: len(tokens)]
    while len(tokens) < len(expected):
        start = len(PROMPT) + len(tokens) - 1
        row = processed_row(seq_id, [tokens[-1]], start, processing, tokens)
        tokens.append(worker.step([row]).sampled.token_ids[0])
    assert tokens == expected
    if case != "blocked ids":
        assert len(set(expected)) > 1  # the penalties or the bias changed something along the way


SAMPLED = dict(temperature=1.0, top_k=40, top_p=0.95, seed=1234)


def sampled_row(seq_id: int, tokens: list[int], start: int, generated: list[int]) -> Seq:
    row = seq_step(seq_id, tokens, start, TABLE, logits=False, **SAMPLED)
    row.min_p = 0.02
    row.penalties = worker_pb2.Penalties(presence=0.4, frequency=0.2, repetition=1.0, output_token_ids=generated)
    return row


@pytest.mark.parametrize("wrong_at", [0, 3, None])
def test_seeded_sampled_verification_gives_the_tokens_of_plain_seeded_decoding(worker, wrong_at):
    """The race at a verified position is the one a plain decode of that position runs
    (same processed logits, same (seed, position) noise): the accepted drafts and the
    token after them are the plain seeded tokens, whatever the drafts."""
    seq_id = 400 + (wrong_at or 9)
    plain = [worker.step([sampled_row(seq_id, PROMPT, 0, [])]).sampled.token_ids[0]]
    while len(plain) < 10:
        row = sampled_row(seq_id, [plain[-1]], len(PROMPT) + len(plain) - 1, plain)
        plain.append(worker.step([row]).sampled.token_ids[0])
    drafts = list(plain[1:6])
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % worker.info.vocab_size
    row = sampled_row(seq_id + 50, [plain[0], *drafts], len(PROMPT), plain[:1])
    worker.step([sampled_row(seq_id + 50, PROMPT, 0, [])])  # the same prefix in another sequence's cache
    accepted, bonus, _ = step_with_drafts(worker, seq_id + 50, [], 0, len(drafts), row)
    assert accepted == (5 if wrong_at is None else wrong_at)
    assert [*plain[1 : 1 + accepted], bonus] == plain[1 : 2 + accepted]
