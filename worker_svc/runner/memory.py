"""Sizing the KV pool from device memory: what the decode graphs will hold beside it."""

from __future__ import annotations

import torch

from worker_svc.runner.cuda_graphs import padding_batch
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.upload import InputUploader, upload_batch


def kv_budget_bytes(requested: int, free: int, reserved: int) -> int:
    """The KV pool's bytes: --kv-cache-memory-mb, less whatever would not fit in
    the device's free memory beside `reserved` (the decode graphs' activations)."""
    return max(0, min(requested, free - reserved))


def decode_peak_bytes(runner: ModelRunner, max_num_seqs: int, table_width: int) -> int:
    """Device memory a decode of max_num_seqs rows takes beyond what is allocated
    (activations, split-KV partials, logits): what the graphs' shared pool will
    hold, measured by one eager run over `runner`'s (scratch, one-block) cache
    before the KV pool is sized. CUDA only."""
    device = runner.model.device
    assert device.type == "cuda", device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        batch = upload_batch(padding_batch(max_num_seqs, table_width), InputUploader(device))
        runner.model.logits(runner.forward(batch))
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
