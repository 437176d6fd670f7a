"""A quantized safetensors checkpoint's tensors as the decoder takes them: each
quantized Linear's parts (qweight, qzeros, scales, ... in its format's names) read
together into one kernels/wquant.py weight under the module's `.weight` name, when
the decoder takes it; every other tensor passes through as it is stored (a module
the format left unquantized, `modules_to_not_convert` / `ignore`, is a plain
weight). Parts left unread are named by check_consumed like any tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import torch

from kernels import wquant_formats as formats
from kernels.wquant import WQuantWeight
from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.families import family_of
from worker_svc.models.linear import Weight
from worker_svc.models.spec import ModelSpec
from worker_svc.models.weights import Tensors
from worker_svc.models.wquant_config import Scheme

# The tensor whose presence marks a module as quantized, by method.
_MARKER = {"awq": "qweight", "gptq": "qweight", "pack-quantized": "weight_packed"}
_PARTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "pack-quantized": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    "scaled": ("weight", "weight_scale", "weight_scale_inv", "weight_zero_point", "input_scale", "input_zero_point"),
}
_WEIGHT_DTYPES = {"fp8": torch.float8_e4m3fn, "float-quantized": torch.float8_e4m3fn, "int-quantized": torch.int8}


def refuse_quantized(spec: ModelSpec, split: bool) -> None:
    """What a quantized checkpoint is not served with: a family that renames, splits
    or permutes its tensors (quantized bytes are taken as stored), or tensor
    parallelism (`split`: the shards would cut through groups)."""
    family = family_of(spec.model_type)
    if split:
        raise UnsupportedModel("a quantized safetensors checkpoint is not split over ranks (tensor parallel)")
    if family.canonical is not None or spec.rotary_dim:
        raise UnsupportedModel(f"{spec.model_type}: a quantized checkpoint of this family is not served "
                               "(its tensors are renamed or permuted at load)")  # fmt: skip


class QuantizedTensors(MutableMapping[str, Weight]):
    """name -> tensor, or `<module>.weight` -> the module's quantized weight."""

    def __init__(self, tensors: Tensors, scheme: Scheme):
        self._tensors, self._scheme = tensors, scheme
        marker = _MARKER.get(scheme.method)
        names = list(tensors)
        present = set(names)  # `in` on the lazy mapping would read the tensor
        if marker is None:  # int8/fp8: a module with a scale is quantized
            prefixes = {n.rsplit(".", 1)[0] for n in names if n.endswith((".weight_scale", ".weight_scale_inv"))}
        else:
            prefixes = {n.removesuffix("." + marker) for n in names if n.endswith("." + marker)}
        parts = _PARTS.get(scheme.method, _PARTS["scaled"])
        self._parts = {p: [f"{p}.{s}" for s in parts if f"{p}.{s}" in present] for p in prefixes}

    def _module(self, name: str) -> str | None:
        prefix = name.removesuffix(".weight")
        return prefix if name.endswith(".weight") and prefix in self._parts else None

    def __getitem__(self, name: str) -> Weight:
        prefix = self._module(name)
        if prefix is None:
            return self._tensors[name]
        got = {n.removeprefix(prefix + "."): self._tensors[n] for n in self._parts[prefix]}
        try:
            return _build(self._scheme, got)
        except (KeyError, ValueError) as exc:
            raise UnsupportedModel(f"{self._scheme.method} weight {prefix!r}: {exc}") from exc

    def __setitem__(self, name: str, value: Weight) -> None:
        if not isinstance(value, torch.Tensor) or self._module(name) is not None:
            raise UnsupportedModel(f"{name}: a quantized checkpoint's weights are not renamed or split")
        self._tensors[name] = value

    def __delitem__(self, name: str) -> None:
        prefix = self._module(name)
        if prefix is None:
            del self._tensors[name]
            return
        for part in self._parts.pop(prefix):
            del self._tensors[part]

    def __iter__(self) -> Iterator[str]:
        taken = {n for parts in self._parts.values() for n in parts}
        yield from (n for n in list(self._tensors) if n not in taken)
        yield from (p + ".weight" for p in list(self._parts))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _build(scheme: Scheme, t: dict[str, torch.Tensor]) -> WQuantWeight:
    method = scheme.method
    if method == "awq":
        return formats.awq(t["qweight"], t["qzeros"], t["scales"], scheme.group_size or t["qweight"].shape[0])
    if method == "gptq":
        size = scheme.group_size or t["qweight"].shape[0] * 8
        return formats.gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), size, scheme.zero_offset)
    if method == "pack-quantized":
        out, inp = (int(n) for n in t["weight_shape"].tolist())
        scale = t["weight_scale"]
        scale = scale.reshape(1, 1).expand(out, 1).contiguous() if scale.numel() == 1 else scale.reshape(out, -1)
        size = scheme.group_size or inp
        return formats.pack_quantized(t["weight_packed"], scale, t.get("weight_zero_point"), t.get("weight_g_idx"),
                                      size, out)  # fmt: skip
    weight = t["weight"]
    if weight.dtype != _WEIGHT_DTYPES[method]:
        raise ValueError(f"weight dtype {weight.dtype}, expected {_WEIGHT_DTYPES[method]}")
    for zero in ("weight_zero_point", "input_zero_point"):
        if zero in t and bool(t[zero].any()):
            raise ValueError(f"{zero} is nonzero: asymmetric quantization is not supported")
    if "input_scale" in t and t["input_scale"].numel() != 1:
        raise ValueError(f"input_scale {tuple(t['input_scale'].shape)} is not one static scale")
    if scheme.block is not None:
        return formats.scaled(method, weight, t["weight_scale_inv"], scheme.block)
    return formats.scaled(method, weight, t["weight_scale"], None)
