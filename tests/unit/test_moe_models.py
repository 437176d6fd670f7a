"""The mixture-of-experts families at load: their specs (which layers are sparse,
renormalised top-k, windows), each MoE block equal to transformers' own on the same
hidden states (torch reference and C++ kernel), tensor parallelism's expert split
summing back to the whole block (Qwen2-MoE's shared expert included), and what is
refused by name (an expert tensor the config does not declare, a tensor-parallel
size that does not divide the experts)."""

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
    qwen2 = load_spec(tiny_checkpoint("qwen2_moe"))
    assert qwen2.moe is not None and qwen2.moe.shared_intermediate_size == 48
    assert qwen2.moe.sparse_layers == (False, True, False, True)  # decoder_sparse_step=2
    assert not qwen2.moe.renormalize and qwen2.qkv_bias and not qwen2.o_bias


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
@pytest.mark.parametrize(("family", "layer"), [("qwen3_moe", 0), ("qwen2_moe", 1), ("mixtral", 0)])
def test_each_moe_block_equals_transformers(family, layer, cpu_kernel):
    if cpu_kernel and not cpu_ops.available():
        pytest.skip("the C++ CPU kernel could not be built here")
    ours = DecoderModel.load(tiny_checkpoint(family), torch.float32, CPU, cpu_linears=cpu_kernel).layers[layer].moe
    assert ours is not None and ours.kernel == ("cpu" if cpu_kernel else "torch")
    assert (ours.shared is not None) == (family == "qwen2_moe")
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_block(family, layer)(x)
        if isinstance(want, tuple):
            want = want[0]
        got = ours(x[0])
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    ids, _ = moe_reference.select_experts(
        torch.nn.functional.linear(x[0], ours.router), ours.spec.top_k, ours.spec.renormalize
    )
    assert len(ids.unique()) > ours.spec.num_experts // 2  # the router spreads tokens over the experts


@pytest.mark.parametrize(("family", "layer"), [("qwen3_moe", 2), ("qwen2_moe", 3)])
def test_tensor_parallel_experts_sum_to_the_whole_block(family, layer):
    path = tiny_checkpoint(family)
    whole = DecoderModel.load(path, torch.float32, CPU).layers[layer].moe
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    parts = []
    for rank in range(2):
        spec = load_spec(path)
        tensors = CheckpointTensors.open(Path(path))
        to_canonical(spec, tensors)
        layout = RankLayout(rank, 2, spec.num_q_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size)
        local, tensors = shard_checkpoint(spec, tensors, layout)
        assert local.moe is not None and local.moe.intermediate_size == 16
        assert local.moe.shared_intermediate_size == (24 if family == "qwen2_moe" else 0)
        part = DecoderModel.from_tensors(local, tensors, torch.float32, CPU).layers[layer].moe
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


def test_a_shared_expert_tensor_parallelism_cannot_split_is_refused():
    spec = load_spec(tiny_checkpoint("qwen2_moe"))  # routed experts 32 wide, the shared one 48
    tensors = CheckpointTensors.open(Path(tiny_checkpoint("qwen2_moe")))
    layout = RankLayout(0, 32, 32, 32, 32, spec.vocab_size)
    with pytest.raises(UnsupportedModel, match="does not divide the shared expert's width 48"):
        shard_checkpoint(spec, tensors, layout)
