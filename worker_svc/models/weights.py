"""A checkpoint's tensors, read lazily from its safetensors files.

One file, or the shards `model.safetensors.index.json` maps names to. A tensor is
read from its file when it is first taken (plain reads at the offsets the file's
header gives, not a memory map, whose touched pages would stay resident until the
file is closed), and the decoder takes and converts each one in turn, so loading
holds the model being built plus the tensor in hand, never the whole checkpoint
twice (bench/model_load.py measures the peak). Every tensor must be taken: what is left at the end is an error naming
it (`check_consumed`), so a weight we do not understand cannot be dropped silently.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.families import family_of
from worker_svc.models.rope import partial_rotary_rows

if TYPE_CHECKING:
    from worker_svc.models.linear import Weight
    from worker_svc.models.spec import ModelSpec

INDEX = "model.safetensors.index.json"
# Buffers some exporters save that transformers recomputes from the config.
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)

Tensors = MutableMapping[str, torch.Tensor]
# What the decoder takes its weights from: tensors, or a GGUF file's quantized blocks.
Weights = MutableMapping[str, "Weight"]


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _Entry:
    path: Path
    start: int  # absolute byte offset in the file
    end: int
    dtype: str
    shape: tuple[int, ...]


def _header(path: Path) -> dict[str, _Entry]:
    """A safetensors file's index: 8 bytes of header length, a JSON header, the data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(length))
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        name: _Entry(path, base + e["data_offsets"][0], base + e["data_offsets"][1], e["dtype"], tuple(e["shape"]))
        for name, e in header.items()
    }


class CheckpointTensors(MutableMapping[str, torch.Tensor]):
    """name -> tensor; unread names come from their file on first access, and
    assigned tensors (a renamed, split or sharded one) replace them."""

    def __init__(self, entries: dict[str, _Entry]):
        self._entries = entries  # not yet read
        self._held: dict[str, torch.Tensor] = {}

    @classmethod
    def open(cls, model_dir: Path) -> CheckpointTensors:
        index = model_dir / INDEX
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            paths = sorted({model_dir / file for file in weight_map.values()})
        else:
            paths = sorted(model_dir.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no *.safetensors (nor {INDEX}) in {model_dir}")
        entries = {name: e for path in paths for name, e in _header(path).items()}
        return cls({n: e for n, e in entries.items() if not n.endswith(DERIVED_SUFFIXES)})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._held:
            return self._held[name]
        e = self._entries[name]
        if e.dtype not in _DTYPES:
            raise UnsupportedModel(f"checkpoint tensor {name!r} has dtype {e.dtype}, which is not supported")
        data = bytearray(e.end - e.start)
        with open(e.path, "rb") as f:
            f.seek(e.start)
            f.readinto(data)
        if not data:
            return torch.empty(e.shape, dtype=_DTYPES[e.dtype])
        return torch.frombuffer(data, dtype=_DTYPES[e.dtype]).reshape(e.shape)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._entries.pop(name, None)
        self._held[name] = tensor

    def __delitem__(self, name: str) -> None:
        if name not in self._held and name not in self._entries:
            raise KeyError(name)
        self._held.pop(name, None)
        self._entries.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        yield from list(self._held)
        yield from list(self._entries)

    def __len__(self) -> int:
        return len(self._held) + len(self._entries)


def check_consumed(tensors: Weights, model_type: str) -> None:
    """Every checkpoint tensor was used: a leftover is a weight the model would drop."""
    left = sorted(tensors)
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise UnsupportedModel(f"{model_type}: checkpoint tensor {left[0]!r} is not used by this family{more}")


def to_canonical(spec: ModelSpec, tensors: Tensors) -> None:
    """Rename or split the family's tensors into Llama's names (registry.Family.canonical)
    and, with partial rotary, permute q/k rows so the rotary pairs sit where a
    full-width rotate-half op rotates them (rope.py)."""
    canonical = family_of(spec.model_type).canonical
    if canonical is not None:
        canonical(spec, tensors)
    if not spec.rotary_dim:
        return
    for i in range(spec.num_layers):
        for proj, heads in (("q_proj", spec.num_q_heads), ("k_proj", spec.num_kv_heads)):
            rows = partial_rotary_rows(spec.head_dim, spec.rotary_dim, heads)
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{proj}.{kind}"
                if name in tensors:
                    tensors[name] = tensors[name][rows]
