"""A PEFT LoRA adapter read and checked against the served model.

PEFT saves `adapter_config.json` and `adapter_model.safetensors` with tensors named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`:
A [r, in] and B [out, r] of each adapted projection. `read_adapter` turns them into
per-(layer, module) pairs with the scaling folded into B (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA), in our module names and row order (a partial
rotary model's q/k rows are permuted as its weights are: models/weights.py).

Anything the adapter asks that we would not honour is refused, naming the config
field or the tensor (`AdapterRefused`, INVALID_ARGUMENT on the wire): DoRA, biases,
modules_to_save, per-module ranks, targets we have no projection for, a rank above
--max-lora-rank, a tensor whose shape does not fit this base model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from worker_svc.models.rope import partial_rotary_rows
from worker_svc.models.spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES
# Config fields that change the adapter's math, with the values we honour (None and
# empty containers count as unset). Anything else is refused by name.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_dora": (False,),
    "bias": ("none",),
    "fan_in_fan_out": (False,),
    "lora_bias": (False,),
    "use_qalora": (False,),
    "use_bdlora": (False,),
    "modules_to_save": (),
    "rank_pattern": (),
    "alpha_pattern": (),
    "layer_replication": (),
    "target_parameters": (),
    "trainable_token_indices": (),
    "alora_invocation_tokens": (),
    "megatron_config": (),
    # Variants whose forward is not x @ A.T @ B.T (Arrow routes among adapters); the
    # other *_config fields (eva, corda, loftq, lora_ga) only initialise A and B.
    "arrow_config": (),
    "monteclora_config": (),
    "kasa_config": (),
}
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class AdapterRefused(ValueError):
    """An adapter this worker cannot serve exactly; `field` names what in it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    # (layer, module) -> (A [r, in], B [out, r] times the scaling), fp32, full (unsharded) shapes
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights}, key=MODULES.index)


def read_files(source: Path | Mapping[str, bytes]) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) from a directory or its files."""
    if isinstance(source, Path):
        missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (source / f).is_file()]
        if missing:
            raise AdapterRefused("path", f"{source} has no {' or '.join(missing)} (a PEFT adapter directory)")
        return (source / CONFIG_FILE).read_bytes(), (source / WEIGHTS_FILE).read_bytes()
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if f not in source]
    if missing:
        raise AdapterRefused("files", f"missing {' and '.join(missing)}")
    if extra := sorted(set(source) - {CONFIG_FILE, WEIGHTS_FILE, "README.md"}):
        raise AdapterRefused("files", f"unexpected file {extra[0]!r} (only {CONFIG_FILE} and {WEIGHTS_FILE})")
    return source[CONFIG_FILE], source[WEIGHTS_FILE]


def module_shape(spec: ModelSpec, module: str) -> tuple[int, int]:
    """(out, in) of one of our projections in the whole (unsharded) model."""
    q, kv = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[module]


def read_adapter(name: str, config_bytes: bytes, weight_bytes: bytes, spec: ModelSpec, max_rank: int) -> LoraAdapter:
    config = _config(config_bytes)
    rank, alpha = _rank_and_alpha(config, max_rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules")
    if isinstance(targets, list) and (unknown := sorted(set(targets) - set(MODULES))):
        raise AdapterRefused(
            "target_modules", f"{unknown[0]!r} is not a projection this worker adapts ({', '.join(MODULES)})"
        )
    try:
        tensors = load_safetensors(weight_bytes)
    except Exception as exc:
        raise AdapterRefused(WEIGHTS_FILE, f"not a safetensors file ({exc})") from exc
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR.match(tensor_name)
        if match is None:
            raise AdapterRefused(tensor_name, "not a LoRA A/B weight of a decoder layer's projection")
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in MODULES or (block == "mlp") != (module in MLP_MODULES):
            raise AdapterRefused(tensor_name, f"no projection {block}.{module} in this model")
        if layer >= spec.num_layers:
            raise AdapterRefused(tensor_name, f"layer {layer}, but the base model has {spec.num_layers}")
        if spec.moe is not None and block == "mlp" and spec.moe.sparse_layers[layer]:
            raise AdapterRefused(tensor_name, f"layer {layer}'s MLP is a mixture of experts: no dense {module}")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterRefused(WEIGHTS_FILE, "holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        weights[(layer, module)] = _checked_pair(layer, module, pair, spec, rank, scaling)
    return LoraAdapter(name, rank, weights)


def _config(config_bytes: bytes) -> dict[str, Any]:
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise AdapterRefused(CONFIG_FILE, f"not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterRefused(CONFIG_FILE, "not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterRefused("peft_type", f"{config['peft_type']!r}: only LORA adapters are served")
    for field, honoured in _NEUTRAL.items():
        value = config.get(field)
        if value in (None, {}, [], "") or value in honoured:
            continue
        raise AdapterRefused(field, f"{value!r} is not supported (served: {honoured[0] if honoured else 'unset'})")
    return config


def _rank_and_alpha(config: Mapping[str, Any], max_rank: int) -> tuple[int, float]:
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterRefused("r", f"{rank!r}: must be a positive integer")
    if rank > max_rank:
        raise AdapterRefused("r", f"{rank} exceeds this worker's --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterRefused("lora_alpha", f"{alpha!r}: must be a number")
    return rank, float(alpha)


def _checked_pair(
    layer: int, module: str, pair: Mapping[str, torch.Tensor], spec: ModelSpec, rank: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = f"model.layers.{layer}.{'mlp' if module in MLP_MODULES else 'self_attn'}.{module}"
    for which in ("A", "B"):
        if which not in pair:
            raise AdapterRefused(f"{prefix}.lora_{which}.weight", "missing (its pair is present)")
    a, b = pair["A"], pair["B"]
    out_features, in_features = module_shape(spec, module)
    for which, tensor, want in (("A", a, (rank, in_features)), ("B", b, (out_features, rank))):
        if tuple(tensor.shape) != want:
            raise AdapterRefused(
                f"{prefix}.lora_{which}.weight",
                f"shape {list(tensor.shape)}, but r={rank} on this base model's {module} needs {list(want)}",
            )
        if not tensor.is_floating_point():
            raise AdapterRefused(f"{prefix}.lora_{which}.weight", f"dtype {tensor.dtype}: not floating point")
    b = b.float() * scaling
    if spec.rotary_dim and module in ("q_proj", "k_proj"):
        heads = spec.num_q_heads if module == "q_proj" else spec.num_kv_heads
        b = b[partial_rotary_rows(spec.head_dim, spec.rotary_dim, heads)]
    return a.float(), b
