"""deploy/kubernetes: every manifest validates against the Kubernetes schemas of a
pinned release (kubernetes-validate, strict: unknown fields fail; offline, the
schemas ship in the package), and the pieces fit together: settings are fields of
the services' config dataclasses, the scheduler's --workers is the DNS name of the
workers' headless Service, probes hit ports the containers expose, PDBs and
NetworkPolicies select the pods they mean, and the internal hops are authenticated
by default (mutual TLS to the workers, an admin key on admin.v1) with the Secrets
`python -m tools.certs --kubernetes` makes. Overlays are rendered here with the
small part of kustomize they use (strategic-merge patches); when kubectl is
installed, `kubectl kustomize` must render the same."""

from __future__ import annotations

import base64
import copy
import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gateway_svc.config import GatewayConfig
from proto import admin_pb2, serving_pb2, worker_pb2
from scheduler_svc.config import SchedulerConfig
from svc_common.cli import env_name, flag_name, parse_config
from tests.helpers.k8s import (
    K8S,
    KUBERNETES_VERSION,
    MODEL_MOUNT,
    container,
    container_port,
    env_list,
    env_values,
    kustomization,
    of_kind,
    render,
    selects,
    service,
    service_port,
    workloads,
)
from tools.certs import SCHEDULER_CLIENT_NAME
from worker_svc.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = ("base",)

CONFIGS = {
    "worker": (WorkerConfig, "PAGEDSERVE_WORKER"),
    "scheduler": (SchedulerConfig, "PAGEDSERVE_SCHEDULER"),
    "gateway": (GatewayConfig, "PAGEDSERVE_GATEWAY"),
}
# Settings of features being built elsewhere, allowed in the manifests before their
# config field exists (test_pending_settings_exist reports them as xfail until then).
PENDING: dict[str, set[str]] = {}
# Env vars that are not service settings, and why they may appear.
OTHER_ENV = {
    "POD_NAMESPACE",  # downward API, for $(POD_NAMESPACE) in DNS names
    "HOME",
    "HF_HUB_OFFLINE",
}  # the worker's read-only root filesystem and local model
HEALTHCHECK = REPO / "docker" / "healthcheck.py"
HEALTHCHECK_IN_IMAGE = "/usr/local/bin/pagedserve-healthcheck"
HEALTH_SERVICES = {  # the grpc.health.v1 service names the services register
    "worker": worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
    "scheduler": serving_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name,
    "scheduler-admin": admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
}
EXPECTED_KINDS = {
    "StatefulSet": 1,
    "Deployment": 2,
    "Service": 4,
    "PodDisruptionBudget": 2,
    "PersistentVolumeClaim": 1,
    "NetworkPolicy": 2,
}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


RENDERED = {overlay: render(K8S / overlay) for overlay in OVERLAYS}


def test_layout_and_kinds():
    listed = kustomization(K8S / "base")["resources"]
    on_disk = sorted(p.name for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk  # nothing left out, nothing missing
    # overlays/: tests/unit/test_k8s_disaggregated.py
    assert sorted(p.name for p in K8S.iterdir() if p.is_dir()) == [*OVERLAYS, "overlays"]
    for overlay, docs in RENDERED.items():
        kinds = {k: len(of_kind(docs, k)) for k in {d["kind"] for d in docs}}
        assert kinds == EXPECTED_KINDS, overlay
        assert set(workloads(docs)) == set(CONFIGS)
        for d in docs:
            # Namespace-agnostic: applied with -n or an overlay's `namespace:`.
            assert "namespace" not in d["metadata"], d["metadata"]["name"]
            assert d["metadata"]["name"].startswith("pagedserve-")
            assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "pagedserve"


@pytest.mark.parametrize(
    "overlay,index",
    [(o, i) for o in OVERLAYS for i in range(len(RENDERED[o]))],
    ids=[f"{o}-{d['kind']}-{d['metadata']['name']}" for o in OVERLAYS for d in RENDERED[o]],
)
def test_manifest_matches_the_kubernetes_schema(overlay, index):
    kubernetes_validate.validate(RENDERED[overlay][index], KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_unknown_fields():
    """Guards the test above against passing vacuously (a lax or missing schema)."""
    worker = copy.deepcopy(workloads(RENDERED["base"])["worker"])
    container(worker)["readinessProbe"]["exec"]["comand"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        kubernetes_validate.validate(worker, KUBERNETES_VERSION, strict=True)
    worker = copy.deepcopy(workloads(RENDERED["base"])["worker"])
    container(worker)["resources"]["limits"]["nvidia.com/gpu"] = [1]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, KUBERNETES_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed; render() was checked above")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubectl_kustomize_renders_the_same(overlay):
    result = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    key = lambda d: (d["kind"], d["metadata"]["name"])
    assert sorted(yaml.safe_load_all(result.stdout), key=key) == sorted(RENDERED[overlay], key=key)


# ---- settings ----------------------------------------------------------------------------
def config_fields(component: str) -> set[str]:
    return {f.name for f in dataclasses.fields(CONFIGS[component][0])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_are_config_fields(overlay):
    healthcheck_vars = set(re.findall(r"PAGEDSERVE_HEALTHCHECK_\w+", HEALTHCHECK.read_text()))
    checked = 0
    for component, workload in workloads(RENDERED[overlay]).items():
        c = container(workload)
        cls, prefix = CONFIGS[component]
        fields = config_fields(component) | PENDING.get(component, set())
        defined: set[str] = set()
        for e in env_list(c):
            name = e["name"]
            if name.startswith(prefix + "_"):
                assert name[len(prefix) + 1 :].lower() in fields, f"{component}: {name} is no {cls.__name__} field"
                checked += 1
            elif name.startswith("PAGEDSERVE_HEALTHCHECK_"):
                assert name in healthcheck_vars, f"{component}: docker/healthcheck.py does not read {name}"
            else:
                assert name in OTHER_ENV, f"{component}: unexpected env var {name}"
            # Kubernetes expands $(VAR) only for variables defined earlier in the list.
            for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                assert ref in defined, f"{component}: {name} uses $({ref}) before it is defined"
            assert name not in defined, f"{component}: {name} twice"
            defined.add(name)
        for arg in c.get("args", []) + c.get("command", []):  # none today; flags would be checked the same way
            if arg.startswith("--"):
                flag = arg.split("=", 1)[0]
                assert flag in {flag_name(f) for f in fields}, f"{component}: unknown flag {flag}"
        assert env_values(c)[f"{prefix}_HOST"] == "0.0.0.0"  # reachable from other pods and the kubelet
    assert checked >= 25  # the env vars above were really looked at


@pytest.fixture(scope="module")
def cell_secrets() -> dict[tuple[str, str], bytes]:
    """(Secret, key) -> value, as `python -m tools.certs --kubernetes` makes them."""
    from tools.certs import kubernetes_secrets, make

    docs = yaml.safe_load_all(kubernetes_secrets(make(["pagedserve-worker.default.svc.cluster.local"], 1)))
    return {(d["metadata"]["name"], k): base64.b64decode(v) for d in docs for k, v in d["data"].items()}


def secret_files(workload: dict, secrets: dict[tuple[str, str], bytes], into: Path) -> dict[str, str]:
    """mount path of each file of the pod's Secret volumes -> where its content is written here."""
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    files = {}
    for mount in container(workload)["volumeMounts"]:
        if mount["name"] in volumes:
            for (secret, key), content in secrets.items():
                if secret == volumes[mount["name"]]:
                    local = into / secret / key
                    local.parent.mkdir(exist_ok=True)
                    local.write_bytes(content)
                    files[f"{mount['mountPath']}/{key}"] = str(local)
    return files


@pytest.mark.parametrize("component", list(CONFIGS))
def test_base_settings_parse_and_validate(component, monkeypatch, default_model, cell_secrets, tmp_path):
    """The base's values pass the services' own parsing and validation. The model
    directory and the Secrets exist only inside the pod: the local default model
    (conftest) and what `python -m tools.certs --kubernetes` makes stand in."""
    cls, prefix = CONFIGS[component]
    for key in [k for k in os.environ if k.startswith(prefix)]:
        monkeypatch.delenv(key)
    workload = workloads(RENDERED["base"])[component]
    files = secret_files(workload, cell_secrets, tmp_path)
    values = env_values(container(workload))
    for name, value in values.items():
        if name.startswith(prefix + "_"):
            value = value.replace("$(POD_NAMESPACE)", "default")
            monkeypatch.setenv(name, str(default_model) if value == MODEL_MOUNT else files.get(value, value))
    for e in env_list(container(workload)):  # values from the required Secrets (optional ones left unset)
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref and not ref.get("optional", False):
            monkeypatch.setenv(e["name"], cell_secrets[(ref["name"], ref["key"])].decode())
    config = parse_config(cls, prefix, component, [])
    assert config.host == "0.0.0.0" and str(config.port) == values[f"{prefix}_PORT"]
    if component == "scheduler":  # the workers come from the headless Service's DNS records
        assert [str(t) for t in config.worker_targets] == ["dns:///pagedserve-worker.default.svc.cluster.local:50061"]
        assert all(t.dns for t in config.worker_targets)
    if component == "gateway":  # and the schedulers from theirs
        assert config.schedulers == "dns:///pagedserve-schedulers.default.svc.cluster.local:50051"
        assert config.scheduler_routing == "prefix"  # validated: the model directory has tokenizer.json


def test_pending_settings_exist():
    missing = {(c, f) for c, names in PENDING.items() for f in names if f not in config_fields(c)}
    if missing:
        pytest.xfail(f"set in deploy/kubernetes before the config field exists: {sorted(missing)}")


# ---- how the pieces connect --------------------------------------------------------------
def worker_dns_target(worker_service: dict, namespace: str = "$(POD_NAMESPACE)") -> str:
    """What the scheduler's --workers must be: gRPC's dns:/// target for the headless
    Service's name in the pod's namespace, at the worker port."""
    port = service_port(worker_service, "grpc")["port"]
    return f"dns:///{worker_service['metadata']['name']}.{namespace}.svc.cluster.local:{port}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_headless_service_and_discovery(overlay):
    docs = RENDERED[overlay]
    worker = workloads(docs)["worker"]
    svc = service(docs, worker["spec"]["serviceName"])  # the StatefulSet's governing Service
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is False  # only ready workers in DNS
    assert selects({"matchLabels": svc["spec"]["selector"]}, worker["spec"]["template"]["metadata"]["labels"])
    assert selects(worker["spec"]["selector"], worker["spec"]["template"]["metadata"]["labels"])
    c = container(worker)
    port = service_port(svc, "grpc")
    # Headless: clients dial pod IPs at the Service's port, so it must be the worker's.
    assert port["port"] == container_port(c, port["targetPort"]) == int(env_values(c)["PAGEDSERVE_WORKER_PORT"])

    scheduler = container(workloads(docs)["scheduler"])
    assert env_values(scheduler)["PAGEDSERVE_SCHEDULER_WORKERS"] == worker_dns_target(svc)
    assert worker_dns_target(svc, "ns1") == "dns:///pagedserve-worker.ns1.svc.cluster.local:50061"
    (namespace,) = [e for e in env_list(scheduler) if e["name"] == "POD_NAMESPACE"]
    assert namespace["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert float(env_values(scheduler)["PAGEDSERVE_SCHEDULER_WORKER_DISCOVERY_INTERVAL_S"]) > 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_expose_the_configured_ports(overlay):
    docs = RENDERED[overlay]
    loads = workloads(docs)
    sched = container(loads["scheduler"])
    env = env_values(sched)
    svc = service(docs, "pagedserve-scheduler")
    pod_labels = {c: w["spec"]["template"]["metadata"]["labels"] for c, w in loads.items()}
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels["scheduler"])
    for port_name, setting in (("grpc", "PORT"), ("grpc-admin", "ADMIN_PORT"), ("metrics", "METRICS_PORT")):
        port = service_port(svc, port_name)
        assert container_port(sched, port["targetPort"]) == int(env[f"PAGEDSERVE_SCHEDULER_{setting}"]), port_name
    annotations = svc["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == int(env["PAGEDSERVE_SCHEDULER_METRICS_PORT"])
    assert env["PAGEDSERVE_SCHEDULER_ADMIN_HOST"] == "0.0.0.0"  # probed by the kubelet on the pod IP

    gateway = container(loads["gateway"])
    # The gateway finds every scheduler through the headless Service (several cells: several).
    pool = service(docs, "pagedserve-schedulers")
    assert pool["spec"]["clusterIP"] == "None" and pool["spec"]["publishNotReadyAddresses"] is False
    assert selects({"matchLabels": pool["spec"]["selector"]}, pod_labels["scheduler"])
    port = service_port(pool, "grpc")
    assert port["port"] == container_port(sched, port["targetPort"]) == int(env["PAGEDSERVE_SCHEDULER_PORT"])
    gateway_env = env_values(gateway)
    assert gateway_env["PAGEDSERVE_GATEWAY_SCHEDULERS"] == (
        f"dns:///{pool['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local:{port['port']}"
    )
    assert float(gateway_env["PAGEDSERVE_GATEWAY_SCHEDULER_DISCOVERY_INTERVAL_S"]) > 0
    gw_svc = service(docs, "pagedserve-gateway")
    assert selects({"matchLabels": gw_svc["spec"]["selector"]}, pod_labels["gateway"])
    assert container_port(gateway, service_port(gw_svc, "http")["targetPort"]) == int(
        env_values(gateway)["PAGEDSERVE_GATEWAY_PORT"]
    )


def probe_target(c: dict, probe: dict) -> tuple[str, int, str]:
    """(kind, container port, gRPC service or HTTP path) of a probe with exactly one handler."""
    handlers = [h for h in ("grpc", "httpGet", "tcpSocket", "exec") if h in probe]
    assert len(handlers) == 1, handlers
    h = handlers[0]
    if h == "grpc":
        return "grpc", container_port(c, probe["grpc"]["port"]), probe["grpc"]["service"]
    if h == "httpGet":
        return "http", container_port(c, probe["httpGet"]["port"]), probe["httpGet"]["path"]
    if h == "tcpSocket":
        return "tcp", container_port(c, probe["tcpSocket"]["port"]), ""
    command = probe["exec"]["command"]
    assert command[:3] == ["python", HEALTHCHECK_IN_IMAGE, "grpc"], command  # docker/healthcheck.py
    host, port = command[3].rsplit(":", 1)
    assert host == "127.0.0.1"
    return "grpc", container_port(c, int(port)), command[4]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_exposed_ports_and_registered_health_services(overlay):
    loads = workloads(RENDERED[overlay])
    targets = {}
    for component, workload in loads.items():
        c = container(workload)
        assert {"readinessProbe", "livenessProbe"} <= set(c), component
        targets[component] = {p: probe_target(c, c[p]) for p in PROBES if p in c}
    worker_port = int(env_values(container(loads["worker"]))["PAGEDSERVE_WORKER_PORT"])
    assert set(targets["worker"].values()) == {("grpc", worker_port, HEALTH_SERVICES["worker"])}
    assert len(targets["worker"]) == 3
    sched_env = env_values(container(loads["scheduler"]))
    sched_port = int(sched_env["PAGEDSERVE_SCHEDULER_PORT"])
    admin_port = int(sched_env["PAGEDSERVE_SCHEDULER_ADMIN_PORT"])
    assert targets["scheduler"] == {
        "readinessProbe": ("grpc", sched_port, HEALTH_SERVICES["scheduler"]),
        "startupProbe": ("grpc", admin_port, HEALTH_SERVICES["scheduler-admin"]),
        "livenessProbe": ("grpc", admin_port, HEALTH_SERVICES["scheduler-admin"]),
    }
    gw_port = int(env_values(container(loads["gateway"]))["PAGEDSERVE_GATEWAY_PORT"])
    assert targets["gateway"] == {"readinessProbe": ("http", gw_port, "/health"), "livenessProbe": ("tcp", gw_port, "")}
    assert "/health" in gateway_get_routes()
    # Native gRPC probes cannot speak TLS: the worker serves mutual TLS, so the script probes it.
    assert "PAGEDSERVE_WORKER_TLS_CLIENT_CA" in env_values(container(loads["worker"]))
    assert all("exec" in container(loads["worker"])[p] for p in PROBES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_and_network_policies_select_pods(overlay):
    docs = RENDERED[overlay]
    labels = {c: w["spec"]["template"]["metadata"]["labels"] for c, w in workloads(docs).items()}

    def selected(selector: dict) -> list[str]:
        return [c for c, pod_labels in labels.items() if selects(selector, pod_labels)]

    # One scheduler only: a PDB would block every node drain.
    assert sorted(c for pdb in of_kind(docs, "PodDisruptionBudget") for c in selected(pdb["spec"]["selector"])) == [
        "gateway",
        "worker",
    ]
    assert all(len(selected(pdb["spec"]["selector"])) == 1 for pdb in of_kind(docs, "PodDisruptionBudget"))
    policies = {tuple(selected(p["spec"]["podSelector"])): p for p in of_kind(docs, "NetworkPolicy")}
    assert set(policies) == {("worker",), ("scheduler",)}
    (rule,) = policies[("worker",)]["spec"]["ingress"]
    assert [selected(peer["podSelector"]) for peer in rule["from"]] == [["scheduler"]]
    worker = container(workloads(docs)["worker"])
    assert [container_port(worker, p["port"]) for p in rule["ports"]] == [50061]
    sched = container(workloads(docs)["scheduler"])
    opened = {container_port(sched, p["port"]) for r in policies[("scheduler",)]["spec"]["ingress"] for p in r["ports"]}
    assert opened == {p["containerPort"] for p in sched["ports"]}


def test_images_gpus_model_volume_and_security_context():
    docs = RENDERED["base"]
    (pvc,) = of_kind(docs, "PersistentVolumeClaim")
    for component, workload in workloads(docs).items():
        pod = workload["spec"]["template"]["spec"]
        c = container(workload)
        assert c["image"].split(":")[0] == f"pagedserve-{component}"
        dockerfile = (REPO / "docker" / f"{component}.Dockerfile").read_text()
        uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile).group(1))
        assert re.search(r"^USER pagedserve$", dockerfile, re.M)
        # The images' USER is a name: runAsNonRoot needs the numeric uid to check.
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == uid
        assert pod["enableServiceLinks"] is False  # PAGEDSERVE_<SERVICE>_PORT=tcp://... would clash
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert "/tmp" in mounts
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (1 if component == "worker" else None), component
        if component == "worker":  # one GPU per tensor-parallel rank, and room in /dev/shm for NCCL
            assert int(env_values(c)["PAGEDSERVE_WORKER_TENSOR_PARALLEL_SIZE"]) == gpus
            (shm,) = [v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"]["name"]]
            assert shm["emptyDir"]["medium"] == "Memory"
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        model_setting = "MODEL_DIR" if component == "gateway" else "MODEL"
        assert env_values(c)[f"{CONFIGS[component][1]}_{model_setting}"] == MODEL_MOUNT
        model = mounts[MODEL_MOUNT]
        assert model["readOnly"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == model["name"]]
        assert volume["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"], "readOnly": True}
    assert workloads(docs)["scheduler"]["spec"]["replicas"] == 1
    assert workloads(docs)["scheduler"]["spec"]["strategy"]["type"] == "Recreate"  # never two schedulers at once


def test_internal_hops_are_authenticated_with_files_from_secret_volumes(cell_secrets):
    """Mutual TLS between scheduler and workers and an admin key on admin.v1 are the default:
    every file comes from a Secret volume the one-liner (tools/certs.py) makes, and the
    admin key from its Secret, required (no pod starts without it)."""
    loads = workloads(RENDERED["base"])
    expected = {
        "worker": {"tls_cert", "tls_key", "tls_client_ca"},
        "scheduler": {"worker_tls_ca", "worker_tls_cert", "worker_tls_key"},
    }
    for component, settings in expected.items():
        c = container(loads[component])
        pod = loads[component]["spec"]["template"]["spec"]
        env = env_values(c)
        secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"] if m["name"] in secrets}
        assert secrets and mounts, component
        files = {s: env[env_name(CONFIGS[component][1], s)] for s in settings}
        files |= {
            k: v
            for k, v in env.items()
            if k.startswith("PAGEDSERVE_HEALTHCHECK_") and k != "PAGEDSERVE_HEALTHCHECK_SERVER_NAME"
        }
        for setting, path in files.items():
            directory, name = path.rsplit("/", 1)
            assert directory in mounts, f"{component}: {setting}={path} is not in a secret volume"
            assert name in ("tls.crt", "tls.key", "ca.crt")  # cert-manager's Secret layout
        assert all(s["defaultMode"] == 0o440 for s in secrets.values())
        assert {(s["secretName"], n) for s in secrets.values() for n in ("tls.crt", "tls.key", "ca.crt")} <= set(
            cell_secrets
        )
    (admin_key,) = [
        e for e in env_list(container(loads["scheduler"])) if e["name"] == "PAGEDSERVE_SCHEDULER_ADMIN_KEYS"
    ]
    ref = admin_key["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) in cell_secrets and not ref.get("optional", False)
    worker_env = env_values(container(loads["worker"]))
    assert worker_env["PAGEDSERVE_WORKER_TLS_CLIENT_NAMES"] == SCHEDULER_CLIENT_NAME  # not the workers' own
    svc = service(RENDERED["base"], "pagedserve-worker")
    # The name the health check expects in the worker's certificate: the one the scheduler dials.
    assert (
        worker_env["PAGEDSERVE_HEALTHCHECK_SERVER_NAME"]
        == worker_dns_target(svc).removeprefix("dns:///").rsplit(":", 1)[0]
    )


def gateway_get_routes() -> set[str]:
    """The paths the gateway's app answers GET on (built without a scheduler: routes
    only reach it when called)."""
    from gateway_svc.app import create_app
    from gateway_svc.config import GatewayConfig

    app = create_app(None, GatewayConfig())  # type: ignore[arg-type]
    return {route.path for route in app.routes if "GET" in getattr(route, "methods", set())}
