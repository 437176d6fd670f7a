"""docker-compose.yml read as Compose reads it, without a Docker engine: the paths, the
model mount, `${VAR:-default}` interpolation and a service's environment (shared by
tests/unit/test_compose.py and test_compose_cpu.py)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKER = REPO / "docker"
MODEL_MOUNT = "/models/model"


def interpolate(value):
    """${VAR:-default} / ${VAR} as Compose does, with the variables unset (the defaults)."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def env_of(service: dict) -> dict[str, str]:
    env = service["environment"]
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}
