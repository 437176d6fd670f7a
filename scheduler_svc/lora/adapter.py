"""A PEFT LoRA adapter directory read without torch: its adapter_config.json checked
for what we cannot honour (named by field), the ranks of its safetensors header
checked against --max-lora-rank, and its files' bytes, which the scheduler sends to a
worker (the worker checks the tensors fit the base model)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler_svc.lora.errors import LoraRejected

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLED_WEIGHTS = "adapter_model.bin"
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """What a worker is sent: file name -> bytes, and their digest (the adapter's identity)."""

    files: Mapping[str, bytes]
    digest: str

    @property
    def num_bytes(self) -> int:
        return sum(len(b) for b in self.files.values())


@dataclass(frozen=True, slots=True)
class AdapterSummary:
    rank: int  # r, or more if a lora_A tensor says so
    target_modules: tuple[str, ...]


def read_adapter(path: str, max_lora_rank: int) -> tuple[AdapterFiles, AdapterSummary]:
    """The adapter at `path`, checked; raises LoraRejected naming the field or file."""
    if not os.path.isdir(path):
        raise LoraRejected("lora_path", f"{path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        if os.path.isfile(os.path.join(path, _PICKLED_WEIGHTS)):
            raise LoraRejected(
                _PICKLED_WEIGHTS, "pickled weights are not read; save the adapter with safe_serialization=True"
            )
        raise LoraRejected(WEIGHTS_FILE, f"missing in {path!r}")
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise LoraRejected(CONFIG_FILE, f"missing in {path!r}")
    files = {name: _read(os.path.join(path, name)) for name in (CONFIG_FILE, WEIGHTS_FILE)}
    summary = check_adapter(files, max_lora_rank)
    return AdapterFiles(files, files_digest(files)), summary


def files_digest(files: Mapping[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "little") + files[name])
    return h.hexdigest()


def check_adapter(files: Mapping[str, bytes], max_lora_rank: int) -> AdapterSummary:
    config = _config(files[CONFIG_FILE])
    rank = _config_rank(config)
    rank = max(rank, _tensor_rank(files[WEIGHTS_FILE]))
    if rank > max_lora_rank:
        raise LoraRejected("r", f"rank {rank} is more than --max-lora-rank {max_lora_rank}")
    targets = config.get("target_modules")
    modules = (targets,) if isinstance(targets, str) else tuple(targets or ())
    if not modules or not all(isinstance(m, str) for m in modules):
        raise LoraRejected("target_modules", f"must name the modules the adapter changes, got {targets!r}")
    return AdapterSummary(rank, modules)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise LoraRejected(os.path.basename(path), f"cannot be read ({exc.strerror})") from None


def _config(raw: bytes) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise LoraRejected(CONFIG_FILE, f"is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraRejected(CONFIG_FILE, "must be a JSON object")
    if (peft_type := config.get("peft_type", "LORA")) != "LORA":
        raise LoraRejected("peft_type", f"only LORA adapters are served, got {peft_type!r}")
    refusals = (
        ("use_dora", bool(config.get("use_dora")), "DoRA adapters are not served"),
        ("bias", config.get("bias", "none") != "none", "only bias 'none' is served (the adapter trains biases)"),
        ("modules_to_save", bool(config.get("modules_to_save")), "fully trained modules are not served"),
        ("rank_pattern", bool(config.get("rank_pattern")), "per-module ranks are not served"),
        ("alpha_pattern", bool(config.get("alpha_pattern")), "per-module scalings are not served"),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out")), "transposed (Conv1D) weights are not served"),
        ("lora_bias", bool(config.get("lora_bias")), "LoRA biases are not served"),
        ("target_parameters", bool(config.get("target_parameters")), "LoRA on raw parameters is not served"),
    )
    for field, refused, why in refusals:
        if refused:
            raise LoraRejected(field, f"{why}, got {config.get(field)!r}")
    return config


def _config_rank(config: dict[str, Any]) -> int:
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraRejected("r", f"must be an integer >= 1, got {r!r}")
    return r


def _tensor_rank(raw: bytes) -> int:
    """The largest lora_A rank in the safetensors header (no tensor is read)."""
    if len(raw) < 8:
        raise LoraRejected(WEIGHTS_FILE, "is not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", raw[:8])
    if size > min(_MAX_HEADER_BYTES, len(raw) - 8):
        raise LoraRejected(WEIGHTS_FILE, "is not a safetensors file (bad header length)")
    try:
        header = json.loads(raw[8 : 8 + size])
    except (ValueError, UnicodeDecodeError):
        raise LoraRejected(WEIGHTS_FILE, "is not a safetensors file (bad header)") from None
    ranks = [
        int(entry["shape"][0])
        for name, entry in header.items()
        if name != "__metadata__" and "lora_A" in name and isinstance(entry, dict) and entry.get("shape")
    ]
    if not ranks or not any("lora_B" in name for name in header):
        raise LoraRejected(WEIGHTS_FILE, "holds no lora_A / lora_B tensors")
    return max(ranks)
