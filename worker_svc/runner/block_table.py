"""The block tables the captured decode graphs read: one persistent device tensor
as wide as the longest sequence the worker serves, and its host mirror.

A step carries every sequence's whole table, but from one decode step to the
next almost nothing in them changes: a sequence gains a block every block_size
tokens, and rows move only when the batch does. Padding every table to
max_model_len and uploading it each step cost ~8 MB at 256 rows and a 128k
context (issue 27); instead a step compares its tables with the mirror and sends
only the entries that differ (their flat index and value, in the step's one
upload), which one index_copy_ writes into the device tensor before the replay.

Entries past a row's own table stay as an earlier step left them: attention reads
a row only up to its context length, and a padding row only position 0 of its
row, which always holds some valid block id (the table starts zeroed and only
ever receives validated ids).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.step.input import IntArray

Int32Array = npt.NDArray[np.int32]


class DeviceBlockTable:
    def __init__(self, rows: int, width: int, device: torch.device):
        self.width = width
        self.tensor = torch.zeros((rows, width), dtype=torch.int32, device=device)
        self.mirror = np.zeros((rows, width), dtype=np.int32)  # what `tensor` holds once the step's copy lands

    def changes(self, tables: Int32Array) -> tuple[IntArray, Int32Array]:
        """(flat index into the table, new value) of the entries where `tables`
        [n, w], rows 0..n-1 and columns 0..w-1 of the table, differ from it."""
        n, w = tables.shape
        assert n <= self.mirror.shape[0] and w <= self.width, (tables.shape, self.mirror.shape)
        rows, columns = np.nonzero(self.mirror[:n, :w] != tables)
        return rows.astype(np.int64) * self.width + columns, tables[rows, columns].astype(np.int32)

    def apply(
        self, flat: IntArray, values: Int32Array, flat_on_device: torch.Tensor, values_on_device: torch.Tensor
    ) -> None:
        """Write the changes: into the mirror now, into the device tensor on the
        stream (after the upload that carried them, before the forward reads them)."""
        self.mirror.reshape(-1)[flat] = values
        if flat.size:
            self.tensor.view(-1).index_copy_(0, flat_on_device, values_on_device)
