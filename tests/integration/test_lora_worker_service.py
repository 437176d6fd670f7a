"""worker.v1 LoadAdapter / UnloadAdapter and lora_slots over real gRPC (issue 40): a
worker process with --enable-lora says its slots in Info, takes an adapter by path
or by its files, runs a step mixing the base and adapters that matches PEFT's merged
models token for token, refuses a bad adapter naming the field, and a row naming an
empty slot naming the column."""

from __future__ import annotations

import json

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from proto import worker_pb2, worker_pb2_grpc
from tests.helpers.checkpoints import tiny_adapter, tiny_checkpoint
from tests.helpers.procs import ServiceProcess
from tests.helpers.worker_client import by_seq, seq_step, step_request
from tools.tiny_adapters import merged_model

FAMILY = "qwen3"


@pytest.fixture(scope="module")
def stub():
    args = ["--model", str(tiny_checkpoint(FAMILY)), "--dtype", "float32", "--num-blocks", "32"]
    proc = ServiceProcess("worker_svc", [*args, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]).start()
    channel = grpc.insecure_channel(proc.address)
    try:
        yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        channel.close()
        proc.stop()


def files_of(adapter: str) -> worker_pb2.LoraAdapterFiles:
    path = tiny_adapter(FAMILY, adapter)
    names = ("adapter_config.json", "adapter_model.safetensors")
    return worker_pb2.LoraAdapterFiles(files={name: (path / name).read_bytes() for name in names})


def test_info_load_step_unload(stub):
    info = stub.Info(worker_pb2.InfoRequest())
    assert (info.max_loras, info.max_lora_rank) == (2, 8)
    by_path = stub.LoadAdapter(
        worker_pb2.LoadAdapterRequest(slot=1, name="qv", path=str(tiny_adapter(FAMILY, "r4_qv")))
    )
    assert by_path.rank == 4 and list(by_path.target_modules) == ["q_proj", "v_proj"]
    by_files = stub.LoadAdapter(worker_pb2.LoadAdapterRequest(slot=2, name="mlp", files=files_of("r2_mlp")))
    assert by_files.rank == 2 and list(by_files.target_modules) == ["gate_proj", "up_proj", "down_proj"]

    prompt = list(range(30, 47))
    rows = [seq_step(seq, prompt, 0, [seq * 2, seq * 2 + 1], logits=False) for seq in range(3)]
    for seq, row in enumerate(rows):
        row.lora_slot = seq
    got = {seq: s.token_id for seq, s in by_seq(stub.Step(step_request(1, rows))).items()}
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(FAMILY), dtype=torch.float32)
    models = [base] + [merged_model(tiny_checkpoint(FAMILY), tiny_adapter(FAMILY, a)) for a in ("r4_qv", "r2_mlp")]
    with torch.no_grad():
        want = {seq: int(m(torch.tensor([prompt])).logits[0, -1].argmax()) for seq, m in enumerate(models)}
    assert got == want

    stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(slot=2))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Step(step_request(2, rows))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "seqs.lora_slots[row 2]: slot 2: no adapter is loaded there" in refused.value.details()


@pytest.mark.parametrize(
    "request_fields,named",
    [
        ({"slot": 3, "path": "/nonexistent"}, "slot: 3: must be 1..2"),
        ({"slot": 1, "path": "/nonexistent"}, "path: /nonexistent has no adapter_config.json"),
        ({"slot": 1}, "source: set path"),
    ],
)
def test_bad_load_requests_are_refused_by_field(stub, request_fields, named):
    with pytest.raises(grpc.RpcError) as refused:
        stub.LoadAdapter(worker_pb2.LoadAdapterRequest(name="bad", **request_fields))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in refused.value.details()


def test_an_adapter_past_max_lora_rank_or_with_dora_is_refused(stub):
    too_wide = files_of("r16_ko_down")
    with pytest.raises(grpc.RpcError) as refused:
        stub.LoadAdapter(worker_pb2.LoadAdapterRequest(slot=1, name="wide", files=too_wide))
    assert "r: 16 exceeds this worker's --max-lora-rank 8" in refused.value.details()
    dora = files_of("r4_qv")
    config = json.loads(dora.files["adapter_config.json"]) | {"use_dora": True}
    dora.files["adapter_config.json"] = json.dumps(config).encode()
    with pytest.raises(grpc.RpcError) as refused:
        stub.LoadAdapter(worker_pb2.LoadAdapterRequest(slot=1, name="dora", files=dora))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter 'dora': use_dora: True is not supported" in refused.value.details()


def test_tensor_parallel_worker_matches_peft_merged_adapters():
    """TP=2 (gloo, fp32): each rank holds its part of every adapter, split as the base
    weights are (B's rows of q/k/v and gate/up, A's columns of o and down); the mixed
    batch's greedy tokens are PEFT's merged models', over prefill and decode steps."""
    family, new_tokens = "llama", 5
    args = ["--model", str(tiny_checkpoint(family)), "--dtype", "float32", "--num-blocks", "32"]
    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16", "--tensor-parallel-size", "2"]
    adapters = {1: "r8_all_rslora", 2: "r2_mlp", 3: "r16_ko_down"}
    with ServiceProcess("worker_svc", [*args, *lora]) as proc, grpc.insecure_channel(proc.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        assert stub.Info(worker_pb2.InfoRequest()).tensor_parallel_size == 2
        for slot, name in adapters.items():
            stub.LoadAdapter(
                worker_pb2.LoadAdapterRequest(slot=slot, name=name, path=str(tiny_adapter(family, name))), timeout=60
            )
        prompts = {seq: list(range(10 + seq, 23 + 2 * seq)) for seq in range(4)}
        tokens: dict[int, list[int]] = {seq: [] for seq in prompts}
        for step_id in range(new_tokens):
            rows = []
            for seq, prompt in prompts.items():
                full = prompt + tokens[seq]
                chunk, start = (prompt, 0) if step_id == 0 else (full[-1:], len(full) - 1)
                rows.append(seq_step(seq, chunk, start, [seq * 2, seq * 2 + 1], logits=False))
                rows[-1].lora_slot = seq
            for seq, row in by_seq(stub.Step(step_request(step_id + 1, rows), timeout=120)).items():
                tokens[seq].append(row.token_id)
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32)
    models = [base] + [merged_model(tiny_checkpoint(family), tiny_adapter(family, adapters[s])) for s in (1, 2, 3)]
    for seq, model in enumerate(models):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompts[seq]]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
        assert tokens[seq] == out[0, len(prompts[seq]) :].tolist(), seq
