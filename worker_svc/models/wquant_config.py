"""A safetensors checkpoint's quantization_config, read into what the loader needs
(`Scheme`), or refused naming the field and its value.

Served: FP8 e4m3 weights (`fp8`: per-tensor/per-channel `weight_scale` or
FineGrainedFP8's `weight_block_size` tiles with `weight_scale_inv`;
compressed-tensors `float-quantized`), group-wise INT4 (AWQ GEMM, GPTQ v1/v2 with
or without act-order, compressed-tensors `pack-quantized`) and INT8
(compressed-tensors `int-quantized`, symmetric). Every field is either read here,
metadata that does not change the math (`_METADATA`), or refused.

Activation quantization (FP8's activation_scheme, compressed-tensors'
input_activations) is not applied: the activations stay in the model's dtype and
multiply the dequantized weights (W8A16 math), which `describe` says, so the
worker's `worker compute` line says it. A static input scale is read and checked,
then unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker_svc.models.errors import UnsupportedModel

# Fields of the served methods that record how the checkpoint was made, not how to read it.
_METADATA = {
    "quant_method", "version", "backend", "modules_to_not_convert", "ignored_layers", "ignore",
    "dataset", "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "tokenizer",
    "model_seqlen", "use_cuda_fp16", "use_exllama", "exllama_config", "max_input_length", "cache_block_outputs",
    "batch_size", "pad_token_id", "model_name_or_path", "model_file_base_name", "module_name_preceding_first_block",
    "block_name_to_quantize", "modules_in_block_to_quantize", "meta", "mse", "pack_dtype", "checkpoint_format",
    "quantization_status", "global_compression_ratio", "format", "config_groups", "do_fuse", "fuse_max_seq_len",
    "modules_to_fuse", "dequantize", "fmt", "activation_scheme", "weight_block_size", "bits", "group_size",
    "zero_point", "desc_act", "sym", "kv_cache_scheme", "sparsity_config", "transform_config", "lm_head",
}  # fmt: skip
_CT_FORMATS = {"float-quantized": ("float", 8), "int-quantized": ("int", 8), "pack-quantized": ("int", 4)}


@dataclass(frozen=True)
class Scheme:
    """method: fp8 | awq | gptq | float-quantized | int-quantized | pack-quantized."""

    method: str
    group_size: int = 0  # INT4: inputs per scale (0: the whole row)
    block: tuple[int, int] | None = None  # FP8 tiles (FineGrainedFP8)
    zero_offset: int = 0  # GPTQ v1 stores z - 1
    activations: str = ""  # what the checkpoint asks for the activations (not applied)

    def describe(self) -> str:
        """The weight_format: the method, its layout, and what the math is."""
        if self.method in ("awq", "gptq", "pack-quantized"):
            layout = f"int4 g{self.group_size}" if self.group_size else "int4 per-channel"
            return f"{self.method} {layout} (W4A16)"
        kind = "int8" if self.method == "int-quantized" else "fp8 e4m3"
        acts = f"; {self.activations} activation quantization not applied" if self.activations else ""
        return f"{self.method} {kind} (W8A16: weights dequantized{acts})"


def parse(config: dict[str, Any]) -> Scheme:
    """The scheme of a config.json quantization_config, or UnsupportedModel naming the field."""
    method = str(config.get("quant_method"))
    unknown = sorted(set(config) - _METADATA)
    if unknown:
        raise UnsupportedModel(f"quantization_config field {unknown[0]!r} ({method}) is not supported")
    if config.get("kv_cache_scheme") or config.get("sparsity_config") or config.get("transform_config"):
        field = next(f for f in ("kv_cache_scheme", "sparsity_config", "transform_config") if config.get(f))
        raise UnsupportedModel(f"quantization_config.{field} ({method}) is not supported")
    if config.get("lm_head"):
        raise UnsupportedModel(f"quantization_config.lm_head=true ({method}): a quantized LM head is not supported")
    if method == "fp8":
        return _fp8(config)
    if method in ("awq", "gptq"):
        return _int4(method, config)
    if method == "compressed-tensors":
        return _compressed(config)
    served = "fp8, awq, gptq, compressed-tensors (float-quantized, int-quantized, pack-quantized)"
    raise UnsupportedModel(f"quantization_config (quant_method {method!r}) is not served (served: {served})")


def _require(method: str, field: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise UnsupportedModel(f"quantization_config.{field}={value!r} ({method}) is not supported")


def _fp8(config: dict[str, Any]) -> Scheme:
    _require("fp8", "fmt", config.get("fmt", "e4m3"), ("e4m3", "float8_e4m3fn"))
    scheme = config.get("activation_scheme", "dynamic")
    _require("fp8", "activation_scheme", scheme, ("dynamic", "static"))
    _require("fp8", "dequantize", config.get("dequantize", False), (False,))
    block = config.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise UnsupportedModel(f"quantization_config.weight_block_size={block!r} (fp8) is not supported")
    return Scheme("fp8", block=None if block is None else (int(block[0]), int(block[1])), activations=scheme)


def _int4(method: str, config: dict[str, Any]) -> Scheme:
    _require(method, "bits", config.get("bits"), (4,))
    group = int(config.get("group_size", 128))
    if group != -1 and group < 8:
        raise UnsupportedModel(f"quantization_config.group_size={group} ({method}) is not supported")
    if method == "awq":
        _require(method, "version", str(config.get("version", "gemm")).lower(), ("gemm",))
        _require(method, "zero_point", config.get("zero_point", True), (True,))
        _require(method, "do_fuse", config.get("do_fuse"), (None, False))
        return Scheme("awq", group_size=max(group, 0))
    # GPTQModel writes the packing as `format`, transformers/optimum as `checkpoint_format`.
    field = "checkpoint_format" if "checkpoint_format" in config else "format"
    fmt = config.get(field, "gptq")
    _require(method, field, fmt, ("gptq", "gptq_v2"))
    # desc_act (act-order) is honoured: each input's group is read from g_idx.
    return Scheme("gptq", group_size=max(group, 0), zero_offset=1 if fmt == "gptq" else 0)


def _compressed(config: dict[str, Any]) -> Scheme:
    fmt = config.get("format")
    if fmt not in _CT_FORMATS:
        raise UnsupportedModel(f"quantization_config.format={fmt!r} (compressed-tensors) is not supported "
                               f"(served: {', '.join(_CT_FORMATS)})")  # fmt: skip
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedModel(f"quantization_config.config_groups: {len(groups)} groups (compressed-tensors); "
                               "one scheme for every Linear is served")  # fmt: skip
    group = groups[0]
    extra = sorted(set(group) - {"targets", "weights", "input_activations", "output_activations", "format"})
    if extra:
        raise UnsupportedModel(f"quantization_config.config_groups field {extra[0]!r} is not supported")
    _require(fmt, "config_groups.targets", group.get("targets"), (["Linear"],))
    _require(fmt, "config_groups.output_activations", group.get("output_activations"), (None,))
    _require(fmt, "config_groups.format", group.get("format"), (None, fmt))
    kind, bits = _CT_FORMATS[fmt]
    weights = group.get("weights") or {}
    _require(fmt, "weights.type", weights.get("type"), (kind,))
    _require(fmt, "weights.num_bits", weights.get("num_bits"), (bits,))
    _require(fmt, "weights.dynamic", weights.get("dynamic", False), (False,))
    strategies = ("tensor", "channel", "group") if fmt == "pack-quantized" else ("tensor", "channel")
    _require(fmt, "weights.strategy", weights.get("strategy"), strategies)
    if fmt != "pack-quantized":
        _require(fmt, "weights.symmetric", weights.get("symmetric", True), (True,))
    _require(fmt, "weights.actorder", weights.get("actorder"), (None, "static", "weight", "group"))
    size = int(weights.get("group_size") or 0) if weights.get("strategy") == "group" else 0
    acts = group.get("input_activations")
    activations = ""
    if acts:
        _require(fmt, "input_activations.num_bits", acts.get("num_bits"), (8,))
        _require(fmt, "input_activations.strategy", acts.get("strategy"), ("tensor", "token"))
        activations = "dynamic" if acts.get("dynamic") else "static"
    return Scheme(str(fmt), group_size=size, activations=activations)
