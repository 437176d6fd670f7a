"""Worker service surface: bad steps are rejected whole, health, reflection."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from proto import worker_pb2, worker_pb2_grpc
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import ServiceProcess
from tests.helpers.worker_client import Seq, by_seq, logits_of, seq_step, step_request, token_masks

NUM_BLOCKS = 32
VICTIM_TABLE = [30, 31]
VOCAB = 768  # the tiny checkpoints'
MASK_WORDS = VOCAB // 32
ALL_ALLOWED = [-1] * MASK_WORDS


@pytest.fixture(scope="module")
def stub():
    with ServiceProcess(
        "worker_svc",
        [
            "--model",
            str(tiny_checkpoint("llama")),
            "--dtype",
            "float32",
            "--num-blocks",
            str(NUM_BLOCKS),
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "12",
        ],
    ) as proc:
        with grpc.insecure_channel(proc.address) as channel:
            yield worker_pb2_grpc.WorkerStub(channel), channel


def _seq(**overrides) -> Seq:
    return dataclasses.replace(seq_step(5, [3, 4, 5], 0, [1]), **overrides)


# Row 0 of every bad step is the clobbering sequence below: the bad row is row 1.
BAD_STEPS = [
    # (case, seqs, copies, field named in the error)
    ("slot outside the pool", [_seq(slot_mapping=[NUM_BLOCKS * 16 + 1, 17, 18])], [], "seqs.slot_mapping[row 1]"),
    ("slot not where the table says", [_seq(slot_mapping=[16, 17, 19])], [], "seqs.slot_mapping[row 1]"),
    ("block id outside the pool", [_seq(block_table=[NUM_BLOCKS])], [], "seqs.block_tables[row 1]"),
    ("negative block id", [_seq(block_table=[-1])], [], "seqs.block_tables[row 1]"),
    (
        "table too short",
        [_seq(token_ids=list(range(3, 20)), slot_mapping=list(range(16, 33)))],
        [],
        "seqs.block_tables[row 1]",
    ),
    ("token id = vocab", [_seq(token_ids=[3, 10**6, 5])], [], "seqs.token_ids[row 1]"),
    ("negative token id", [_seq(token_ids=[3, -4, 5])], [], "seqs.token_ids[row 1]"),
    ("negative start_pos", [_seq(start_pos=-1)], [], "seqs.start_pos[row 1]"),
    ("past max model len", [_seq(start_pos=254, block_table=list(range(16)))], [], "seqs.start_pos[row 1]"),
    ("slots and tokens differ in length", [_seq(slot_mapping=[16, 17])], [], "seqs.slot_mapping"),
    ("no tokens", [_seq(token_ids=[], slot_mapping=[])], [], "seqs.token_ids[row 1]"),
    ("seq id twice", [_seq(), _seq(block_table=[2], slot_mapping=[32, 33, 34])], [], "seqs.seq_ids[row 2]"),
    ("negative temperature", [_seq(temperature=-1.0)], [], "seqs.temperature[row 1]"),
    ("top_p above 1", [_seq(top_p=1.5)], [], "seqs.top_p[row 1]"),
    ("negative top_k", [_seq(top_k=-1)], [], "seqs.top_k[row 1]"),
    ("min_p above 1", [_seq(min_p=1.5)], [], "seqs.min_p[row 1]"),
    ("negative min_p", [_seq(min_p=-0.1)], [], "seqs.min_p[row 1]"),
    ("more alternatives than tokens", [_seq(top_logprobs=10**6)], [], "seqs.extras[row 1].top_logprobs"),
    ("blocked id outside the vocabulary", [_seq(blocked_token_ids=[-1])], [], "seqs.extras[row 1].blocked_token_ids"),
    (
        "logit bias id outside the vocabulary",
        [_seq(logit_bias_token_ids=[10**6], logit_bias_values=[1.0])],
        [],
        "seqs.extras[row 1].logit_bias_token_ids",
    ),
    ("logit bias without its value", [_seq(logit_bias_token_ids=[5])], [], "seqs.extras[row 1].logit_bias_values"),
    (
        "repetition penalty 0",
        [_seq(penalties=worker_pb2.Penalties(repetition=0.0))],
        [],
        "seqs.extras[row 1].penalties",
    ),
    (
        "penalised id outside the vocabulary",
        [_seq(penalties=worker_pb2.Penalties(repetition=1.0, output_token_ids=[10**6]))],
        [],
        "seqs.extras[row 1].penalties.output_token_ids",
    ),
    (
        "more prompt targets than positions",
        [_seq(prompt_logprob_targets=[4, 5, 6, 7])],
        [],
        "seqs.extras[row 1].prompt_logprob_targets",
    ),
    (
        "prompt target outside the vocabulary",
        [_seq(prompt_logprob_targets=[10**6])],
        [],
        "seqs.extras[row 1].prompt_logprob_targets",
    ),
    (
        "input from a previous step that the step does not name",
        [_seq(token_ids=[3], slot_mapping=[16], token_from_previous_step=True)],
        [],
        "seqs.flags[row 1]",
    ),
    ("mask of another width", [_seq(mask=[-1] * (MASK_WORDS + 1))], [], "seqs.masks.width_words"),
    ("mask on a row that samples nothing", [_seq(sample=False, mask=ALL_ALLOWED)], [], "seqs.masks.rows[0]"),
    ("mask allowing nothing", [_seq(mask=[0] * MASK_WORDS)], [], "seqs.masks.words"),
    ("late mask on a row that samples nothing", [_seq(sample=False, mask_follows=True)], [], "seqs.flags[row 1]"),
    ("copy source outside the pool", [], [(NUM_BLOCKS, 3)], "copies[0].src"),
    ("copy onto itself", [], [(3, 3)], "copies[0].dst"),
    ("empty step", [], [], "seqs"),
]

# Columns that disagree in shape: a well-formed [clobber, _seq()] step, then corrupted.
BAD_COLUMNS = [
    # (case, corruption of the SeqColumns, text of the error)
    ("a per-row column one short", lambda c: c.top_k.pop(), "seqs.top_k: 1 entries for 2 rows"),
    ("a per-row column one long", lambda c: c.start_pos.append(0), "seqs.start_pos: 3 entries for 2 rows"),
    ("min_p one short (absent is all right)", lambda c: c.min_p.pop(), "seqs.min_p: 1 entries for 2 rows"),
    ("seq_ids one short", lambda c: c.seq_ids.pop(), "seqs.start_pos: 2 entries for 1 rows"),
    ("a token more than num_tokens", lambda c: c.token_ids.append(5), "seqs.token_ids: 24 entries"),
    ("num_tokens one more than the tokens", lambda c: c.num_tokens.__setitem__(1, 4), "seqs.token_ids: 23 entries"),
    ("a slot less than num_tokens", lambda c: c.slot_mapping.pop(), "seqs.slot_mapping: 22 entries"),
    ("table_lens past block_tables", lambda c: c.table_lens.__setitem__(1, 2), "seqs.block_tables: 3 entries"),
    ("extras of a row that does not exist", lambda c: c.extras[2].SetInParent(), "seqs.extras[row 2]"),
    ("an unknown flag bit", lambda c: c.flags.__setitem__(1, c.flags[1] | 32), "seqs.flags[row 1]: unknown bits 0x20"),
    (
        "mask words one short of rows x width",
        lambda c: c.masks.CopyFrom(worker_pb2.TokenMasks(rows=[1], width_words=MASK_WORDS, words=b"\xff" * 4)),
        f"seqs.masks.words: 4 bytes, but 1 rows x width_words {MASK_WORDS}",
    ),
]


def test_bad_steps_are_rejected_whole_and_write_nothing(stub):
    worker, _ = stub
    prompt = list(range(10, 30))
    first = by_seq(worker.Step(step_request(1, [seq_step(9, prompt, 0, VICTIM_TABLE)])))[9]
    before = by_seq(worker.Step(step_request(2, [seq_step(9, [first.token_id], 20, VICTIM_TABLE)])))[9]

    # A well-formed sequence that would overwrite the victim's blocks rides
    # along: if the step were partly applied, the victim's logits change.
    clobber = seq_step(99, list(range(40, 60)), 0, VICTIM_TABLE)
    requests = []
    for case, seqs, copies, field in BAD_STEPS:
        request = step_request(100 + len(requests), [clobber, *seqs], copies)
        if case == "empty step":
            request = step_request(100 + len(requests))
        requests.append((case, request, field))
    for case, corrupt, field in BAD_COLUMNS:
        request = step_request(100 + len(requests), [clobber, _seq()])
        corrupt(request.seqs)
        requests.append((case, request, field))

    for case, request, field in requests:
        with pytest.raises(grpc.RpcError) as err:
            worker.Step(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert field in err.value.details(), (case, err.value.details())

    after = by_seq(worker.Step(step_request(3, [seq_step(9, [first.token_id], 20, VICTIM_TABLE)])))[9]
    np.testing.assert_array_equal(logits_of(after), logits_of(before))


def test_a_step_without_the_min_p_column_samples_as_min_p_0(stub):
    """min_p came after the other sampling columns: a scheduler that predates it
    sends none, which reads as 0 (off) on every row."""
    worker, _ = stub
    seqs = [seq_step(s, [7, 8, 9], 0, [s], temperature=1.0, seed=s) for s in (1, 2)]
    with_zeros = step_request(200, seqs)
    without = step_request(201, seqs)
    without.seqs.ClearField("min_p")
    tokens = [[r.token_id for r in by_seq(worker.Step(request)).values()] for request in (with_zeros, without)]
    assert tokens[0] == tokens[1]


def test_health_is_serving(stub):
    _, channel = stub
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "worker.v1.Worker"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_worker_service(stub):
    _, channel = stub
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "worker.v1.Worker" in services
    assert "grpc.health.v1.Health" in services


def test_info_describes_model_and_pool(stub):
    worker, _ = stub
    info = worker.Info(worker_pb2.InfoRequest())
    assert (info.model_type, info.num_blocks, info.block_size, info.max_model_len) == ("llama", NUM_BLOCKS, 16, 256)
    assert info.kv_dtype == "float32" and info.device == "cpu" and len(info.instance_id) == 32
    assert info.kv_bytes_per_block == 2 * info.num_layers * info.num_kv_heads * 16 * info.head_dim * 4
    assert info.max_num_seqs == 12  # what a scheduler without its own --max-num-seqs runs


def _allowing(ids: list[int]) -> list[int]:
    allowed = np.zeros(32 * MASK_WORDS, dtype=bool)
    allowed[ids] = True
    return np.packbits(allowed, bitorder="little").view("<i4").tolist()


def test_masked_rows_sample_the_best_allowed_token_inline_and_late(stub):
    """Greedy under a mask is the argmax of the masked logits (the numpy reference), the
    logprob stays the raw one; a step planned ahead gets its masks in a StepMasks call."""
    from concurrent.futures import ThreadPoolExecutor

    from scheduler_svc.structured.bitmask import apply_bitmask

    worker, _ = stub
    prompt, table, allowed = list(range(50, 70)), [20, 21], [7, 300, 301, 767]
    words = _allowing(allowed)
    first = by_seq(worker.Step(step_request(200, [_seq_masked(9, prompt, 0, table, words)])))[9]
    logits = logits_of(first)
    assert first.token_id in allowed and first.token_id == int(
        apply_bitmask(logits[None], np.array([words]))[0].argmax()
    )
    np.testing.assert_allclose(first.logprob, logits[first.token_id] - np.logaddexp.reduce(logits), atol=1e-4)

    ahead = dataclasses.replace(seq_step(9, [0], 20, table), token_from_previous_step=True, mask_follows=True)
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(worker.Step, step_request(201, [ahead], previous_step_id=200))
        with pytest.raises(grpc.RpcError) as err:  # another width: refused on the StepMasks call itself
            worker.StepMasks(worker_pb2.StepMasksRequest(step_id=201, masks=token_masks([0], [[-1]])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "step_masks.masks.width_words" in err.value.details()
        later = _allowing([first.token_id, 11])
        worker.StepMasks(worker_pb2.StepMasksRequest(step_id=201, masks=token_masks([0], [later])))
        second = by_seq(call.result(timeout=30))[9]
    masked = apply_bitmask(logits_of(second)[None], np.array([later]))[0]
    assert second.token_id == int(masked.argmax())

    # Masks of other rows than the flagged ones: the step fails, naming the column.
    ahead = dataclasses.replace(seq_step(9, [0], 21, table), token_from_previous_step=True, mask_follows=True)
    other = seq_step(10, [5, 6], 0, [22])
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(worker.Step, step_request(202, [ahead, other], previous_step_id=201))
        worker.StepMasks(worker_pb2.StepMasksRequest(step_id=202, masks=token_masks([1], [later])))
        with pytest.raises(grpc.RpcError) as err:
            call.result(timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "step_masks.masks.rows: [1], but the SEQ_FLAG_MASK_FOLLOWS rows of step 202 are [0]" in err.value.details()


def _seq_masked(seq_id: int, tokens: list[int], start: int, table: list[int], words: list[int]) -> Seq:
    return dataclasses.replace(seq_step(seq_id, tokens, start, table), mask=words)
