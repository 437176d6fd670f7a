"""docker-compose.yml and docker/: the topology, health checks, GPU reservations,
env-var configuration, the model volume, slim images -- checked without a Docker
engine (none runs here). `docker-compose config -q` runs when the binary exists
(.ci/run installs Debian's package); otherwise the structure checks below are
the fallback."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway_svc.config import GatewayConfig
from scheduler_svc.config import SchedulerConfig
from svc_common.cli import env_name, parse_config
from svc_common.defaults import DEFAULT_MODEL
from tests.helpers.compose import COMPOSE, DOCKER, MODEL_MOUNT, REPO, env_of, interpolate
from tools.certs import SCHEDULER_CLIENT_NAME
from worker_svc.config import WorkerConfig

CONFIGS = {
    "worker": (WorkerConfig, "PAGEDSERVE_WORKER"),
    "scheduler": (SchedulerConfig, "PAGEDSERVE_SCHEDULER"),
    "gateway": (GatewayConfig, "PAGEDSERVE_GATEWAY"),
}
SECRETS_MOUNT = "/secrets"
ONE_SHOT = "secrets"  # makes the CA, certificates and admin key, then exits


@pytest.fixture(scope="module")
def full_compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()))


@pytest.fixture(scope="module")
def compose(full_compose) -> dict:
    """The long-running services (the one-shot `secrets` job has tests of its own)."""
    return {**full_compose, "services": {n: s for n, s in full_compose["services"].items() if n != ONE_SHOT}}


def kind(name: str, service: dict) -> str:
    dockerfile = service["build"]["dockerfile"]
    return re.fullmatch(r"docker/(\w+)\.Dockerfile", dockerfile).group(1)


def services_of(compose: dict, wanted: str) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if kind(n, s) == wanted}


def test_topology_one_scheduler_two_workers_one_gateway(compose):
    kinds = sorted(kind(n, s) for n, s in compose["services"].items())
    assert kinds == ["gateway", "scheduler", "worker", "worker"]
    for name, service in compose["services"].items():
        assert (REPO / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name
        assert service["image"].startswith(f"pagedserve-{kind(name, service)}:")
    ((sched_name, scheduler),) = services_of(compose, "scheduler").items()
    workers = services_of(compose, "worker")
    targets = env_of(scheduler)["PAGEDSERVE_SCHEDULER_WORKERS"].split(",")
    assert sorted(targets) == sorted(f"{n}:{env_of(w)['PAGEDSERVE_WORKER_PORT']}" for n, w in workers.items())
    assert set(scheduler["depends_on"]) == set(workers)
    assert all(d["condition"] == "service_healthy" for d in scheduler["depends_on"].values())
    ((gw_name, gateway),) = services_of(compose, "gateway").items()
    assert (
        env_of(gateway)["PAGEDSERVE_GATEWAY_SCHEDULER"]
        == f"{sched_name}:{env_of(scheduler)['PAGEDSERVE_SCHEDULER_PORT']}"
    )
    assert gateway["depends_on"][sched_name]["condition"] == "service_healthy"


def test_discovery_option_finds_every_worker_by_one_name(compose, monkeypatch, made_secrets):
    """SCHEDULER_WORKERS=dns:///workers:PORT: the name is an alias of every worker on
    the compose network, and the scheduler accepts it."""
    ((name, scheduler),) = services_of(compose, "scheduler").items()
    raw = yaml.safe_load(COMPOSE.read_text())["services"][name]["environment"]["PAGEDSERVE_SCHEDULER_WORKERS"]
    assert raw.startswith("${SCHEDULER_WORKERS:-")  # the fixed list above is only the default
    ports = set()
    for worker in services_of(compose, "worker").values():
        assert "workers" in worker["networks"]["default"]["aliases"]
        ports.add(env_of(worker)["PAGEDSERVE_WORKER_PORT"])
    (port,) = ports  # Docker's DNS gives addresses, not ports: every worker listens on the same one
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_SCHEDULER")]:
        monkeypatch.delenv(key)
    env = {**env_of(scheduler), "PAGEDSERVE_SCHEDULER_WORKERS": f"dns:///workers:{port}"}
    for key, value in env.items():
        monkeypatch.setenv(key, mounted(value, made_secrets))
    config = parse_config(SchedulerConfig, "PAGEDSERVE_SCHEDULER", name, [])
    assert [str(t) for t in config.worker_targets] == [f"dns:///workers:{port}"]
    assert config.worker_discovery_interval_s == 5


def test_workers_reserve_distinct_gpus(compose):
    gpus = []
    for name, worker in services_of(compose, "worker").items():
        devices = worker["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        gpus += devices[0]["device_ids"]
        assert env_of(worker)["PAGEDSERVE_WORKER_DEVICE"].startswith("cuda")
        # One GPU per tensor-parallel rank (WORKER_TENSOR_PARALLEL_SIZE, 1 by default).
        assert int(env_of(worker)["PAGEDSERVE_WORKER_TENSOR_PARALLEL_SIZE"]) == len(devices[0]["device_ids"])
        assert worker["shm_size"]  # NCCL's shared memory between ranks
    assert len(gpus) == len(set(gpus)) == 2
    for name, service in compose["services"].items():
        if kind(name, service) != "worker":
            assert "deploy" not in service, f"{name} needs no GPU"


def test_every_service_has_a_health_check(compose):
    for name, service in compose["services"].items():
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "/usr/local/bin/pagedserve-healthcheck"], name
        port = env_of(service)[f"PAGEDSERVE_{kind(name, service).upper()}_PORT"]
        if kind(name, service) == "gateway":
            assert test[3:] == ["http", f"http://127.0.0.1:{port}/health"]
        else:
            assert test[3] == "grpc" and test[4] == f"127.0.0.1:{port}"  # the grpc.health.v1 protocol
        assert service["healthcheck"]["start_period"]


HEALTHCHECK_VARS = set(re.findall(r"PAGEDSERVE_HEALTHCHECK_\w+", (DOCKER / "healthcheck.py").read_text()))


def mounted(value: str, secrets_dir: Path) -> str:
    """A setting as the container sees it, pointed at what the mount would show here:
    the local default model, and the files `python -m tools.certs` makes."""
    if value == MODEL_MOUNT:
        return str(REPO / DEFAULT_MODEL)
    if value.startswith(SECRETS_MOUNT + "/"):
        return str(secrets_dir / value.removeprefix(SECRETS_MOUNT + "/"))
    return value


@pytest.fixture(scope="module")
def made_secrets(full_compose, tmp_path_factory) -> Path:
    """What the `secrets` service writes into the volume, made here with its own arguments."""
    from tools.certs import main as certs

    job = full_compose["services"][ONE_SHOT]
    out = tmp_path_factory.mktemp("secrets")
    args = [str(out) if a == SECRETS_MOUNT else a for a in job["command"]]
    assert job["entrypoint"] == ["python", "-m", "tools.certs"] and certs(args) == 0
    return out


def test_configuration_is_env_vars_the_services_accept(compose, monkeypatch, made_secrets):
    for name, service in compose["services"].items():
        cls, prefix = CONFIGS[kind(name, service)]
        env = {k: v for k, v in env_of(service).items() if k not in HEALTHCHECK_VARS}  # read by healthcheck.py
        fields = {env_name(prefix, f) for f in cls.__dataclass_fields__}
        assert set(env) <= fields, f"{name}: unknown settings {set(env) - fields}"
        assert env[f"{prefix}_HOST"] == "0.0.0.0"  # reachable from the other containers
        for key in [k for k in os.environ if k.startswith(prefix)]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            # Start-up checks that files exist; here they are what the mounts would show.
            monkeypatch.setenv(key, mounted(value, made_secrets))
        config = parse_config(cls, prefix, name, [])  # validates: a bad value exits here
        assert config.host == "0.0.0.0"


def test_internal_hops_are_authenticated_by_default(full_compose, compose, made_secrets):
    """Workers listen on 0.0.0.0 (other containers reach them): they take steps only from a
    client with a certificate of the deployment's CA, which only the scheduler holds; admin.v1
    needs the admin key. Every file comes from the one-shot `secrets` job, read-only."""
    job = full_compose["services"][ONE_SHOT]
    assert job["restart"] == "no"
    names = job["command"][job["command"].index("--names") + 1].split(",")
    workers = services_of(compose, "worker")
    assert set(workers) | {"workers"} <= set(names)  # the names the scheduler dials (fixed list or the DNS alias)
    for worker in workers.values():
        env = env_of(worker)
        assert env["PAGEDSERVE_WORKER_TLS_CLIENT_CA"] == f"{SECRETS_MOUNT}/ca.crt"
        assert {env["PAGEDSERVE_WORKER_TLS_CERT"], env["PAGEDSERVE_HEALTHCHECK_CERT"]} == {
            f"{SECRETS_MOUNT}/worker.crt"
        }
        assert env["PAGEDSERVE_HEALTHCHECK_CA"] == env["PAGEDSERVE_WORKER_TLS_CLIENT_CA"]
        assert env["PAGEDSERVE_WORKER_TLS_CLIENT_NAMES"] == SCHEDULER_CLIENT_NAME  # only the scheduler calls
        assert worker["depends_on"][ONE_SHOT]["condition"] == "service_completed_successfully"
    ((_, scheduler),) = services_of(compose, "scheduler").items()
    env = env_of(scheduler)
    assert env["PAGEDSERVE_SCHEDULER_WORKER_TLS_CA"] == f"{SECRETS_MOUNT}/ca.crt"
    assert env["PAGEDSERVE_SCHEDULER_WORKER_TLS_CERT"] == f"{SECRETS_MOUNT}/scheduler-client.crt"
    assert env["PAGEDSERVE_SCHEDULER_ADMIN_KEYS_FILE"] == f"{SECRETS_MOUNT}/admin.key"
    for service in [*workers.values(), scheduler]:
        (volume,) = [v for v in service["volumes"] if v["target"] == SECRETS_MOUNT]
        assert volume == {"type": "volume", "source": "secrets", "target": SECRETS_MOUNT, "read_only": True}
    assert "secrets" in full_compose["volumes"]
    for path in {v for s in compose["services"].values() for v in env_of(s).values() if v.startswith("/secrets/")}:
        assert (made_secrets / path.removeprefix("/secrets/")).is_file(), path
    assert "gateway" not in [n for n, s in compose["services"].items() if SECRETS_MOUNT in str(s.get("volumes"))]


def test_model_directory_is_a_read_only_volume(compose):
    for name, service in compose["services"].items():
        (volume,) = [v for v in service["volumes"] if v["target"] == MODEL_MOUNT]
        assert volume["type"] == "bind" and volume["read_only"] is True
        assert volume["source"] == "./models/SmolLM2-135M-Instruct"  # the default; PAGEDSERVE_MODEL_DIR overrides
        prefix = CONFIGS[kind(name, service)][1]
        model_key = "MODEL_DIR" if kind(name, service) == "gateway" else "MODEL"
        assert env_of(service)[f"{prefix}_{model_key}"] == MODEL_MOUNT


def test_ports_are_published_on_loopback_only(compose):
    published = {}
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond this host"
            published[name] = port
    assert set(published) == {"scheduler", "gateway"}  # workers are only reachable inside the compose network


def test_docker_compose_config_accepts_the_file():
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed (.ci/run installs it); the structure checks above ran instead")
    result = subprocess.run(
        [binary, "-f", str(COMPOSE), "config", "-q"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# ---- images -----------------------------------------------------------------------
def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name.lower()] = version
    return out


@pytest.mark.parametrize("image", ["scheduler", "gateway", "worker"])
def test_image_requirements_match_the_project_pins(image):
    project = pins(REPO / "requirements.txt")
    mine = pins(DOCKER / f"requirements-{image}.txt")
    assert mine, image
    for name, version in mine.items():
        assert project.get(name) == version, f"{image}: {name}=={version} but requirements.txt has {project.get(name)}"
    text = (DOCKER / f"{image}.Dockerfile").read_text()
    for version in re.findall(r"grpcio-tools==(\S+)", text):
        assert version == project["grpcio-tools"]
    if image == "worker":
        assert f"torch=={project['torch']}" in text
    else:
        instructions = "\n".join(line for line in text.lower().splitlines() if not line.lstrip().startswith("#"))
        assert "torch" not in mine and "triton" not in mine
        assert "torch" not in instructions and "triton" not in instructions
        assert "python:3.11-slim" in text


def test_worker_image_has_cuda_and_cpu_variants():
    text = (DOCKER / "worker.Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\S+$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu\d+$", text, re.M)
    assert "BASE_IMAGE=python:3.11-slim" in text and "whl/cpu" in text  # the documented CPU build


@pytest.mark.parametrize("image", ["scheduler", "gateway", "worker"])
def test_dockerfile_copies_exist(image):
    for src in re.findall(r"^COPY (?!--from)(\S+)", (DOCKER / f"{image}.Dockerfile").read_text(), re.M):
        assert list(REPO.glob(src.rstrip("/"))), f"{image}.Dockerfile copies {src}, which does not exist"


def third_party_imports(packages: list[str]) -> set[str]:
    local = {"proto", "svc_common", "scheduler_svc", "gateway_svc", "worker_svc", "kernels"}
    found = set()
    for package in packages:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                found |= {n.split(".")[0] for n in names}
    return found - local - set(sys.stdlib_module_names)


# Import name -> the distribution in that image that provides it.
SLIM_IMAGES = {
    "scheduler": (
        ["scheduler_svc", "svc_common", "proto"],
        {
            "grpc": "grpcio",
            "grpc_health": "grpcio-health-checking",
            "grpc_reflection": "grpcio-reflection",
            "google": "protobuf",
            "structlog": "structlog",
            "tokenizers": "tokenizers",
            "prometheus_client": "prometheus_client",
            "uvicorn": "uvicorn",
            "uvloop": "uvloop",
            "rich": "rich",
            "zmq": "pyzmq",
            "msgpack": "msgpack",
            "llguidance": "llguidance",
            "numpy": "numpy",
        },
    ),
    "gateway": (
        ["gateway_svc", "svc_common", "proto"],
        {
            "grpc": "grpcio",
            "grpc_health": "grpcio-health-checking",
            "google": "protobuf",
            "structlog": "structlog",
            "fastapi": "fastapi",
            "starlette": "fastapi",
            "pydantic": "fastapi",
            "uvicorn": "uvicorn",
            "uvloop": "uvloop",
            "jinja2": "jinja2",
            "prometheus_client": "prometheus_client",
            "tokenizers": "tokenizers",  # prefix routing over several schedulers
            "httpx": "httpx",  # /metrics scrapes the schedulers' endpoints
            "numpy": "numpy",  # /v1/embeddings' base64 vectors
            "h11": "h11",  # the request-head deadline (http_protocol.py)
        },
    ),
}


@pytest.mark.parametrize("image", list(SLIM_IMAGES))
def test_slim_images_install_everything_their_code_imports(image):
    packages, provided = SLIM_IMAGES[image]
    imports = third_party_imports(packages)
    assert imports <= set(provided), f"{image} code imports {imports - set(provided)}, not installed in its image"
    requirements = pins(DOCKER / f"requirements-{image}.txt")
    assert {provided[i] for i in imports} <= set(requirements)
    text = (DOCKER / f"{image}.Dockerfile").read_text()
    for package in packages:
        assert f"COPY {package}/" in text or (package == "proto" and "proto/" in text)


# ---- the health-check script the images run -----------------------------------------
def run_healthcheck(*args: str) -> int:
    return subprocess.run(
        [sys.executable, str(DOCKER / "healthcheck.py"), *args], capture_output=True, timeout=30
    ).returncode


def test_healthcheck_script_speaks_grpc_health():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        servicer.set("worker.v1.Worker", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run_healthcheck("grpc", f"127.0.0.1:{port}") == 0
        assert run_healthcheck("grpc", f"127.0.0.1:{port}", "worker.v1.Worker") == 1
        assert run_healthcheck("grpc", f"127.0.0.1:{port}", "no.such.Service") == 1
    finally:
        server.stop(None)
    assert run_healthcheck("grpc", f"127.0.0.1:{port}") == 1  # nothing listening
    assert run_healthcheck("http", f"http://127.0.0.1:{port}/health") == 1
    assert run_healthcheck("bogus") == 2


def test_worker_image_installs_everything_its_code_imports():
    provided = {
        "grpc": "grpcio",
        "grpc_health": "grpcio-health-checking",
        "grpc_reflection": "grpcio-reflection",
        "google": "protobuf",
        "structlog": "structlog",
        "transformers": "transformers",
        "safetensors": "safetensors",
        "tokenizers": "tokenizers",
        "numpy": "numpy",
        "gguf": "gguf",  # --model FILE.gguf
        "uvloop": "uvloop",  # svc_common/event_loop.py (the worker never runs it)
    }
    imports = third_party_imports(["worker_svc", "kernels", "svc_common", "proto"])
    # torch comes from its own index in the Dockerfile; triton with the CUDA torch (GPU builds only).
    assert imports - {"torch", "triton"} <= set(provided), imports
    assert {provided[i] for i in imports - {"torch", "triton"}} <= set(pins(DOCKER / "requirements-worker.txt"))


def make_certs(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, with openssl."""

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    for name in ("server", "client"):
        ssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
        )
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        ssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.pem",
        )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")
def test_healthcheck_script_speaks_mutual_tls(tmp_path):
    make_certs(tmp_path)
    read = lambda name: (tmp_path / name).read_bytes()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [(read("server.key"), read("server.pem"))], root_certificates=read("ca.pem"), require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    env = {**os.environ, "PAGEDSERVE_HEALTHCHECK_CA": str(tmp_path / "ca.pem")}
    check = [sys.executable, str(DOCKER / "healthcheck.py"), "grpc", f"127.0.0.1:{port}"]
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert subprocess.run(check, capture_output=True, timeout=30).returncode == 1  # plaintext: refused
        assert subprocess.run(check, env=env, capture_output=True, timeout=30).returncode == 1  # no client cert
        env.update(
            PAGEDSERVE_HEALTHCHECK_CERT=str(tmp_path / "client.pem"),
            PAGEDSERVE_HEALTHCHECK_KEY=str(tmp_path / "client.key"),
        )
        result = subprocess.run(check, env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
    finally:
        server.stop(None)


def test_the_secrets_jobs_certificates_carry_mutual_tls_and_the_health_check(compose, made_secrets):
    """The worker serves with what `secrets` made: the scheduler's client certificate is
    accepted, a client without one is not, and the compose health check (its env, as the
    container has it) passes over TLS presenting the worker's own certificate."""
    worker = env_of(next(iter(services_of(compose, "worker").values())))
    read = lambda setting: Path(mounted(worker[setting], made_secrets)).read_bytes()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [(read("PAGEDSERVE_WORKER_TLS_KEY"), read("PAGEDSERVE_WORKER_TLS_CERT"))],
        root_certificates=read("PAGEDSERVE_WORKER_TLS_CLIENT_CA"),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    servicer.set("worker.v1.Worker", health_pb2.HealthCheckResponse.SERVING)

    def check(**pem: Path) -> bool:
        creds = grpc.ssl_channel_credentials(*(p.read_bytes() if p else None for p in pem.values()))
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            except grpc.RpcError:
                return False
        return True

    try:
        ca = made_secrets / "ca.crt"
        assert check(ca=ca, key=made_secrets / "scheduler-client.key", cert=made_secrets / "scheduler-client.crt")
        assert not check(ca=ca, key=None, cert=None)
        env = {**os.environ, **{k: mounted(v, made_secrets) for k, v in worker.items() if k in HEALTHCHECK_VARS}}
        command = [sys.executable, str(DOCKER / "healthcheck.py"), "grpc", f"127.0.0.1:{port}", "worker.v1.Worker"]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
    finally:
        server.stop(None)
