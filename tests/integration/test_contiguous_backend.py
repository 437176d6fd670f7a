"""The contiguous KV layout (--kv-layout contiguous) over real gRPC vs transformers
(fp32): one [layers, max_batch, kv_heads, max_seq_len, head_dim] slot per
sequence, block_table = [slot], slot_mapping = slot * max_seq_len + position.
Prefill in one step and in chunks, decodes, mixed batches and slot copies must
give transformers' logits; malformed contiguous steps are rejected."""

from __future__ import annotations

import dataclasses
import random

import grpc
import numpy as np
import pytest
import torch

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.worker_client import Seq, by_seq, logits_of
from tests.helpers.worker_under_test import WorkerUnderTest

MAX_BATCH = 4
MAX_LEN = 128
ATOL = 1e-4


@pytest.fixture(scope="module", params=("llama", "qwen3_mqa", "gemma3"))
def worker(request):
    w = WorkerUnderTest(
        tiny_checkpoint(request.param),
        ATOL,
        ("--kv-layout", "contiguous", "--max-batch", str(MAX_BATCH), "--max-model-len", str(MAX_LEN)),
    )
    yield w
    w.close()


def slot_step(
    seq_id: int, token_ids: list[int], start_pos: int, slot: int, *, sample: bool = True, logits: bool = True
) -> Seq:
    return Seq(
        seq_id,
        token_ids,
        start_pos,
        [slot],
        [slot * MAX_LEN + p for p in range(start_pos, start_pos + len(token_ids))],
        sample=sample,
        return_logits=logits,
    )


def prompt_for(worker, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, worker.info.vocab_size) for _ in range(n)]


def assert_close(ours: np.ndarray, ref: np.ndarray):
    err = float(np.abs(ours - ref).max())
    assert err <= ATOL, f"max |logit error| {err:.2e} > {ATOL:.0e}"
    assert int(ours.argmax()) == int(ref.argmax())


def test_info_reports_the_contiguous_layout(worker):
    info = worker.info
    assert (info.kv_layout, info.max_batch, info.num_blocks, info.block_size) == (
        "contiguous",
        MAX_BATCH,
        MAX_BATCH,
        MAX_LEN,
    )
    assert info.max_model_len == MAX_LEN
    assert info.kv_bytes_per_block == info.kv_bytes_per_token * MAX_LEN  # a "block" is a whole slot


def test_prefill_chunks_and_decode_match_transformers(worker):
    prompt = prompt_for(worker, 40)  # past Gemma's sliding window (8)
    ref = worker.ref_logits(prompt)
    one = by_seq(worker.step([slot_step(1, prompt, 0, 3)]))[1]
    assert_close(logits_of(one), ref[-1])

    pos = 0
    for chunk in (5, 16, 11, 8):
        out = by_seq(worker.step([slot_step(2, prompt[pos : pos + chunk], pos, 1)]))[2]
        pos += chunk
        assert_close(logits_of(out), ref[pos - 1])
    tokens, next_token = list(prompt), out.token_id
    for _ in range(10):
        tokens.append(next_token)
        out = by_seq(worker.step([slot_step(2, [next_token], len(tokens) - 1, 1)]))[2]
        assert_close(logits_of(out), worker.ref_logits(tokens)[-1])
        next_token = out.token_id
    tokens.append(next_token)
    expected = worker.ref.generate(torch.tensor([prompt]), max_new_tokens=11, do_sample=False, min_new_tokens=11)
    assert tokens == expected[0].tolist()


def test_mixed_step_of_decodes_and_prefills_matches_transformers(worker):
    prompts = [prompt_for(worker, n, seed=20 + n) for n in (3, 17, 33, 20)]
    first = by_seq(worker.step([slot_step(10 + i, p, 0, i) for i, p in enumerate(prompts[:2])]))
    # One step: two decodes (slots 0, 1), a whole prompt (slot 2), a 12-token chunk (slot 3).
    out = by_seq(
        worker.step(
            [
                slot_step(10, [first[10].token_id], 3, 0),
                slot_step(11, [first[11].token_id], 17, 1),
                slot_step(12, prompts[2], 0, 2),
                slot_step(13, prompts[3][:12], 0, 3),
            ]
        )
    )
    assert_close(logits_of(out[10]), worker.ref_logits(prompts[0] + [first[10].token_id])[-1])
    assert_close(logits_of(out[11]), worker.ref_logits(prompts[1] + [first[11].token_id])[-1])
    assert_close(logits_of(out[12]), worker.ref_logits(prompts[2])[-1])
    assert_close(logits_of(out[13]), worker.ref_logits(prompts[3][:12])[-1])


def test_a_reused_slot_ignores_its_previous_tenant(worker):
    long_prompt, short_prompt = prompt_for(worker, 60, seed=5), prompt_for(worker, 9, seed=6)
    worker.step([slot_step(30, long_prompt, 0, 2, logits=False)])
    out = by_seq(worker.step([slot_step(31, short_prompt, 0, 2)]))[31]
    assert_close(logits_of(out), worker.ref_logits(short_prompt)[-1])


def test_slot_copy_then_decode_from_the_copy(worker):
    prompt = prompt_for(worker, 20, seed=7)
    first = by_seq(worker.step([slot_step(40, prompt, 0, 0)]))[40]
    worker.step([], copies=[(0, 3)])
    from_src = by_seq(worker.step([slot_step(40, [first.token_id], 20, 0)]))[40]
    from_copy = by_seq(worker.step([slot_step(41, [first.token_id], 20, 3)]))[41]
    np.testing.assert_array_equal(logits_of(from_copy), logits_of(from_src))


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(block_table=[0, 1]), "seqs.block_tables[row 0]"),  # two slots for one sequence
        (dict(block_table=[MAX_BATCH]), "seqs.block_tables[row 0]"),  # no such slot
        (
            dict(slot_mapping=[1 * MAX_LEN + p for p in range(4)]),
            "seqs.slot_mapping[row 0]",
        ),  # another slot's positions
        (dict(slot_mapping=[p * 16 for p in range(4)]), "seqs.slot_mapping[row 0]"),  # paged-style slots
        (dict(start_pos=MAX_LEN - 2), "seqs.start_pos[row 0]"),  # past max_seq_len
    ],
)
def test_malformed_contiguous_steps_are_rejected(worker, bad, field):
    seq = dataclasses.replace(slot_step(50, [5, 6, 7, 8], 0, 0), **bad)
    with pytest.raises(grpc.RpcError) as err:
        worker.step([seq])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
