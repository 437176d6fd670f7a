"""The Kubernetes manifests as the tests read them: YAML loading, the subset of
kustomize the overlays use (resources, strategic merge patches by name), and the
lookups that connect workloads, containers, env and services."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
# The oldest Kubernetes minor the manifests are checked against (native gRPC
# probes: GA in 1.27; PDB unhealthyPodEvictionPolicy: GA in 1.31).
KUBERNETES_VERSION = "1.32"
MODEL_MOUNT = "/models/model"


# ---- loading and the kustomize subset ------------------------------------------------
def load_yaml(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization(directory: Path) -> dict:
    (doc,) = load_yaml(directory / "kustomization.yaml")
    assert doc["kind"] == "Kustomization"
    # render() implements exactly these; anything else needs kustomize here.
    assert set(doc) <= {"apiVersion", "kind", "resources", "patches"}, set(doc)
    return doc


MERGE_KEYS = {"containers": "name", "env": "name", "volumeMounts": "name", "volumes": "name"}


def strategic_merge(base, patch, key: str = ""):
    """kustomize's strategic merge for what the patches here use: maps merge, null
    deletes, lists of containers/env/volumes merge by name (the patch's entries
    first, in its order, then the base's others), other values replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        if key not in MERGE_KEYS:
            raise NotImplementedError(f"merging the list {key!r}: teach render() or use kubectl kustomize")
        by_name = {item[MERGE_KEYS[key]]: item for item in base}
        patched = [strategic_merge(by_name.get(item[MERGE_KEYS[key]], {}), item) for item in patch]
        names = {item[MERGE_KEYS[key]] for item in patch}
        return patched + [item for item in base if item[MERGE_KEYS[key]] not in names]
    return copy.deepcopy(patch)


def render(directory: Path) -> list[dict]:
    config = kustomization(directory)
    docs: list[dict] = []
    for resource in config.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else load_yaml(path)
    for entry in config.get("patches", []):
        for patch in load_yaml(directory / entry["path"]):
            (i,) = [
                i
                for i, d in enumerate(docs)
                if (d["kind"], d["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])
            ]
            docs[i] = strategic_merge(docs[i], patch)
    return docs


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def workloads(docs: list[dict]) -> dict[str, dict]:
    """component -> its StatefulSet/Deployment."""
    out = {}
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            component = d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            assert component not in out, component
            out[component] = d
    return out


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env_list(c: dict) -> list[dict]:
    return c.get("env", [])


def env_values(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in env_list(c) if "value" in e}


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # no matchExpressions here
    return bool(selector["matchLabels"]) and selector["matchLabels"].items() <= labels.items()


def container_port(c: dict, port) -> int:
    """A probe's or Service's target port (number or name) -> the container port it hits."""
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if isinstance(port, str):
        assert port in ports, f"{c['name']} has no port named {port!r}"
        return ports[port]
    assert port in ports.values(), f"{c['name']} exposes {sorted(ports.values())}, not {port}"
    return port


# ---- layout and schemas ----------------------------------------------------------------


def service(docs: list[dict], name: str) -> dict:
    (svc,) = [d for d in of_kind(docs, "Service") if d["metadata"]["name"] == name]
    return svc


def service_port(svc: dict, name: str) -> dict:
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == name]
    return port


def worker_settings(c: dict, tls_dir: Path, files: dict[str, str]) -> dict[str, str]:
    """The worker container's PAGEDSERVE_WORKER_* settings as its pod in namespace ns1
    sees them, for parse_config: its TLS Secret's files (made by tools.certs) written
    into `tls_dir`, and `files`: a path in the pod -> the local file that stands for it."""
    from tools.certs import make

    made = make(["pagedserve-worker.ns1.svc.cluster.local"], 1)
    for name, key in (("tls.crt", "worker.crt"), ("tls.key", "worker.key"), ("ca.crt", "ca.crt")):
        (tls_dir / name).write_bytes(made[key])
    settings = {}
    for name, value in env_values(c).items():
        if name.startswith("PAGEDSERVE_WORKER_"):
            value = value.replace("$(POD_NAMESPACE)", "ns1").replace("/etc/pagedserve/tls", str(tls_dir))
            settings[name] = files.get(value, value)
    return settings
