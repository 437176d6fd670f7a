"""The ways a step fails without the worker failing, each mapped to one gRPC
status by server.py (the only module that knows gRPC)."""

from __future__ import annotations


class InvalidStep(ValueError):
    """A malformed step (INVALID_ARGUMENT); `field` names the offending request field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class StaleStep(RuntimeError):
    """A step planned ahead names a previous step that is not the one this worker
    ran last (it restarted, or that step failed): its inputs cannot be resolved (ABORTED)."""


class WorkerDown(RuntimeError):
    """This worker cannot run steps any more (UNAVAILABLE): a tensor-parallel rank is
    gone, or a CUDA error left its device context unusable."""


class StepOutOfMemory(RuntimeError):
    """The step needed more device memory than was free (RESOURCE_EXHAUSTED); the
    worker serves on: a smaller step may fit."""


def row_field(column: str, row: int) -> str:
    """How an error names a row of a column (or of its flat slice): `seqs.token_ids[row 3]`."""
    return f"seqs.{column}[row {row}]"
