"""The launchers' disaggregated fleets (make serve / make cluster PREFILL=P DECODE=D):
the argument building only, no process started."""

from __future__ import annotations

import argparse

import pytest

from tools import cluster_ctl, local_cluster
from tools.processes import Cluster, kv_roles

PREFILL, DECODE = ["--kv-role", "prefill"], ["--kv-role", "decode"]


def test_roles_replace_the_worker_count_prefill_first():
    assert kv_roles(2) == [[], []]  # no roles: WORKERS workers, no flag (both)
    assert kv_roles(5, prefill=1, decode=2) == [PREFILL, DECODE, DECODE]


@pytest.mark.parametrize(("prefill", "decode", "says"), [(1, 0, "needs both"), (0, 2, "needs both"), (-1, 1, ">= 0")])
def test_half_a_disaggregated_fleet_is_refused_by_name(prefill, decode, says):
    with pytest.raises(ValueError, match=says):
        kv_roles(1, prefill, decode)


def test_make_serve_workers_carry_their_roles(tmp_path):
    cluster = Cluster(tmp_path, ["--dtype", "float32"], num_workers=1, prefill=1, decode=2, secure=False)
    assert [w.args for w in cluster.workers] == [
        ["--model", str(tmp_path), "--dtype", "float32", *r]
        for r in [
            PREFILL,
            DECODE,
            DECODE,
        ]
    ]


def test_make_cluster_gives_every_cell_its_prefill_and_decode_workers():
    args = argparse.Namespace(workers=3, prefill=1, decode=2, cells=2, host="127.0.0.1", worker_base_port=50061)
    services = cluster_ctl.worker_services(args, ["--model", "m"])
    assert [(s.name, s.args[2:], s.port) for s in services] == [
        ("worker-0", PREFILL, 50061),
        ("worker-1", DECODE, 50062),
        ("worker-2", DECODE, 50063),
        ("worker-3", PREFILL, 50064),
        ("worker-4", DECODE, 50065),
        ("worker-5", DECODE, 50066),
    ]


@pytest.mark.parametrize("main", [local_cluster.main, lambda argv: cluster_ctl.main(["up", *argv])])
def test_launchers_refuse_a_prefill_pool_without_decode(main, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path), "--prefill", "1"])
    assert "--prefill/--decode: PREFILL=1 DECODE=0" in capsys.readouterr().err


def test_compose_workers_take_a_role_both_by_default():
    import yaml

    from tools.processes import REPO

    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    for n in (0, 1):
        env = services[f"worker-{n}"]["environment"]
        assert env["PAGEDSERVE_WORKER_KV_ROLE"] == f"${{WORKER{n}_KV_ROLE:-both}}"
        # Only the scheduler may call unless disaggregated (the decode worker's certificate then).
        assert env["PAGEDSERVE_WORKER_TLS_CLIENT_NAMES"] == "${WORKER_TLS_CLIENT_NAMES:-pagedserve-scheduler}"
