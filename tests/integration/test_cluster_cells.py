"""`make cluster CELLS=2` (tools.cluster_ctl up --cells 2): two schedulers, each
with its own worker, and the gateway in front of both (--schedulers), as detached
processes; a request through the gateway is served, `status` lists every service,
`down` stops them all."""

from __future__ import annotations

import json

import httpx

from tests.helpers.checkpoints import tiny_checkpoint
from tools import cluster_ctl


def test_two_cells_behind_one_gateway(tmp_path, capsys):
    run_dir = tmp_path / "run"
    up = [
        "--run-dir",
        str(run_dir),
        "up",
        "--model",
        str(tiny_checkpoint("llama")),
        "--workers",
        "1",
        "--cells",
        "2",
        "--port",
        "0",
        "--gateway-port",
        "0",
        "--worker-args",
        "--dtype float32 --num-blocks 64",
    ]
    try:
        assert cluster_ctl.main(up) == 0, capsys.readouterr().err
        addresses = json.loads((run_dir / "cluster.json").read_text())
        assert {"worker-0", "worker-1", "scheduler-0", "scheduler-1", "gateway"} <= set(addresses)
        gateway_cmd = (run_dir / "gateway.log").read_text()
        assert f"--schedulers {addresses['scheduler-0']},{addresses['scheduler-1']}" in gateway_cmd
        for cell in (0, 1):  # each scheduler drives its own worker
            log = (run_dir / f"scheduler-{cell}.log").read_text()
            assert f"--workers {addresses[f'worker-{cell}']}" in log
        reply = httpx.post(
            f"http://{addresses['gateway']}/v1/completions",
            json={"prompt": list(range(5, 45)), "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        capsys.readouterr()
        assert cluster_ctl.main(["--run-dir", str(run_dir), "status"]) == 0
        listed = capsys.readouterr().out
        assert all(name in listed for name in ("worker-0", "worker-1", "scheduler-0", "scheduler-1", "gateway"))
    finally:
        assert cluster_ctl.main(["--run-dir", str(run_dir), "down"]) == 0
    assert cluster_ctl._alive_pids(run_dir) == {}
