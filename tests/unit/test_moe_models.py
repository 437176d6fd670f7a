"""The mixture-of-experts families at load: their specs (which layers are sparse,
renormalised top-k, windows), each MoE block equal to transformers' own on the same
hidden states (torch reference and C++ kernel), tensor parallelism's expert split
summing back to the whole block, and what is refused by name (an expert tensor the
config does not declare, a tensor-parallel size that does not divide the experts,
Qwen2-MoE's shared experts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kernels import cpu_ops, moe_reference
from tests.helpers.checkpoints import tiny_checkpoint
from worker_svc.models import DecoderModel, UnsupportedModel, load_spec
from worker_svc.models.weights import CheckpointTensors, to_canonical
from worker_svc.parallel.layout import RankLayout
from worker_svc.parallel.sharding import shard_checkpoint

CPU = torch.device("cpu")


def test_specs_name_the_sparse_layers_and_the_routing():
    qwen = load_spec(tiny_checkpoint("qwen3_moe"))
    assert qwen.moe is not None
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.intermediate_size) == (8, 2, 32)
    assert qwen.moe.sparse_layers == (True, False, True)  # mlp_only_layers=[1]
    assert not qwen.moe.renormalize and qwen.qk_norm == "head"
    mixtral = load_spec(tiny_checkpoint("mixtral"))
    assert mixtral.moe is not None and mixtral.moe.renormalize
    assert mixtral.moe.sparse_layers == (True, True) and mixtral.layer_windows == (16, 16)


def test_decoder_sparse_step_leaves_the_other_layers_dense(tmp_path):
    ckpt = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "decoder_sparse_step": 2, "mlp_only_layers": []}))
    spec = load_spec(ckpt)
    assert spec.moe is not None and spec.moe.sparse_layers == (False, True, False)


def hf_block(family: str, layer: int):
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32).eval()
    return hf.model.layers[layer].mlp


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["torch", "cpp"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_each_moe_block_equals_transformers(family, cpu_kernel):
    if cpu_kernel and not cpu_ops.available():
        pytest.skip("the C++ CPU kernel could not be built here")
    ours = DecoderModel.load(tiny_checkpoint(family), torch.float32, CPU, cpu_linears=cpu_kernel).layers[0].moe
    assert ours is not None and ours.kernel == ("cpu" if cpu_kernel else "torch")
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_block(family, 0)(x)
        if isinstance(want, tuple):
            want = want[0]
        got = ours(x[0])
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    ids, _ = moe_reference.select_experts(
        torch.nn.functional.linear(x[0], ours.router), ours.spec.top_k, ours.spec.renormalize
    )
    assert len(ids.unique()) > ours.spec.num_experts // 2  # the router spreads tokens over the experts


def test_tensor_parallel_experts_sum_to_the_whole_block():
    path = tiny_checkpoint("qwen3_moe")
    whole = DecoderModel.load(path, torch.float32, CPU).layers[2].moe
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    parts = []
    for rank in range(2):
        spec = load_spec(path)
        tensors = CheckpointTensors.open(Path(path))
        to_canonical(spec, tensors)
        layout = RankLayout(rank, 2, spec.num_q_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size)
        local, tensors = shard_checkpoint(spec, tensors, layout)
        assert local.moe is not None and local.moe.intermediate_size == 16
        part = DecoderModel.from_tensors(local, tensors, torch.float32, CPU).layers[2].moe
        assert part is not None
        parts.append(part(x))
    assert whole is not None
    torch.testing.assert_close(parts[0] + parts[1], whole(x), atol=1e-5, rtol=1e-5)


def test_a_tensor_parallel_size_that_does_not_divide_the_experts_is_refused():
    spec = load_spec(tiny_checkpoint("qwen3_moe"))
    tensors = CheckpointTensors.open(Path(tiny_checkpoint("qwen3_moe")))
    layout = RankLayout(0, 3, 3, 3, 3, spec.vocab_size)
    with pytest.raises(UnsupportedModel, match="does not divide the experts' width 32"):
        shard_checkpoint(spec, tensors, layout)


def test_an_expert_the_config_does_not_declare_is_refused_by_name(tmp_path):
    ckpt = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("mixtral"), ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = torch.ones(64, 64)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match=r"'model\.layers\.0\.block_sparse_moe\.experts\.4\.w1\.weight'"):
        DecoderModel.load(ckpt, torch.float32, CPU)


def test_qwen2_moe_shared_experts_are_refused_by_model_type(tmp_path):
    ckpt = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_moe"}))
    with pytest.raises(UnsupportedModel, match="'qwen2_moe' is not supported"):
        load_spec(ckpt)
