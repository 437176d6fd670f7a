"""A checkpoint's tensors, read lazily from its safetensors files.

One file, or the shards `model.safetensors.index.json` maps names to. A tensor is
read from its (memory-mapped) file when it is first taken, and the decoder takes
and converts each one in turn, so loading holds the model being built plus the
tensor in hand, never the whole checkpoint twice (bench/model_load.py measures
the peak). Every tensor must be taken: what is left at the end is an error naming
it (`check_consumed`), so a weight we do not understand cannot be dropped silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.registry import family_of
from worker_svc.models.rope import partial_rotary_permutation

if TYPE_CHECKING:
    from worker_svc.models.spec import ModelSpec

INDEX = "model.safetensors.index.json"
# Buffers some exporters save that transformers recomputes from the config.
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)

Tensors = MutableMapping[str, torch.Tensor]


class CheckpointTensors(MutableMapping[str, torch.Tensor]):
    """name -> tensor; unread names come from their file on first access, and
    assigned tensors (a renamed, split or sharded one) replace them."""

    def __init__(self, files: dict[str, Path]):
        self._files = files  # not yet read: name -> its file
        self._held: dict[str, torch.Tensor] = {}
        self._handles: dict[Path, Any] = {}

    @classmethod
    def open(cls, model_dir: Path) -> CheckpointTensors:
        index = model_dir / INDEX
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = {name: model_dir / file for name, file in weight_map.items()}
        else:
            files = {}
            for path in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    files.update(dict.fromkeys(f.keys(), path))
        if not files:
            raise FileNotFoundError(f"no *.safetensors (nor {INDEX}) in {model_dir}")
        return cls({n: p for n, p in files.items() if not n.endswith(DERIVED_SUFFIXES)})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._held:
            return self._held[name]
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        tensor: torch.Tensor = self._handles[path].get_tensor(name)
        return tensor

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._files.pop(name, None)
        self._held[name] = tensor

    def __delitem__(self, name: str) -> None:
        if name not in self._held and name not in self._files:
            raise KeyError(name)
        self._held.pop(name, None)
        self._files.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        yield from list(self._held)
        yield from [n for n in self._files if n not in self._held]

    def __len__(self) -> int:
        return len(self._held) + sum(1 for n in self._files if n not in self._held)

    def close(self) -> None:
        self._handles.clear()


def check_consumed(tensors: Tensors, model_type: str) -> None:
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
    order = partial_rotary_permutation(spec.head_dim, spec.rotary_dim)
    for i in range(spec.num_layers):
        for proj, heads in (("q_proj", spec.num_q_heads), ("k_proj", spec.num_kv_heads)):
            rows = (order[None, :] + spec.head_dim * torch.arange(heads)[:, None]).flatten()
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{proj}.{kind}"
                if name in tensors:
                    tensors[name] = tensors[name][rows]
