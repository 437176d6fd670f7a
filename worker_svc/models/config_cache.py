"""transformers' reading of a config.json, kept on disk between worker starts.

`AutoConfig` imports the family's config class, and in transformers 5 that pulls
its validators, `activations`, the hub-kernels integration, `torch._dynamo` and
`torch.distributed.tensor`: 3.7 s of a quiet worker's ~8 s start on this 2-core
machine, for a file of a few hundred bytes. What the class makes of the file (its
defaults filled in, rope parameters standardised) is a function of the file's
bytes and transformers' version alone, so the first start stores it under a key
of those two, and later starts (restarts, more workers, the test suite's) rebuild
the same values as a plain `PretrainedConfig` with the class's attribute aliases.

A folder per user (PAGEDSERVE_CONFIG_CACHE, default ~/.cache/pagedserve/configs),
shared by checkouts safely: every entry is keyed by all its inputs, and written to
a temporary name then renamed, so two starts at once write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import transformers
from transformers import PretrainedConfig

log = structlog.get_logger("worker_svc.models.config_cache")

ENV = "PAGEDSERVE_CONFIG_CACHE"
FORMAT = 1  # bump when an entry's layout changes


def cache_root() -> Path:
    return Path(os.environ.get(ENV, Path.home() / ".cache" / "pagedserve" / "configs"))


def transformers_version() -> str:
    return transformers.__version__


def entry_path(config_json: bytes) -> Path:
    digest = hashlib.sha256(config_json)
    digest.update(f"\0transformers {transformers_version()}\0format {FORMAT}".encode())
    return cache_root() / f"{digest.hexdigest()}.json"


def cached_config(config_path: Path, read: Callable[[], PretrainedConfig]) -> PretrainedConfig:
    """The config `read()` makes of config_path, from the cache when it holds it."""
    entry = entry_path(config_path.read_bytes())
    try:
        return _rebuild(json.loads(entry.read_text()))
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as exc:  # a damaged entry: read afresh and overwrite
        log.warning("config cache entry unreadable, reading the config afresh", entry=str(entry), error=str(exc))
    cfg = read()
    _store(entry, _entry_of(cfg))
    return cfg


def _entry_of(cfg: PretrainedConfig) -> dict[str, Any]:
    return {"class": type(cfg).__name__, "attribute_map": dict(cfg.attribute_map), "config": cfg.to_dict()}


def _rebuild(entry: dict[str, Any]) -> PretrainedConfig:
    """The class's values, and its aliases (attribute_map: Qwen3-MoE's num_experts is
    num_local_experts), on transformers' base config."""
    values: dict[str, Any] = entry["config"]
    names = {"attribute_map": entry["attribute_map"], "model_type": values["model_type"]}
    shape: type[PretrainedConfig] = type(entry["class"], (PretrainedConfig,), names)
    cfg: PretrainedConfig = shape.from_dict(values)
    return cfg


def _store(entry: Path, content: dict[str, Any]) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, suffix=".tmp", delete=False) as out:
            json.dump(content, out, sort_keys=True)
        os.replace(out.name, entry)
    except OSError as exc:  # a read-only home: every start reads the config itself
        log.info("config cache not written", entry=str(entry), error=str(exc))
