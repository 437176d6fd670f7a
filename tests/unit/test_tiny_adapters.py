"""The tiny PEFT adapters: real PEFT files whose A and B both carry weight."""

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.helpers.checkpoints import tiny_adapter, tiny_checkpoint
from tools.tiny_adapters import ADAPTERS, merged_model


def test_adapter_files_are_peft_lora_with_nonzero_a_and_b():
    path = tiny_adapter("llama", "r8_all_rslora")
    config = json.loads((path / "adapter_config.json").read_text())
    spec = ADAPTERS["r8_all_rslora"]
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == ("LORA", 8, 4, True)
    assert sorted(config["target_modules"]) == sorted(spec.target_modules)
    tensors = load_file(path / "adapter_model.safetensors")
    # 2 layers x 7 projections x (A, B)
    assert len(tensors) == 2 * 7 * 2
    for name, t in tensors.items():
        assert ("lora_A" in name or "lora_B" in name) and t.abs().min() > 0, name


def test_merged_adapter_changes_the_logits():
    base_dir = tiny_checkpoint("qwen3")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 100, 200, 300, 17]])
    with torch.no_grad():
        want = base(ids).logits
        for adapter in ADAPTERS:
            got = merged_model(base_dir, tiny_adapter("qwen3", adapter))(ids).logits
            assert (got - want).abs().max() > 0.5, adapter
