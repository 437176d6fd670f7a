"""The worker's adapter slots: every adapted projection's LoRA weights stacked over
the slots, and the projections that add them.

Each fused projection of each layer (qkv, o, gate_up, down: the decoder's) holds
one `LoraStack`: A [S, n*R, in] and B [S, out, n*R] for its n parts (q, k, v: 3),
S = --max-loras + 1 slots (slot 0, the base, all zeros) and R = --max-lora-rank.
Part j's A rows sit in rank block j and its B is the block of B's rows of its
output columns and columns of block j, so the fused projection's LoRA is one op
over all its parts; an adapter of lower rank leaves zeros past its r, an adapter
that does not target a part leaves that part's blocks zero. The buffers are
allocated once, at start, and loads write into them in place: a captured CUDA
graph keeps reading the same memory, and a step's slots are data (`token_slots`),
never shapes.

The scaling is folded into B (worker_svc/lora/adapter.py), so every backend's op
is the same `lora(x, a, b, slots)` (kernels/lora_reference.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import numpy as np
import torch

from kernels import cpu_ops, lora_reference
from worker_svc.lora.adapter import AdapterRefused, LoraAdapter, module_shape
from worker_svc.models.linear import Projection
from worker_svc.models.spec import ModelSpec
from worker_svc.step.errors import InvalidStep, row_field
from worker_svc.step.input import SeqColumns

# The decoder's fused projections (models/decoder.py) and the PEFT modules in each.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
LoraOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RankSplit(Protocol):
    """A tensor-parallel rank's part of each module (worker_svc/parallel/sharding.py's
    LoraSplit): its (out, in) and its slices of an adapter's A [r, in] and B [out, r]."""

    def shape(self, module: str, whole: tuple[int, int]) -> tuple[int, int]: ...

    def split(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class SlotUpdate:
    """What rank 0 sends every tensor-parallel rank: `adapter` into `slot`, or the slot
    emptied (None). Each rank keeps its own part (RankSplit)."""

    slot: int
    adapter: LoraAdapter | None


class LoraStack:
    """One fused projection's adapters in every slot (the module docstring)."""

    def __init__(
        self, shapes: list[tuple[int, int]], num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ):
        parts, in_features = len(shapes), shapes[0][1]
        self.max_rank = max_rank
        self.row_starts = [0, *accumulate(out for out, _ in shapes)]
        self.a = torch.zeros(num_slots, parts * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, self.row_starts[-1], parts * max_rank, dtype=dtype, device=device)

    def put(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        block, rank = part * self.max_rank, a.shape[0]
        self.a[slot, block : block + rank].copy_(a)
        self.b[slot, self.row_starts[part] : self.row_starts[part + 1], block : block + rank].copy_(b)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()


class LoraProjection:
    """base(x) + the LoRA of each token's slot."""

    def __init__(self, base: Projection, stack: LoraStack, slots: LoraSlots):
        self.base, self.stack, self.slots = base, stack, slots

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.slots.op(x, self.stack.a, self.stack.b, self.slots.token_slots)


class LoraSlots:
    """--max-loras slots of adapters up to --max-lora-rank over one model; the
    decoder's projection hook (`adapt`) wraps its projections with them. The worker
    loads and unloads between steps only (its step lock); the runner sets
    `token_slots` [T] before each forward."""

    def __init__(
        self,
        spec: ModelSpec,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        op: LoraOp,
        split: RankSplit | None = None,
    ):
        """`spec`: the whole model's (adapters are checked against it); `split`: this
        tensor-parallel rank's part of each projection (None: one rank)."""
        self.spec, self.max_loras, self.max_rank, self.op, self.split = spec, max_loras, max_rank, op, split
        self.num_slots = max_loras + 1
        self.stacks: dict[tuple[int, str], LoraStack] = {}
        self.dtype, self.device = dtype, device
        self.token_slots = torch.zeros(0, dtype=torch.int64, device=device)
        self.names: dict[int, str] = {}  # slot -> the adapter loaded there

    def adapt(self, layer: int, group: str, base: Projection) -> Projection:
        """The decoder's hook: `base` with the adapters' LoRA of its parts added."""
        shapes = [module_shape(self.spec, module) for module in GROUPS[group]]
        if self.split is not None:
            shapes = [self.split.shape(module, shape) for module, shape in zip(GROUPS[group], shapes)]
        stack = LoraStack(shapes, self.num_slots, self.max_rank, self.dtype, self.device)
        self.stacks[(layer, group)] = stack
        return LoraProjection(base, stack, self)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """`adapter` into `slot`, replacing what it held."""
        self.check_slot(slot)
        missing = sorted(key for key in adapter.weights if (key[0], _group_of(key[1])) not in self.stacks)
        if missing:  # a projection the model built without the hook: a mixture-of-experts MLP
            layer, module = missing[0]
            raise AdapterRefused(f"layer {layer} {module}", "this model has no dense projection there to adapt")
        for (layer, group), stack in self.stacks.items():
            stack.clear(slot)
            for part, module in enumerate(GROUPS[group]):
                if (pair := adapter.weights.get((layer, module))) is not None:
                    a, b = pair if self.split is None else self.split.split(module, *pair)
                    stack.put(slot, part, a.to(self.dtype), b.to(self.dtype))
        self.names[slot] = adapter.name

    def apply(self, update: SlotUpdate) -> None:
        if update.adapter is None:
            self.unload(update.slot)
        else:
            self.load(update.slot, update.adapter)

    def unload(self, slot: int) -> None:
        self.check_slot(slot)
        for stack in self.stacks.values():
            stack.clear(slot)
        self.names.pop(slot, None)

    def check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.max_loras:
            raise AdapterRefused("slot", f"{slot}: must be 1..{self.max_loras} (--max-loras; 0 is the base model)")


def _group_of(module: str) -> str:
    return next(group for group, modules in GROUPS.items() if module in modules)


def lora_op(device: torch.device, cpu_kernels: bool) -> LoraOp:
    """The backend's op: the C++ kernel on the CPU (with the fused forward), Triton on CUDA, else the reference."""
    if device.type == "cuda":
        from kernels.triton import lora as triton_lora

        return triton_lora.lora
    if cpu_kernels and cpu_ops.available():
        return cpu_ops.lora
    return lora_reference.lora


def check_step_slots(seqs: SeqColumns, slots: LoraSlots | None) -> None:
    """Every row names the base (0) or a slot an adapter is loaded in (InvalidStep
    otherwise: the scheduler's idea of the worker's slots is wrong)."""
    if not len(seqs.lora_slots):
        return
    loaded = np.zeros(1 + (slots.max_loras if slots else 0), dtype=bool)
    loaded[0] = True
    if slots is not None:
        loaded[list(slots.names)] = True
    named = seqs.lora_slots
    bad = (named < 0) | (named >= len(loaded))
    bad[~bad] = ~loaded[named[~bad]]
    if (rows := np.flatnonzero(bad)).size:
        row = int(rows[0])
        why = "no adapter is loaded there" if slots else "this worker runs without --enable-lora"
        raise InvalidStep(row_field("lora_slots", row), f"slot {named[row]}: {why}")
