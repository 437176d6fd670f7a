"""Multi-LoRA on the worker: PEFT adapters read and checked (adapter.py), held in
stacked per-slot buffers the decoder's projections add (slots.py), one op per
backend (kernels/lora_reference.py, cpu_ops.lora, kernels/triton/lora.py)."""

from worker_svc.lora.adapter import AdapterRefused, LoraAdapter, read_adapter, read_files
from worker_svc.lora.slots import LoraSlots, RankSplit, SlotUpdate, check_step_slots, lora_op

__all__ = [
    "AdapterRefused",
    "LoraAdapter",
    "LoraSlots",
    "RankSplit",
    "SlotUpdate",
    "check_step_slots",
    "lora_op",
    "read_adapter",
    "read_files",
]
