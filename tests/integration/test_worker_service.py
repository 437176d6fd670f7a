"""Worker service surface: bad steps are rejected whole, health, reflection."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from proto import worker_pb2, worker_pb2_grpc
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import ServiceProcess
from tests.helpers.worker_client import by_seq, logits_of, seq_step

NUM_BLOCKS = 32
VICTIM_TABLE = [30, 31]


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
        ],
    ) as proc:
        with grpc.insecure_channel(proc.address) as channel:
            yield worker_pb2_grpc.WorkerStub(channel), channel


def _seq(**overrides) -> worker_pb2.SequenceStep:
    seq = seq_step(5, [3, 4, 5], 0, [1])
    for name, value in overrides.items():
        field = getattr(seq, name)
        if isinstance(value, list):
            del field[:]
            field.extend(value)
        else:
            setattr(seq, name, value)
    return seq


def _with_sampling(**kw) -> worker_pb2.SequenceStep:
    seq = _seq()
    for k, v in kw.items():
        if isinstance(v, list):
            getattr(seq.sampling, k).extend(v)
        elif isinstance(v, worker_pb2.Penalties):
            seq.sampling.penalties.CopyFrom(v)
        else:
            setattr(seq.sampling, k, v)
    return seq


BAD_STEPS = [
    # (case, seqs, copies, field named in the error)
    ("slot outside the pool", [_seq(slot_mapping=[NUM_BLOCKS * 16 + 1, 17, 18])], [], "slot_mapping"),
    ("slot not where the table says", [_seq(slot_mapping=[16, 17, 19])], [], "slot_mapping"),
    ("block id outside the pool", [_seq(block_table=[NUM_BLOCKS])], [], "block_table"),
    ("negative block id", [_seq(block_table=[-1])], [], "block_table"),
    ("table too short", [_seq(token_ids=list(range(3, 20)), slot_mapping=list(range(16, 33)))], [], "block_table"),
    ("token id = vocab", [_seq(token_ids=[3, 10**6, 5])], [], "token_ids"),
    ("negative token id", [_seq(token_ids=[3, -4, 5])], [], "token_ids"),
    ("negative start_pos", [_seq(start_pos=-1)], [], "start_pos"),
    ("past max model len", [_seq(start_pos=254, block_table=list(range(16)))], [], "start_pos"),
    ("slots and tokens differ in length", [_seq(slot_mapping=[16, 17])], [], "slot_mapping"),
    ("no tokens", [_seq(token_ids=[], slot_mapping=[])], [], "token_ids"),
    ("seq id twice", [_seq(), _seq(block_table=[2], slot_mapping=[32, 33, 34])], [], "seq_id"),
    ("negative temperature", [_with_sampling(temperature=-1.0)], [], "sampling"),
    ("top_p above 1", [_with_sampling(top_p=1.5)], [], "sampling"),
    ("more alternatives than tokens", [_with_sampling(top_logprobs=10**6)], [], "sampling.top_logprobs"),
    ("blocked id outside the vocabulary", [_with_sampling(blocked_token_ids=[-1])], [], "blocked_token_ids"),
    (
        "logit bias id outside the vocabulary",
        [_with_sampling(logit_bias_token_ids=[10**6], logit_bias_values=[1.0])],
        [],
        "logit_bias_token_ids",
    ),
    ("logit bias without its value", [_with_sampling(logit_bias_token_ids=[5])], [], "logit_bias_values"),
    ("repetition penalty 0", [_with_sampling(penalties=worker_pb2.Penalties(repetition=0.0))], [], "penalties"),
    (
        "penalised id outside the vocabulary",
        [_with_sampling(penalties=worker_pb2.Penalties(repetition=1.0, output_token_ids=[10**6]))],
        [],
        "penalties.output_token_ids",
    ),
    ("more prompt targets than positions", [_seq(prompt_logprob_targets=[4, 5, 6, 7])], [], "prompt_logprob_targets"),
    ("prompt target outside the vocabulary", [_seq(prompt_logprob_targets=[10**6])], [], "prompt_logprob_targets"),
    ("copy source outside the pool", [], [(NUM_BLOCKS, 3)], "copies[0].src"),
    ("copy onto itself", [], [(3, 3)], "copies[0].dst"),
    ("empty step", [], [], "seqs"),
]


def test_bad_steps_are_rejected_whole_and_write_nothing(stub):
    worker, _ = stub
    prompt = list(range(10, 30))
    first = by_seq(worker.Step(worker_pb2.StepRequest(step_id=1, seqs=[seq_step(9, prompt, 0, VICTIM_TABLE)])))[9]
    before = by_seq(
        worker.Step(worker_pb2.StepRequest(step_id=2, seqs=[seq_step(9, [first.token_id], 20, VICTIM_TABLE)]))
    )[9]

    for i, (case, seqs, copies, field) in enumerate(BAD_STEPS):
        # A well-formed sequence that would overwrite the victim's blocks rides
        # along: if the step were partly applied, the victim's logits change.
        clobber = seq_step(99, list(range(40, 60)), 0, VICTIM_TABLE)
        request = worker_pb2.StepRequest(
            step_id=100 + i, seqs=[clobber, *seqs], copies=[worker_pb2.BlockCopy(src=s, dst=d) for s, d in copies]
        )
        if case == "empty step":
            request = worker_pb2.StepRequest(step_id=100 + i)
        with pytest.raises(grpc.RpcError) as err:
            worker.Step(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert field in err.value.details(), (case, err.value.details())

    after = by_seq(
        worker.Step(worker_pb2.StepRequest(step_id=3, seqs=[seq_step(9, [first.token_id], 20, VICTIM_TABLE)]))
    )[9]
    np.testing.assert_array_equal(logits_of(after), logits_of(before))


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
