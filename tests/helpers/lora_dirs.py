"""PEFT-shaped adapter directories for the scheduler's tests: an adapter_config.json
and a safetensors file of lora_A / lora_B tensors (numpy; the scheduler reads only the
header). Token-exact adapters for real workers come from lora-worker's tiny builder."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, Any] = {}
    offset, blobs = 0, []
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def adapter_dir(root: Path, name: str, rank: int = 4, hidden: int = 8, seed: int = 0, **config: Any) -> Path:
    """A LoRA adapter on q_proj of one layer; `config` overrides adapter_config.json fields."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    write_safetensors(
        path / "adapter_model.safetensors",
        {
            f"{prefix}.lora_A.weight": rng.normal(size=(rank, hidden)),
            f"{prefix}.lora_B.weight": rng.normal(size=(hidden, rank)),
        },
    )
    fields = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"], "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(fields | config))
    return path
