"""Structured outputs on the worker: the allowed-token bitmask applied on the
device before logit processing and sampling (greedy included), checked against
the scheduler's numpy reference (scheduler_svc/structured/bitmask.py); the
logprobs stay the raw distribution's; late masks wait for their StepMasks call;
a malformed mask is refused naming its column and row."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from scheduler_svc.structured.bitmask import apply_bitmask, pack, unpack
from tests.helpers.worker_steps import Sampling, Seq, sampling_params, step_input
from worker_svc.runner.late_masks import LateMasks
from worker_svc.sampling.logits_processing import mask_tokens_, unpack_bitmask
from worker_svc.sampling.sampler import Sampler
from worker_svc.step.errors import InvalidStep, StaleStep
from worker_svc.step.input import Penalties, TokenMasks
from worker_svc.step.validation import Limits, check_late_rows, validate

VOCAB = 70  # not a multiple of 32: the last word has bits past the vocabulary
WIDTH = 3


def _masks(rows: int, density: float, seed: int, vocab: int = VOCAB, width: int = WIDTH) -> np.ndarray:
    """[rows, width] int32 words, each row allowing ~density of the ids (at least one), bits past `vocab` noise."""
    rng = np.random.default_rng(seed)
    allowed = rng.random((rows, 32 * width)) < density
    allowed[np.arange(rows), rng.integers(0, vocab, rows)] = True
    allowed[:, vocab:] = rng.random((rows, 32 * width - vocab)) < 0.5  # ignored by the rule
    return pack(allowed, width)


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("vocab,width", [(70, 3), (64, 2), (96, 2), (5, 1)])
def test_unpacking_on_the_device_equals_the_numpy_rule(vocab, width):
    """Sign bits (id 32w + 31) included; ids past 32 * width are not allowed; bits past the vocabulary ignored."""
    words = _masks(6, 0.4, seed=vocab, vocab=min(vocab, 32 * width), width=width)
    words[0, -1] = np.int32(-(2**31))  # only the sign bit of the last word
    got = unpack_bitmask(torch.from_numpy(words), vocab).numpy()
    np.testing.assert_array_equal(got, unpack(words, vocab))


def test_masking_rows_of_a_block_equals_apply_bitmask():
    logits = _logits(5)
    words = _masks(3, 0.3, seed=1)
    rows = [4, 0, 2]
    got = mask_tokens_(logits.clone(), torch.tensor(rows), torch.from_numpy(words))
    want = logits.clone().numpy()
    want[rows] = apply_bitmask(want[rows], words)
    np.testing.assert_array_equal(got.numpy(), want)


def _sample_masked(rows: list[Sampling], logits: torch.Tensor, masks: TokenMasks) -> tuple[np.ndarray, np.ndarray]:
    params = dataclasses.replace(sampling_params(rows, range(10, 10 + len(rows))), token_masks=lambda: masks)
    packed = Sampler(seed=3).sample_packed(logits, params).tensor[: len(rows)].cpu().numpy()
    return packed[:, 0].astype(np.int64), packed[:, 1]


def test_greedy_picks_the_best_allowed_token_and_reports_the_raw_logprob():
    logits = _logits(4, seed=2)
    words = _masks(3, 0.1, seed=2)
    masks = TokenMasks(np.array([0, 1, 3]), words)
    tokens, logprobs = _sample_masked([Sampling()] * 4, logits, masks)
    masked = apply_bitmask(logits[[0, 1, 3]].numpy(), words)
    np.testing.assert_array_equal(tokens[[0, 1, 3]], masked.argmax(axis=1))
    assert tokens[2] == int(logits[2].argmax())  # an unmasked row is untouched
    raw = torch.log_softmax(logits, dim=-1).numpy()
    np.testing.assert_allclose(logprobs, raw[np.arange(4), tokens], rtol=1e-5)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=1.0, seed=7),
        Sampling(temperature=2.0, top_k=5, seed=8),
        Sampling(temperature=0.7, top_p=0.5),
        Sampling(logit_bias_token_ids=range(VOCAB), logit_bias_values=[100.0] * VOCAB),
        Sampling(temperature=1.0, penalties=Penalties(presence=-2.0, frequency=-2.0, output_token_ids=(1, 2, 3))),
    ],
    ids=["seeded", "top-k", "top-p", "bias cannot revive", "penalties cannot revive"],
)
def test_every_sampling_mode_picks_only_allowed_tokens(sampling):
    """The mask comes first: temperature, filters, bias and penalties work on what it allows."""
    rows = 64
    logits = _logits(rows, seed=5)
    words = _masks(rows, 0.05, seed=5)
    tokens, _ = _sample_masked([sampling] * rows, logits, TokenMasks(np.arange(rows), words))
    allowed = unpack(words, VOCAB)
    assert allowed[np.arange(rows), tokens].all()


def test_late_masks_wait_for_their_step_and_stale_ones_are_dropped():
    mailbox = LateMasks(wait_s=5.0)
    masks = TokenMasks(np.array([1]), _masks(1, 0.5, seed=0))
    started = time.perf_counter()  # before the timer: a descheduled thread cannot shorten the wait seen
    threading.Timer(0.05, mailbox.put, (8, masks, "step_masks.masks")).start()
    assert mailbox.take(8) == (masks, "step_masks.masks") and time.perf_counter() - started >= 0.04
    mailbox.put(9, masks, "step_masks.masks")
    mailbox.put(10, masks, "previous_step_masks")
    assert mailbox.take(10) == (masks, "previous_step_masks")
    quick = LateMasks(wait_s=0.05)
    quick.put(9, masks, "step_masks.masks")
    with pytest.raises(StaleStep, match="did not come within"):
        quick.take(10)
    mailbox.wait_s = 0.05
    with pytest.raises(StaleStep):  # step 9's masks went when step 10 took its own
        mailbox.take(9)


def test_a_new_schedulers_lower_step_ids_keep_their_masks_over_anothers_leftovers():
    """Step ids start anywhere (planner.py); what steps that failed before taking their
    masks left is what goes, oldest first, never a newer step's masks."""
    mailbox = LateMasks(wait_s=0.05)
    masks = TokenMasks(np.array([1]), _masks(1, 0.5, seed=0))
    for leftover in (1000, 1001, 1002, 1003):
        mailbox.put(leftover, masks, "step_masks.masks")
    mailbox.put(7, masks, "previous_step_masks")
    assert mailbox.take(7) == (masks, "previous_step_masks")
    with pytest.raises(StaleStep):  # the oldest leftover made room for step 7's
        mailbox.take(1000)
    assert mailbox.take(1003) == (masks, "step_masks.masks")


def _masked_step(masks: TokenMasks | None, late_rows=(), sample=(True, True)):
    seqs = [Seq(i + 1, [5, 6], 0, [i], [16 * i, 16 * i + 1], sample=s) for i, s in enumerate(sample)]
    step = step_input(1, [], seqs)
    return dataclasses.replace(
        step, seqs=dataclasses.replace(step.seqs, masks=masks, late_mask_rows=np.array(late_rows, dtype=np.int64))
    )


LIMITS = Limits(vocab_size=VOCAB, num_blocks=4, block_size=16, max_model_len=64)
GOOD = _masks(2, 0.5, seed=9)


@pytest.mark.parametrize(
    "masks,late,sample,field",
    [
        (TokenMasks(np.array([0, 1]), GOOD[:, :2]), (), (True, True), "seqs.masks.width_words"),
        (TokenMasks(np.array([1]), GOOD[:1]), (), (True, False), "seqs.masks.rows[0]"),
        (TokenMasks(np.array([1, 0]), GOOD), (), (True, True), "seqs.masks.rows[1]"),
        (TokenMasks(np.array([0, 2]), GOOD), (), (True, True), "seqs.masks.rows[1]"),
        (TokenMasks(np.array([0]), GOOD[:1]), (0,), (True, True), "seqs.masks.rows[0]"),
        (None, (1,), (True, False), "seqs.flags[row 1]"),
        (
            TokenMasks(np.array([0]), np.where(np.arange(WIDTH) == 2, 1 << 10, 0)[None].astype(np.int32)),
            (),
            (True,) * 2,
            "seqs.masks.words",
        ),  # fmt: skip
    ],
    ids=[
        "width",
        "row samples nothing",
        "rows not ascending",
        "row out of range",
        "inline and late",
        "late row",
        "allows only ids past the vocabulary",
    ],  # fmt: skip
)
def test_malformed_masks_are_refused_naming_the_column(masks, late, sample, field):
    with pytest.raises(InvalidStep) as err:
        validate(_masked_step(masks, late, sample), LIMITS)
    assert err.value.field == field


def test_well_formed_masks_pass_and_late_masks_must_cover_exactly_the_flagged_rows():
    validate(_masked_step(TokenMasks(np.array([0]), GOOD[:1]), late_rows=(1,)), LIMITS)
    check_late_rows("step_masks.masks", 4, TokenMasks(np.array([1]), GOOD[:1]), np.array([1]))
    with pytest.raises(InvalidStep, match="previous_step_masks.rows: \\[0, 1\\], but the SEQ_FLAG_MASK_FOLLOWS rows"):
        check_late_rows("previous_step_masks", 4, TokenMasks(np.array([0, 1]), GOOD), np.array([1]))
