"""Tiny quantized safetensors checkpoints (issue 38): the tiny random llama's linear
weights quantized into each format's documented layout, written beside a dense
checkpoint of the same model whose linears are the format's dequantization, as
the format's own reference computes it. The worker serves the first; transformers
runs the second (the exactness oracle).

The dequantization oracles here are deliberately naive and independent of
kernels/wquant*.py: word-by-word Python loops over AWQ's and GPTQ's int32 words,
per-element tile lookups for FP8, and compressed-tensors' own unpacking and
dequantize for its formats (the package is the format's reference).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import tiny_checkpoint

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's WQLinear_GEMM packing order
GROUP = 32
_AUX = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
Tensors = dict[str, torch.Tensor]


def write_quantized(root: Path, method: str, dense_modules: tuple[str, ...] = (), **options: Any) -> tuple[Path, Path]:
    """(the quantized checkpoint, the dense checkpoint of its dequantized weights).
    method: awq | gptq | pack-quantized | int-quantized | float-quantized | fp8;
    dense_modules: modules left unquantized (listed in modules_to_not_convert, or
    compressed-tensors' ignore); options pick the variant (see each writer)."""
    source = tiny_checkpoint("llama")
    state = load_file(source / "model.safetensors")
    quant, dense = dict(state), dict(state)
    writer, config = _WRITERS[method](**options)
    if dense_modules:
        key = "ignore" if config["quant_method"] == "compressed-tensors" else "modules_to_not_convert"
        config[key] = [*config.get(key, []), *dense_modules]
    for name, w in state.items():
        if name.removesuffix(".weight") in dense_modules:
            continue
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            prefix = name.removesuffix(".weight")
            del quant[name]
            parts = writer(w)
            quant.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
            dense[name] = _ORACLES[method](parts, tuple(w.shape), config)
    base = json.loads((source / "config.json").read_text())
    qdir, ddir = root / method, root / f"{method}-dequantized"
    for out, tensors, cfg in ((qdir, quant, {**base, "quantization_config": config}), (ddir, dense, base)):
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(cfg))
        for aux in _AUX:
            shutil.copy(source / aux, out / aux)
    return qdir, ddir


# --- quantizers: the formats' layouts --------------------------------------------


def _int4_groups(w: torch.Tensor, groups: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, ...]:
    """Unsigned 4-bit q [out, in], fp16 scale [out, G], unsigned zero [out, G]."""
    count = int(groups.max()) + 1
    scale = torch.empty(w.shape[0], count, dtype=torch.float16)
    zero = torch.empty(w.shape[0], count, dtype=torch.uint8)
    for g in range(count):
        cols = w[:, groups == g]
        if symmetric:
            scale[:, g] = (cols.abs().amax(1) / 7).clamp(min=1e-4).half()
            zero[:, g] = 8
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale[:, g] = ((hi - lo) / 15).clamp(min=1e-4).half()
            zero[:, g] = (-lo / scale[:, g].float()).round().clamp(0, 15).to(torch.uint8)
    s, z = scale.float()[:, groups], zero.float()[:, groups]
    q = ((w / s).round() + z).clamp(0, 15).to(torch.uint8)
    return q, scale, zero


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...] (value p in bits 4p)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (nibbles.long() << shifts).sum(-1)
    return (word - (word >= 2**31).long() * 2**32).to(torch.int32)


def _awq(**_: Any) -> tuple[Any, dict[str, Any]]:
    def write(w: torch.Tensor) -> Tensors:
        q, scale, zero = _int4_groups(w, torch.arange(w.shape[1]) // GROUP, symmetric=False)
        order = torch.tensor(AWQ_ORDER)
        qweight = _words(q.t().reshape(w.shape[1], -1, 8)[..., order])
        qzeros = _words(zero.t().reshape(zero.shape[1], -1, 8)[..., order])
        return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t()}

    return write, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}


def _gptq(act_order: bool = False, v2: bool = False, sym: bool = False) -> tuple[Any, dict[str, Any]]:
    def write(w: torch.Tensor) -> Tensors:
        inputs = w.shape[1]
        # act-order: groups follow a permutation of the inputs (GPTQ's descending Hessian order)
        order = torch.randperm(inputs, generator=torch.Generator().manual_seed(inputs)) if act_order else None
        g_idx = torch.arange(inputs) // GROUP if order is None else torch.argsort(order) // GROUP
        q, scale, zero = _int4_groups(w, g_idx, symmetric=sym)
        qweight = _words(q.t().reshape(inputs // 8, 8, -1).transpose(1, 2))
        stored = (zero.int() - (0 if v2 else 1)) & 0xF  # v1 stores z - 1
        return {"qweight": qweight, "qzeros": _words(stored.t().reshape(stored.shape[1], -1, 8)),
                "scales": scale.t(), "g_idx": g_idx.to(torch.int32)}  # fmt: skip

    config = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": sym}
    return write, {**config, "checkpoint_format": "gptq_v2" if v2 else "gptq"}


def _ct_config(fmt: str, weights: dict[str, Any], activations: dict[str, Any] | None = None) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed"}  # fmt: skip


def _pack_quantized(strategy: str = "group", symmetric: bool = False) -> tuple[Any, dict[str, Any]]:
    args = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": strategy}
    args |= {"group_size": GROUP} if strategy == "group" else {}

    def write(w: torch.Tensor) -> Tensors:
        size = GROUP if strategy == "group" else w.shape[1]
        q, scale, zero = _int4_groups(w, torch.arange(w.shape[1]) // size, symmetric)
        signed = (q.int() - 8).to(torch.int8)
        parts = {"weight_packed": pack_to_int32(signed, 4), "weight_scale": scale,
                 "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}  # fmt: skip
        if not symmetric:
            parts["weight_zero_point"] = pack_to_int32((zero.int() - 8).to(torch.int8), 4, packed_dim=0)
        return parts

    return write, _ct_config("pack-quantized", args)


def _scaled_rows(w: torch.Tensor, per_channel: bool, limit: float) -> torch.Tensor:
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    return (amax / limit).clamp(min=1e-6)


def _int_quantized(**_: Any) -> tuple[Any, dict[str, Any]]:
    def write(w: torch.Tensor) -> Tensors:
        scale = _scaled_rows(w, True, 127)
        return {"weight": (w / scale).round().clamp(-128, 127).to(torch.int8), "weight_scale": scale,
                "weight_zero_point": torch.zeros(w.shape[0], 1, dtype=torch.int8)}  # fmt: skip

    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return write, _ct_config("int-quantized", weights, acts)


def _float_quantized(strategy: str = "tensor") -> tuple[Any, dict[str, Any]]:
    def write(w: torch.Tensor) -> Tensors:
        scale = _scaled_rows(w, strategy == "channel", 448)
        parts = {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
        return parts | ({"input_scale": torch.tensor([0.05])} if strategy == "tensor" else {})

    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": strategy != "tensor"}
    return write, _ct_config("float-quantized", weights, acts)


def _fp8(block: tuple[int, int] | None = (32, 32)) -> tuple[Any, dict[str, Any]]:
    def write(w: torch.Tensor) -> Tensors:
        if block is None:  # vLLM's per-tensor layout, static activation scale
            scale = _scaled_rows(w, False, 448)
            return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale, "input_scale": scale * 2}
        bo, bi = block
        tiles = w.reshape(w.shape[0] // bo, bo, w.shape[1] // bi, bi)
        scale = (tiles.abs().amax((1, 3)) / 448).clamp(min=1e-6)
        data = (tiles / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
        return {"weight": data, "weight_scale_inv": scale}

    if block is None:
        return write, {"quant_method": "fp8", "activation_scheme": "static"}
    return write, {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}


_WRITERS = {"awq": _awq, "gptq": _gptq, "pack-quantized": _pack_quantized, "int-quantized": _int_quantized,
            "float-quantized": _float_quantized, "fp8": _fp8}  # fmt: skip


# --- oracles: each format's dequantization, naive -------------------------------


def _awq_oracle(t: Tensors, shape: tuple[int, int], config: dict[str, Any]) -> torch.Tensor:
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].float().tolist()
    out, inputs = shape
    w = [[0.0] * inputs for _ in range(out)]
    for i in range(inputs):
        g = i // config["group_size"]
        for j in range(out // 8):
            for p in range(8):
                o = 8 * j + AWQ_ORDER[p]
                q, z = (qweight[i][j] >> (4 * p)) & 15, (qzeros[g][j] >> (4 * p)) & 15
                w[o][i] = (q - z) * scales[g][o]
    return _fp32(w)


def _gptq_oracle(t: Tensors, shape: tuple[int, int], config: dict[str, Any]) -> torch.Tensor:
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].float().tolist()
    g_idx = t["g_idx"].tolist()
    offset = 1 if config["checkpoint_format"] == "gptq" else 0
    out, inputs = shape
    w = [[0.0] * inputs for _ in range(out)]
    for i in range(inputs):
        g = g_idx[i]
        for o in range(out):
            q = (qweight[i // 8][o] >> (4 * (i % 8))) & 15
            z = (((qzeros[g][o // 8] >> (4 * (o % 8))) & 15) + offset) & 15
            w[o][i] = (q - z) * scales[g][o]
    return _fp32(w)


def _ct_oracle(t: Tensors, shape: tuple[int, int], config: dict[str, Any]) -> torch.Tensor:
    args = QuantizationArgs(**config["config_groups"]["group_0"]["weights"])
    if "weight_packed" in t:
        q = unpack_from_int32(t["weight_packed"], 4, torch.Size(shape))
        zero = t.get("weight_zero_point")
        if zero is not None:
            zero = unpack_from_int32(zero, 4, torch.Size((shape[0], t["weight_scale"].shape[1])), packed_dim=0)
        return ct_dequantize(q, t["weight_scale"].float(), zero, args, dtype=torch.float32)
    zero = t.get("weight_zero_point")
    return ct_dequantize(t["weight"], t["weight_scale"].float(), zero, args, dtype=torch.float32)


def _fp8_oracle(t: Tensors, shape: tuple[int, int], config: dict[str, Any]) -> torch.Tensor:
    data = t["weight"].float().tolist()
    if "weight_scale_inv" not in t:
        return _fp32([[v * float(t["weight_scale"]) for v in row] for row in data])
    scale = t["weight_scale_inv"].tolist()
    bo, bi = config["weight_block_size"]
    return _fp32([[v * scale[o // bo][i // bi] for i, v in enumerate(row)] for o, row in enumerate(data)])


def _fp32(rows: list[list[float]]) -> torch.Tensor:
    # Python floats are doubles: the products of exact integers (or fp8 values) and fp32
    # scales round once to fp32, as a single fp32 multiply does.
    return torch.tensor(rows, dtype=torch.float64).float()


_ORACLES = {"awq": _awq_oracle, "gptq": _gptq_oracle, "pack-quantized": _ct_oracle, "int-quantized": _ct_oracle,
            "float-quantized": _ct_oracle, "fp8": _fp8_oracle}  # fmt: skip
