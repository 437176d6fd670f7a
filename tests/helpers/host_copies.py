"""Counting the sampling path's device-to-host copies: the worker reads a step's
results in one packed copy, and a stray .tolist() or .item() is a hidden one."""

from __future__ import annotations

import pytest
import torch


def record_host_copies(monkeypatch) -> list[tuple[int, ...]]:
    """From now on (for this test) the shape of every Tensor.cpu() joins the returned
    list, and tolist() or item() on any tensor fails the test."""
    copies: list[tuple[int, ...]] = []
    original = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        copies.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("tolist on the sampling path"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item on the sampling path"))
    return copies
