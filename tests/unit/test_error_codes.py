"""Only scheduler_svc/api/status.py knows gRPC status codes: below the API layer
errors are domain exceptions, a stream that ends in error carries one, and the
table in api/status.py gives each its code."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from scheduler_svc.api.status import status_code
from scheduler_svc.engine.errors import SchedulerBug, WorkerUnavailable
from scheduler_svc.engine.streams import StreamEvent

PACKAGE = Path(__file__).resolve().parents[2] / "scheduler_svc"
CODE_NAMES = {code.name for code in grpc.StatusCode}
# The client side of other services' calls: the worker client reads the codes of its
# Step/Info calls (which failures are transient) and turns them into WorkerCallFailed.
CLIENTS = {"engine/worker_client.py", "client.py", "observability/top.py"}


def _below_the_api() -> list[Path]:
    paths = (p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "api")
    return sorted(p for p in paths if str(p.relative_to(PACKAGE)) not in CLIENTS)


@pytest.mark.parametrize("path", _below_the_api(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_status_code_below_the_api_layer(path: Path):
    tree = ast.parse(path.read_text())
    names = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in CODE_NAMES]
    attrs = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "StatusCode"]
    assert not names and not attrs, f"{path.name} names gRPC status codes: {names or attrs}"


def test_stream_errors_are_domain_errors_with_one_code_each():
    assert StreamEvent(error=WorkerUnavailable("gone")).error is not None
    assert status_code(WorkerUnavailable("worker lost")) is grpc.StatusCode.UNAVAILABLE
    assert status_code(SchedulerBug("worker rejected a step")) is grpc.StatusCode.INTERNAL
