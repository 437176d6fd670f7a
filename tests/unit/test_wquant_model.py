"""Quantized safetensors checkpoints as the worker's model (issue 38, item 2): every
served format, fp32, gives transformers' greedy tokens on a dense checkpoint of the
format's own dequantization (tests/helpers/wquant_files.py: naive word-by-word
unpacking, or compressed-tensors' own); the weights stay quantized in memory; what
is not served is refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from kernels import cpu_ops, wquant_cpu
from kernels.wquant import Int4Weight, ScaledWeight, wquant_linear
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.gguf_tokens import BLOCK_SIZE, NEW_TOKENS, PROMPT, worker_tokens
from tests.helpers.wquant_files import write_quantized
from worker_svc.config import WorkerConfig
from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.linear import Concat, Linear, WQuantLinear
from worker_svc.models.spec import load_spec
from worker_svc.worker import Worker

VARIANTS = [
    ("awq", {}, Int4Weight, "awq int4 g32 (W4A16)"),
    ("gptq", {}, Int4Weight, "gptq int4 g32 (W4A16)"),
    ("gptq", {"act_order": True, "sym": True}, Int4Weight, "gptq int4 g32 (W4A16)"),
    ("gptq", {"v2": True}, Int4Weight, "gptq int4 g32 (W4A16)"),
    ("pack-quantized", {}, Int4Weight, "pack-quantized int4 g32 (W4A16)"),
    ("pack-quantized", {"strategy": "channel", "symmetric": True}, Int4Weight, "pack-quantized int4 per-channel"),
    ("int-quantized", {}, ScaledWeight, "int-quantized int8 (W8A16: weights dequantized; dynamic activation"),
    ("float-quantized", {}, ScaledWeight, "float-quantized fp8 e4m3 (W8A16: weights dequantized; static"),
    ("float-quantized", {"strategy": "channel"}, ScaledWeight, "float-quantized fp8 e4m3"),
    ("fp8", {}, ScaledWeight, "fp8 fp8 e4m3 (W8A16: weights dequantized; dynamic"),
    ("fp8", {"block": None}, ScaledWeight, "fp8 fp8 e4m3 (W8A16: weights dequantized; static"),
]


def reference_tokens(dense: Path) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():  # the mask is explicit: PROMPT holds the tiny tokenizer's pad id, 3
        ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None)  # fmt: skip
    return ids[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize(("method", "options", "kind", "described"), VARIANTS,
                         ids=[f"{v[0]}-{'-'.join(v[1]) or 'default'}" for v in VARIANTS])  # fmt: skip
def test_fp32_tokens_match_transformers_on_the_dequantized_weights(tmp_path, method, options, kind, described):
    quantized, dense = write_quantized(tmp_path, method, **options)
    with capture_logs() as logs:
        worker = Worker(WorkerConfig(model=str(quantized), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
    [started] = [e for e in logs if e["event"] == "worker compute"]
    assert started["weights"].startswith(described) and worker.info.weight_format == started["weights"]
    assert worker_tokens(worker) == reference_tokens(dense)
    layer = worker.model.layers[1]
    # The C++ kernel multiplies every layout (act-order's with its inputs in group order), so these tokens are its.
    cpu_op = wquant_cpu.multiply if cpu_ops.available() else wquant_linear
    for projection in (layer.qkv, layer.o, layer.down):  # q, k, v stacked into one quantized weight
        assert isinstance(projection, WQuantLinear) and isinstance(projection.weight, kind)
        assert projection.cpu_op is cpu_op
    # The served weights dequantize to the oracle's bits, layer by layer (act-order's inputs reordered).
    oracle = load_file(dense / "model.safetensors")
    qkv = torch.cat([oracle[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    order = layer.qkv.input_order  # type: ignore[attr-defined]
    assert (order is not None) == (cpu_ops.available() and bool(options.get("act_order")))
    assert torch.equal(layer.qkv.weight.dequantize(), qkv if order is None else qkv[:, order])  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", ["awq", "pack-quantized"])
def test_modules_the_format_left_dense_are_served_as_stored(tmp_path, method):
    """modules_to_not_convert / ignore: those modules' weights are plain tensors in the file."""
    kept = ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj")
    quantized, dense = write_quantized(tmp_path, method, dense_modules=kept)
    worker = Worker(WorkerConfig(model=str(quantized), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
    assert worker_tokens(worker) == reference_tokens(dense)
    first, second = worker.model.layers
    assert isinstance(second.down, Linear)  # dense
    assert isinstance(first.qkv, Concat)  # q, k quantized; v dense
    assert [type(p).__name__ for p in first.qkv.parts] == ["WQuantLinear", "WQuantLinear", "Linear"]


def test_the_weights_stay_quantized_in_memory(tmp_path):
    quantized, dense = write_quantized(tmp_path, "awq")
    worker = Worker(WorkerConfig(model=str(quantized), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
    down = worker.model.layers[0].down.weight  # type: ignore[union-attr]
    assert isinstance(down, Int4Weight) and down.packed.dtype == torch.uint8
    assert down.packed.numel() == 64 * 128 // 2  # [hidden, intermediate] at 4 bits
    dense_worker = Worker(WorkerConfig(model=str(dense), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
    # The linears shrink 8x (fp32 -> 4 bits + fp16 scales); the embedding table stays dense.
    linear_fp32 = 2 * 4 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3)
    saved = dense_worker.info.weights_bytes - worker.info.weights_bytes
    assert saved >= 0.8 * linear_fp32, (saved, linear_fp32)


def _with_config(tmp_path: Path, config: dict) -> Path:
    source = tiny_checkpoint("llama")
    cfg = json.loads((source / "config.json").read_text())
    cfg["quantization_config"] = config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


CT_INT4 = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"field 'load_in_4bit' \(bitsandbytes\)"),
        ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes'\) is not served"),
        ({"quant_method": "hqq"}, r"quant_method 'hqq'\) is not served"),
        ({"quant_method": "awq", "bits": 3, "group_size": 128}, r"bits=3 \(awq\)"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"version='gemv' \(awq\)"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, r"zero_point=False \(awq\)"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"bits=8 \(gptq\)"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
        ({"quant_method": "gptq", "bits": 4, "lm_head": True}, r"lm_head=true"),
        ({"quant_method": "gptq", "bits": 4, "format": "marlin"}, r"format='marlin' \(gptq\)"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt='e5m2' \(fp8\)"),
        ({"quant_method": "fp8", "modules_to_not_convert": None, "unknown_knob": 1}, r"field 'unknown_knob' \(fp8\)"),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, r"format='nvfp4-pack-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"a": CT_INT4, "b": CT_INT4}}, r"config_groups: 2 groups"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"a": CT_INT4 | {"weights": {**CT_INT4["weights"], "num_bits": 2}}}}, r"weights.num_bits=2"),
        ({"quant_method": "compressed-tensors", "format": "int-quantized",
          "config_groups": {"a": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                  "strategy": "channel", "symmetric": False}}}}, r"weights.symmetric=False"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"a": CT_INT4},
          "kv_cache_scheme": {"num_bits": 8}}, r"kv_cache_scheme"),
    ],
    ids=lambda v: v if isinstance(v, str) and not v.startswith("(") else None,
)  # fmt: skip
def test_what_is_not_served_is_refused_naming_the_field(tmp_path, config, message):
    with pytest.raises(UnsupportedModel, match=message):
        load_spec(_with_config(tmp_path, config))


def test_a_quantized_checkpoint_of_a_family_that_permutes_its_tensors_is_refused(tmp_path):
    """Phi-3 stores q, k, v fused and its loader splits them: quantized bytes are taken as stored."""
    quantized, _ = write_quantized(tmp_path, "awq")
    phi = tiny_checkpoint("phi3")
    cfg = json.loads((phi / "config.json").read_text()) | {
        "quantization_config": json.loads((quantized / "config.json").read_text())["quantization_config"]
    }
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="phi3: a quantized checkpoint of this family is not served"):
        Worker(WorkerConfig(model=str(quantized), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
