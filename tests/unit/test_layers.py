"""The scheduler's packages form layers: imports point one way only, and no
module imports itself back through others (docs/design.md, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "scheduler_svc"

# What each part of scheduler_svc may import from scheduler_svc. The request
# data class is shared by every layer; observability reads the engine and
# nothing but the composition root (__main__) imports it.
ALLOWED: dict[str, set[str]] = {
    "request": set(),
    "text": set(),
    "structured": {"text"},
    "kv": {"request"},
    "planning": {"request", "kv", "structured"},
    "config": {"request", "kv", "planning"},
    "engine": {"request", "kv", "planning", "text", "structured", "config"},
    "api": {"request", "kv", "planning", "text", "structured", "config", "engine"},
    "observability": {"request", "kv", "planning", "engine"},
    "client": set(),
    "__main__": {"request", "kv", "planning", "text", "structured", "config", "engine", "api", "observability"},
}


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in PACKAGE.rglob("*.py")
    }


def _imports(path: Path, runtime_only: bool) -> set[str]:
    """scheduler_svc modules `path` imports (with runtime_only, not those under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for child in node.body for n in ast.walk(child))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "scheduler_svc"}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_is_known():
    parts = {_part(m) for m in _modules()} - {"__init__"}
    assert parts == set(ALLOWED), "a new part of scheduler_svc needs its place in ALLOWED"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_point_down_the_layers(module: str):
    modules = _modules()
    own = _part(module)
    if own == "__init__":
        return
    for target in _imports(modules[module], runtime_only=False):
        if target not in modules:
            continue  # `from pkg import name` also yields pkg.name
        other = _part(target)
        assert other == own or other in ALLOWED[own], f"{module} imports {target}: {own} may not import {other}"


def test_no_import_cycles():
    modules = _modules()
    graph = {m: {t for t in _imports(p, runtime_only=True) if t in modules and t != m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert len(graph) > 30  # the walk saw the whole package


def test_the_import_walk_tells_runtime_from_type_only_imports(tmp_path: Path):
    """The walk the two checks rely on: type-only imports count for layers, not for cycles."""
    (tmp_path / "a.py").write_text("from scheduler_svc.b import x\n")
    (tmp_path / "b.py").write_text("import scheduler_svc.a\nif TYPE_CHECKING:\n    import scheduler_svc.c\n")
    assert _imports(tmp_path / "a.py", True) == {"scheduler_svc.b", "scheduler_svc.b.x"}
    assert _imports(tmp_path / "b.py", True) == {"scheduler_svc.a"}
    assert _imports(tmp_path / "b.py", False) == {"scheduler_svc.a", "scheduler_svc.c"}
