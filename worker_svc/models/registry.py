"""The families the worker serves, each a short declarative adapter (families/)
registered by its model_type (families/__init__.py imports them all and
looks them up).

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
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from worker_svc.models.moe import MoeSpec


class Shapes(Protocol):
    """What a canonical step needs of the ModelSpec (spec.py, which imports the
    families: they cannot import it back)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_q_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def moe(self) -> MoeSpec | None: ...


def _no_switches(cfg: PretrainedConfig) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    model_type: str
    examples: str  # checkpoints users run (--list-architectures)
    switches: Callable[[PretrainedConfig], dict[str, Any]] = _no_switches
    honours: frozenset[str] = field(default_factory=frozenset)
    canonical: Callable[[Shapes, MutableMapping[str, torch.Tensor]], None] | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family
