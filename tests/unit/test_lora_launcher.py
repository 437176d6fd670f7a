"""make serve / make cluster with LORA_MODULES: the workers and the scheduler get
--enable-lora and the slots, the scheduler the adapters (which its own parser reads back
as NAME=PATH pairs), the gateway the scheduler's admin.v1; without it, none of that.
Read from `make -n` (nothing runs)."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from scheduler_svc.config import SchedulerConfig
from svc_common.cli import build_parser
from tests.helpers.procs import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def quoted_args(target: str, flag: str, *make_vars: str) -> list[str]:
    """The launcher's `flag "..."` value, split as the launcher splits it."""
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", target, *make_vars],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    command = shlex.split(" ".join(line.rstrip("\\") for line in done.stdout.splitlines()))
    return shlex.split(command[command.index(flag) + 1])


@pytest.mark.parametrize("target", ["serve", "cluster"])
def test_lora_modules_reach_workers_scheduler_and_gateway(target, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    lora = (f"MODEL={tmp_path}", f"LORA_MODULES=sql={a} chat={b}", "MAX_LORAS=3", "SCHEDULER_PORT=50071")
    worker = quoted_args(target, "--worker-args", *lora)
    assert worker[worker.index("--enable-lora") :][:5] == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]
    scheduler = quoted_args(target, "--scheduler-args", *lora)
    parsed = build_parser(SchedulerConfig, "X", "").parse_args(scheduler)
    assert parsed.enable_lora and parsed.max_loras == 3 and parsed.lora_modules == [f"sql={a}", f"chat={b}"]
    config = SchedulerConfig(enable_lora=True, lora_modules=" ".join(parsed.lora_modules), max_loras=3)
    assert config.lora_module_paths == [("sql", str(a)), ("chat", str(b))]
    assert quoted_args(target, "--gateway-args", *lora) == ["--scheduler-admin", "127.0.0.1:50072"]
    plain = (f"MODEL={tmp_path}",)
    assert "--enable-lora" not in quoted_args(target, "--worker-args", *plain)
    assert "--enable-lora" not in quoted_args(target, "--scheduler-args", *plain)
    assert quoted_args(target, "--gateway-args", *plain) == []
