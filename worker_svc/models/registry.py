"""The families the worker serves, each a short declarative adapter (families/)
registered by its model_type.

A family says how its checkpoint differs from Llama's and nothing else: the
ModelSpec switches it sets from its config (`switches`), the math-changing config
fields it reads (`honours`; any other such field must keep its neutral value,
spec.py), and, where its tensors are not named or laid out as Llama's, a
`canonical` step that renames or splits them in place (Phi-3's fused qkv_proj and
gate_up_proj) before tensor-parallel sharding and the decoder take them.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worker_svc.models.errors import UnsupportedModel

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from worker_svc.models.spec import ModelSpec


def _no_switches(cfg: PretrainedConfig) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    model_type: str
    examples: str  # checkpoints users run (--list-architectures)
    switches: Callable[[PretrainedConfig], dict[str, Any]] = _no_switches
    honours: frozenset[str] = field(default_factory=frozenset)
    canonical: Callable[[ModelSpec, MutableMapping[str, torch.Tensor]], None] | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


def families() -> dict[str, Family]:
    import worker_svc.models.families  # noqa: F401  (each module registers itself)

    return FAMILIES


def family_of(model_type: str) -> Family:
    known = families()
    if model_type not in known:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(known))})")
    return known[model_type]
