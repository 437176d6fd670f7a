"""The scheduler's and the worker's packages form layers: imports point one way
only, and no module imports itself back through others (docs/design.md,
"Layout"). The import graph is read from the source (tests/helpers/import_graph.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.helpers.import_graph import DEFERRED, KINDS, RUNTIME, TYPE_ONLY, cycles, graph, imports, modules

# What each part of scheduler_svc may import from scheduler_svc. The request
# data class is shared by every layer; observability reads the engine and
# nothing but the composition root (__main__) imports it.
ALLOWED: dict[str, set[str]] = {
    "request": {"structured"},  # the type of Request.grammar, imported for type checking only
    "text": set(),
    "speculative": set(),
    "structured": {"text"},
    "access": set(),  # the TLS, key and admin-exposure flags and their checks
    "kv": {"request"},
    "lora": {"request"},  # the adapter registry and each worker's slots: pure bookkeeping, no torch
    "planning": {"request", "kv", "structured", "speculative", "lora"},
    # config: the flag groups it inherits (access, lora, speculative, structured), the planner's options
    "config": {"request", "kv", "planning", "speculative", "structured", "lora", "access"},
    "engine": {"request", "kv", "planning", "text", "structured", "config", "lora"},
    "api": {"request", "kv", "planning", "text", "structured", "config", "engine", "lora"},
    "observability": {"request", "kv", "planning", "engine", "lora"},
    "client": set(),
    "__main__": {"request", "kv", "planning", "text", "structured", "config", "engine", "api", "observability", "lora"},
}

# What each part of worker_svc may import from worker_svc. `step` (the step's
# columns, its validation, its result, its errors) is the bottom every room
# shares; `attention` and `models` need nothing of the worker; `runner` drives
# them and `sampling`; `parallel` wraps models and the sampler and gets the
# worker only through the factory `worker` hands it; `server` (with `step_proto`, the
# Step messages' conversions, and `step_rpc`, the Step calls) is the only worker.v1
# conversion; `__main__` composes.
WORKER_ALLOWED: dict[str, set[str]] = {
    "step": set(),
    "models": set(),
    "attention": set(),
    "allocator": set(),
    "affinity": set(),  # --cpu-cores: the process's cores, before torch starts threads
    "kv_offload": {"step"},  # the second KV tier: copies the step names, between the cache's tensors and its own
    "sampling": {"step"},
    "lora": {"step", "models"},
    "runner": {"step", "attention", "sampling", "models", "lora"},
    "parallel": {"step", "sampling", "models"},
    "config": {"parallel", "affinity"},  # parallel/layout.py: does the model split over the ranks
    "worker": {"step", "attention", "sampling", "runner", "models", "parallel", "config", "kv_offload", "lora"},
    "kv_transfer": {"step"},  # block bytes and their transport (disaggregation)
    "step_proto": {"step"},
    "step_rpc": {"step", "worker", "step_proto"},
    "server": {"step", "config", "worker", "lora", "kv_transfer", "step_proto", "step_rpc"},  # lora: AdapterRefused
    "__main__": {"step", "config", "allocator", "affinity", "worker", "server"},
}

# package -> (its table, the import kinds that count for cycles): every kind, imports
# under TYPE_CHECKING included (a type two rooms need lives below both).
PACKAGES = {"scheduler_svc": (ALLOWED, KINDS), "worker_svc": (WORKER_ALLOWED, KINDS)}

# The other service packages have no table of parts, but no cycle either.
ACYCLIC = ("gateway_svc", "kernels", "svc_common")


_graph = functools.cache(graph)  # package -> its graph, read once per run


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_part_is_known(package: str):
    parts = {_part(m) for m in modules(package)} - {"__init__"}
    assert parts == set(PACKAGES[package][0]), f"a new part of {package} needs its place in its table"


@pytest.mark.parametrize("package,module", [(p, m) for p in sorted(PACKAGES) for m in sorted(modules(p))])
def test_imports_point_down_the_layers(package: str, module: str):
    allowed = PACKAGES[package][0]
    own = _part(module)
    if own == "__init__":
        return
    for target in _graph(package)[module]:
        other = _part(target)
        assert other == own or other in allowed[own], f"{module} imports {target}: {own} may not import {other}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycles(package: str):
    g = graph(package, kinds=PACKAGES[package][1])
    assert len(g) > 30  # the walk saw the whole package
    assert not cycles(g), "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles(g))


@pytest.mark.parametrize("package", ACYCLIC)
def test_no_import_cycles_in_the_other_services(package: str):
    g = graph(package, kinds=KINDS)
    assert len(g) > 3  # the walk saw the package
    assert not cycles(g), "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles(g))


def test_the_import_walk_tells_the_kinds_of_import_apart(tmp_path: Path):
    """The walk the checks rely on: module-level, type-only and function-level
    imports are told apart, `from pkg import mod` names the module, relative
    imports resolve, and names that are no module of the package are left out."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import x\nfrom pkg import c\nimport os\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nimport pkg.a\nif TYPE_CHECKING:\n    from . import c\n"
        "def f():\n    from .d import y\n"
    )
    (package / "c.py").write_text("")
    (package / "d.py").write_text("from pkg.b import f\n\ndef g():\n    import pkg.b\n")
    known = modules("pkg", tmp_path)
    assert set(known) == {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"}
    assert imports(known["pkg.a"], "pkg.a", known) == {"pkg.b": RUNTIME, "pkg.c": RUNTIME}
    assert imports(known["pkg.b"], "pkg.b", known) == {"pkg.a": RUNTIME, "pkg.c": TYPE_ONLY, "pkg.d": DEFERRED}
    assert imports(known["pkg.d"], "pkg.d", known) == {"pkg.b": RUNTIME}  # the strongest kind counts
    g = graph("pkg", tmp_path)
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.d"]]
    assert cycles(graph("pkg", tmp_path, kinds=(RUNTIME,))) == [["pkg.a", "pkg.b"]]
