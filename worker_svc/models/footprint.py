"""The bytes a loaded model's weights hold in memory, as served: what the worker
reports (InfoResponse.weights_bytes, the scheduler's Prometheus gauge), so that a
quantized model's footprint can be checked against its file (issue 38).

Counted from the objects themselves rather than from the checkpoint: packed layouts,
quantized blocks, a table kept dense, a tied head that shares its embedding's blocks,
each shows as it really is. Every tensor's storage is counted once, however many
views and holders it has.
"""

from __future__ import annotations

import dataclasses
import types

import torch


def held_bytes(root: object) -> int:
    """The bytes of every tensor reachable from `root` through attributes, dataclass
    fields, lists, tuples and dicts (modules, functions and classes are not followed:
    they are code, and would lead into torch itself)."""
    total = 0
    storages: set[int] = set()
    visited: set[int] = set()
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in visited or isinstance(obj, (types.ModuleType, types.FunctionType, type, str, bytes)):
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:  # oneDNN's packed weights have no storage to share
                total += obj.numel() * obj.element_size()
                continue
            storage = obj.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif dataclasses.is_dataclass(obj):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total
