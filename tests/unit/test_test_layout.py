"""Test modules do not import each other: what several test files share lives in
tests/helpers/, and conftest.py holds only pytest fixtures and hooks."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def dotted(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def forbidden_modules() -> set[str]:
    """Every test module and conftest under tests/, by dotted name and by bare name."""
    names = set()
    for path in TESTS.rglob("*.py"):
        if path.name.startswith("test_") or path.name == "conftest.py":
            names.add(dotted(path))
            names.add(path.stem)
    return names


def imported_modules(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, module) for every import anywhere in the tree; for `from X import y`
    both X and X.y (y may be a submodule); relative imports resolved against `module`."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])
                base = ".".join(base_parts)
            else:
                base = node.module or ""
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def offenders(source: str, module: str, forbidden: set[str]) -> list[str]:
    tree = ast.parse(source)
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(tree, module) if name in forbidden]


def test_no_module_under_tests_imports_a_test_module_or_conftest():
    forbidden = forbidden_modules()
    sources = sorted(TESTS.rglob("*.py"))
    assert len([p for p in sources if p.name.startswith("test_")]) > 20, "the walk found too few test modules"
    bad = [o for path in sources for o in offenders(path.read_text(), dotted(path), forbidden)]
    assert not bad, "move what is shared into tests/helpers/:\n" + "\n".join(bad)


def test_the_check_catches_each_form_of_import():
    forbidden = {"tests.conftest", "tests.unit.test_planner", "test_planner"}
    module = "tests.unit.test_chunking"
    for source in (
        "from tests.conftest import tiny_checkpoint",
        "from tests.unit.test_planner import BS",
        "import tests.unit.test_planner",
        "from tests.unit import test_planner",
        "from .test_planner import BS",
        "from . import test_planner",
        "from ..unit.test_planner import BS",
        "from test_planner import BS",
        "def f():\n    from tests.conftest import tiny_checkpoint",
    ):
        assert offenders(source, module, forbidden), source
    for source in (
        "from tests.helpers.planner_sim import BS, step",
        "from tests.helpers.checkpoints import tiny_checkpoint",
        "import pytest",
    ):
        assert not offenders(source, module, forbidden), source
