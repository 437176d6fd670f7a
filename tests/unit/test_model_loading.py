"""Loading a checkpoint: nothing silently dropped (a leftover tensor, a math-changing
config field we do not read, an unknown activation or rope type: each refused naming
it), sharded safetensors, the registry's list, and a refused model's one-line exit."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import REPO
from worker_svc.models import DecoderModel, UnsupportedModel, load_spec
from worker_svc.models.registry import FAMILIES
from worker_svc.models.spec import auto_dtype

CPU = torch.device("cpu")


def copy_checkpoint(family: str, dest: Path, config: dict[str, object] | None = None) -> Path:
    shutil.copytree(tiny_checkpoint(family), dest)
    if config:
        path = dest / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dest


def test_a_leftover_tensor_is_refused_by_name(tmp_path):
    ckpt = copy_checkpoint("llama", tmp_path / "m")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.mlp.extra_proj.weight"] = torch.ones(4, 4)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="'model.layers.1.mlp.extra_proj.weight' is not used"):
        DecoderModel.load(ckpt, torch.float32, CPU)


def test_a_bias_the_config_does_not_declare_is_refused(tmp_path):
    # attention_bias off, yet the checkpoint carries q_proj.bias: dropping it would
    # silently change every token (the bug this loader replaced).
    ckpt = copy_checkpoint("llama", tmp_path / "m")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(64)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="q_proj.bias"):
        DecoderModel.load(ckpt, torch.float32, CPU)


@pytest.mark.parametrize(
    ("family", "config", "named"),
    [
        ("mistral", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ("llama", {"sliding_window": 8}, "sliding_window=8"),
        ("llama", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ("qwen2", {"embedding_multiplier": 2.0}, "embedding_multiplier=2.0"),
        ("mistral", {"quantization_config": {"quant_method": "hqq"}}, "quantization_config (quant_method 'hqq')"),
        ("llama", {"hidden_act": "relu"}, "hidden_act 'relu'"),
        ("llama", {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope_type 'proportional'"),
        ("llama", {"model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not supported"),
        ("mistral", {"qkv_bias": True}, "qkv_bias=True"),
        ("mistral", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary"),
    ],
)
def test_a_math_changing_config_field_we_do_not_read_is_refused_by_name(tmp_path, family, config, named):
    ckpt = copy_checkpoint(family, tmp_path / "m", config)
    with pytest.raises(UnsupportedModel, match=re.escape(named)):
        load_spec(ckpt)


def test_an_untied_checkpoint_without_its_output_projection_is_refused(tmp_path):
    ckpt = copy_checkpoint("qwen3", tmp_path / "m")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="lm_head.weight"):
        DecoderModel.load(ckpt, torch.float32, CPU)


def test_sharded_safetensors_load_as_the_single_file(tmp_path):
    single = tiny_checkpoint("llama_bias")
    ckpt = copy_checkpoint("llama_bias", tmp_path / "m")
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, ckpt / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = DecoderModel.load(single, torch.float32, CPU), DecoderModel.load(ckpt, torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    x, wide = torch.randn(3, 64, generator=gen), torch.randn(3, 128, generator=gen)  # hidden, intermediate
    for la, lb in zip(a.layers, b.layers):
        for proj, inp in (("qkv", x), ("o", x), ("gate_up", x), ("down", wide)):
            assert torch.equal(getattr(la, proj)(inp), getattr(lb, proj)(inp))
    assert torch.equal(a.embed, b.embed) and torch.equal(a.final_norm, b.final_norm)


def test_every_registered_family_has_examples_and_lists_itself():
    command = [sys.executable, "-m", "worker_svc", "--list-architectures"]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout
    listed = {line.split()[0] for line in out.splitlines()}
    assert listed == set(FAMILIES) >= {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text"}
    assert all(f.examples for f in FAMILIES.values())


def test_a_refused_model_exits_with_one_line_not_a_traceback(tmp_path):
    ckpt = copy_checkpoint("mistral", tmp_path / "m", {"attn_logit_softcapping": 50.0})
    run = subprocess.run(
        [sys.executable, "-m", "worker_svc", "--model", str(ckpt), "--port", "0", "--log-format", "json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    output = run.stdout + run.stderr
    assert "Traceback" not in output
    errors = [json.loads(line) for line in output.splitlines() if line.startswith("{") and '"error"' in line]
    assert len(errors) == 1 and "attn_logit_softcapping=50.0" in errors[0]["error"]


@pytest.mark.parametrize(
    ("stored", "device", "preferred", "served"),
    [
        ("float16", "cuda", "bfloat16", "float16"),  # bf16 would round the checkpoint's weights
        ("bfloat16", "cuda", "bfloat16", "bfloat16"),
        ("float32", "cuda", "bfloat16", "bfloat16"),
        ("float16", "cpu", "float32", "float32"),  # fp16 is not native on the CPU
        ("bfloat16", "cpu", "bfloat16", "bfloat16"),
    ],
)
def test_dtype_auto_follows_the_checkpoint_where_the_device_computes_in_it(tmp_path, stored, device, preferred, served):
    ckpt = copy_checkpoint("llama", tmp_path / "m", {"dtype": stored})
    assert auto_dtype(preferred, device, ckpt) == served
