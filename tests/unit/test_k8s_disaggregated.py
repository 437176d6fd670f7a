"""deploy/kubernetes/overlays/disaggregated: a prefill pool and a decode pool of
workers (--kv-role). Checked with the base's tools (tests/unit/test_k8s_manifests.py:
strict Kubernetes schemas, the kustomize subset): both pools behind the one headless
Service the scheduler resolves, each StatefulSet selecting only its own pods, the
decode pool the base's workers but for its name and role, the settings parse and
validate as the worker's own config, the prefill workers let the decode workers'
certificate read blocks, and the network policy lets the decode pods reach them."""

from __future__ import annotations

import copy
import os

import kubernetes_validate
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from svc_common.cli import parse_config
from tests.helpers.k8s import (
    K8S,
    KUBERNETES_VERSION,
    MODEL_MOUNT,
    container,
    container_port,
    env_list,
    env_values,
    of_kind,
    render,
    selects,
    service,
    worker_settings,
)
from tools.certs import make
from worker_svc.config import WorkerConfig

OVERLAY = K8S / "overlays" / "disaggregated"
DOCS = render(OVERLAY)
BASE = render(K8S / "base")
ROLE_LABEL = "pagedserve.io/kv-role"


def pools() -> dict[str, dict]:
    """kv role -> its StatefulSet."""
    out = {}
    for sts in of_kind(DOCS, "StatefulSet"):
        out[env_values(container(sts))["PAGEDSERVE_WORKER_KV_ROLE"]] = sts
    return out


def labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def test_the_overlay_is_the_only_one_and_its_manifests_match_the_schemas():
    assert sorted(p.name for p in (K8S / "overlays").iterdir()) == ["cpu", "disaggregated"]  # cpu: test_k8s_cpu.py
    for doc in DOCS:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    base = {(d["kind"], d["metadata"]["name"]) for d in BASE}
    added = {(d["kind"], d["metadata"]["name"]) for d in DOCS} - base
    assert added == {("StatefulSet", "pagedserve-worker-decode"), ("NetworkPolicy", "pagedserve-worker-kv-transfer")}


def test_both_pools_sit_behind_the_one_headless_service_each_selecting_its_own_pods():
    by_role = pools()
    assert set(by_role) == {"prefill", "decode"}
    headless = service(DOCS, "pagedserve-worker")
    for role, sts in by_role.items():
        assert sts["spec"]["serviceName"] == "pagedserve-worker"
        assert labels(sts)[ROLE_LABEL] == role
        assert selects({"matchLabels": headless["spec"]["selector"]}, labels(sts))  # the scheduler finds it
        assert selects(sts["spec"]["selector"], labels(sts))
        other = by_role["decode" if role == "prefill" else "prefill"]
        assert not selects(sts["spec"]["selector"], labels(other))  # no StatefulSet adopts the other's pods
    # Every worker, of both pools, is under the PDB's one-at-a-time budget.
    (pdb,) = [p for p in of_kind(DOCS, "PodDisruptionBudget") if p["metadata"]["name"] == "pagedserve-worker"]
    assert all(selects(pdb["spec"]["selector"], labels(sts)) for sts in by_role.values())


def test_the_decode_pool_is_the_base_worker_but_for_its_name_and_role():
    (base,) = of_kind(BASE, "StatefulSet")
    decode = copy.deepcopy(pools()["decode"])
    assert decode["metadata"]["name"] == "pagedserve-worker-decode"
    decode["metadata"]["name"] = base["metadata"]["name"]
    for selector in (decode["spec"]["selector"]["matchLabels"], labels(decode)):
        assert selector.pop(ROLE_LABEL) == "decode"
    env = env_list(container(decode))
    env.remove({"name": "PAGEDSERVE_WORKER_KV_ROLE", "value": "decode"})
    assert decode == base


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pool_settings_parse_and_validate(role, monkeypatch, default_model, tmp_path):
    """As the base's test does: env in order ($(VAR) defined before use), every
    PAGEDSERVE_WORKER_* a config field, and the whole parsed and validated."""
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_WORKER")]:
        monkeypatch.delenv(key)
    c = container(pools()[role])
    defined: set[str] = set()
    for e in env_list(c):
        if "$(POD_NAMESPACE)" in e.get("value", ""):
            assert "POD_NAMESPACE" in defined, f"{e['name']} uses $(POD_NAMESPACE) before it is defined"
        defined.add(e["name"])
    for name, value in worker_settings(c, tmp_path, {MODEL_MOUNT: str(default_model)}).items():
        monkeypatch.setenv(name, value)
    config = parse_config(WorkerConfig, "PAGEDSERVE_WORKER", "worker", [])
    assert config.kv_role == role


def test_prefill_workers_let_the_decode_workers_certificate_read_blocks():
    """tools.certs issues one worker certificate for both pools: its common name must be
    among the prefill pool's --tls-client-names (with the scheduler's), in any namespace;
    the decode pool takes calls from the scheduler only."""
    files = make(["pagedserve-worker.ns1.svc.cluster.local"], 1)
    cert = x509.load_pem_x509_certificate(files["worker.crt"])
    (common_name,) = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    by_role = pools()
    prefill_names = env_values(container(by_role["prefill"]))["PAGEDSERVE_WORKER_TLS_CLIENT_NAMES"]
    names = prefill_names.replace("$(POD_NAMESPACE)", "ns1").split(",")
    assert names == ["pagedserve-scheduler", common_name.value]
    assert env_values(container(by_role["decode"]))["PAGEDSERVE_WORKER_TLS_CLIENT_NAMES"] == "pagedserve-scheduler"


def test_decode_pods_may_reach_the_prefill_pods_worker_port():
    by_role = pools()
    policies = of_kind(DOCS, "NetworkPolicy")

    def opened(to: dict, source: dict) -> set[int]:
        ports: set[int] = set()
        for policy in policies:
            if selects(policy["spec"]["podSelector"], labels(to)):
                for rule in policy["spec"]["ingress"]:
                    if any(selects(peer["podSelector"], labels(source)) for peer in rule["from"]):
                        ports |= {container_port(container(to), p["port"]) for p in rule["ports"]}
        return ports

    assert opened(by_role["prefill"], by_role["decode"]) == {50061}
    assert opened(by_role["decode"], by_role["prefill"]) == set()  # nothing reads from a decode worker
    (scheduler,) = [d for d in of_kind(DOCS, "Deployment") if d["metadata"]["name"] == "pagedserve-scheduler"]
    assert all(opened(sts, scheduler) == {50061} for sts in by_role.values())
