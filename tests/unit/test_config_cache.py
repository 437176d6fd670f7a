"""worker_svc/models/config_cache.py: a worker start after the first reads transformers'
resolved config from the cache, and gets the same ModelSpec for every family."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import transformers

from tests.helpers.checkpoints import DENSE_FAMILIES, MOE_FAMILIES, TINY_FAMILIES, tiny_checkpoint
from tools.processes import REPO, python_path
from worker_svc.models import config_cache
from worker_svc.models.spec import load_spec, read_config

FAMILIES = TINY_FAMILIES + DENSE_FAMILIES + MOE_FAMILIES


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(config_cache.ENV, str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cached_config_gives_the_spec_transformers_class_gives(cache, family):
    model = tiny_checkpoint(family)
    fresh = load_spec(model)
    entry = config_cache.entry_path((model / "config.json").read_bytes())
    assert entry.exists() and entry.parent == cache
    cached = read_config(model)
    assert type(cached).__module__ == config_cache.__name__  # rebuilt, not transformers' class
    assert load_spec(model) == fresh
    reference = transformers.AutoConfig.from_pretrained(model).to_dict()
    assert {k: v for k, v in cached.to_dict().items() if k != "use_cache"} == {
        k: v for k, v in reference.items() if k != "use_cache"
    }


def test_the_key_is_the_bytes_and_the_transformers_version(cache, monkeypatch):
    text = (tiny_checkpoint("llama") / "config.json").read_bytes()
    first = config_cache.entry_path(text)
    assert config_cache.entry_path(text) == first
    assert config_cache.entry_path(text + b" ") != first
    assert config_cache.transformers_version() == importlib.metadata.version("transformers")
    monkeypatch.setattr(config_cache, "transformers_version", lambda: "0.0.0")
    assert config_cache.entry_path(text) != first


def test_a_damaged_entry_is_read_afresh_and_replaced(cache):
    model = tiny_checkpoint("qwen3_moe")
    fresh = load_spec(model)
    entry = config_cache.entry_path((model / "config.json").read_bytes())
    entry.write_text('{"class": "Qwen3MoeConfig"')
    assert load_spec(model) == fresh
    assert json.loads(entry.read_text())["class"] == "Qwen3MoeConfig"


def test_a_warm_read_does_not_import_the_family_config_class(cache):
    """What makes a later start faster: the family's config module (and torch._dynamo,
    which transformers pulls with it) stays unimported."""
    model = tiny_checkpoint("llama")
    load_spec(model)
    heavy = ("transformers.models.llama.configuration_llama", "torch._dynamo")
    probe = (
        "import sys; from worker_svc.models.spec import load_spec; "
        f"load_spec({str(model)!r}); print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    env = {"PYTHONPATH": python_path(REPO), config_cache.ENV: str(cache), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
