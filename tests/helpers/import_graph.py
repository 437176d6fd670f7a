"""A package's import graph, read from its source (nothing is imported): which
module imports which, and how (at module level, only under `if TYPE_CHECKING:`,
or inside a function), its levels, the edges that point back up and its cycles.

tests/unit/test_layers.py checks the layers with it; as a script it prints the
figures for a package, here or in another checkout:

    python -m tests.helpers.import_graph worker_svc [--root DIR]
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUNTIME = "runtime"  # a module-level import: runs when the module is imported
TYPE_ONLY = "type-only"  # under `if TYPE_CHECKING:`
DEFERRED = "deferred"  # inside a function: runs when it is called
KINDS = (RUNTIME, TYPE_ONLY, DEFERRED)


def modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module of `package` (a package is its __init__)."""
    base = root / package
    return {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(base.rglob("*.py"))
    }


def imports(path: Path, module: str, known: Iterable[str]) -> dict[str, str]:
    """The modules of `known` that the file of `module` imports -> how (the
    strongest kind when one is imported several ways: runtime, then deferred,
    then type-only). `from pkg import name` counts as pkg.name when that is a
    module, else as pkg; relative imports are resolved against `module`."""
    known = set(known)
    tree = ast.parse(path.read_text())
    kinds: dict[int, str] = {}
    _mark(tree, RUNTIME, kinds)
    found: dict[str, str] = {}
    rank = {RUNTIME: 0, DEFERRED: 1, TYPE_ONLY: 2}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:  # `import pkg.mod.name`-style attribute paths
                target = target.rsplit(".", 1)[0]
            if target in known and target != module:
                kind = kinds[id(node)]
                if target not in found or rank[kind] < rank[found[target]]:
                    found[target] = kind
    return found


def _mark(node: ast.AST, kind: str, kinds: dict[int, str]) -> None:
    """Each node's kind: TYPE_CHECKING blocks are type-only, function bodies deferred."""
    kinds[id(node)] = kind
    for child in ast.iter_child_nodes(node):
        child_kind = kind
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and child in node.body:
            child_kind = TYPE_ONLY
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and kind == RUNTIME:
            child_kind = DEFERRED
        _mark(child, child_kind, kinds)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


Graph = dict[str, dict[str, str]]  # module -> imported module -> kind


def graph(package: str, root: Path = ROOT, kinds: Iterable[str] = KINDS) -> Graph:
    """Every module of `package` -> the modules of `package` it imports in one of `kinds`."""
    files = modules(package, root)
    wanted = set(kinds)
    return {
        module: {t: k for t, k in imports(path, module, files).items() if k in wanted} for module, path in files.items()
    }


def cycles(g: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def back_edges(g: Graph) -> list[tuple[str, str]]:
    """Edges that close a cycle in a depth-first walk in name order: the ones that
    point back up once the rest are laid out in levels (none in a layered graph)."""
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    found: list[tuple[str, str]] = []

    def visit(v: str) -> None:
        state[v] = 1
        for w in sorted(g[v]):
            if state.get(w) == 1:
                found.append((v, w))
            elif w not in state:
                visit(w)
        state[v] = 2

    for v in sorted(g):
        if v not in state:
            visit(v)
    return found


def levels(g: Graph) -> dict[str, int]:
    """Each module's level once the back edges are set aside: 0 imports nothing of
    the package, n imports something at level n - 1 and nothing higher."""
    up = set(back_edges(g))
    level: dict[str, int] = {}

    def of(v: str) -> int:
        if v not in level:
            level[v] = 1 + max((of(w) for w in g[v] if (v, w) not in up), default=-1)
        return level[v]

    for v in g:
        of(v)
    return level


@dataclass(frozen=True)
class Summary:
    files: int
    levels: int
    edges: dict[str, int]  # kind -> count
    up: list[tuple[str, str]]
    cycles: list[list[str]]


def summary(g: Graph) -> Summary:
    edges = {kind: sum(k == kind for targets in g.values() for k in targets.values()) for kind in KINDS}
    return Summary(len(g), 1 + max(levels(g).values(), default=-1), edges, back_edges(g), cycles(g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read")
    parser.add_argument("--levels", action="store_true", help="list the modules level by level")
    args = parser.parse_args()
    g = graph(args.package, args.root)
    s = summary(g)
    edges = ", ".join(f"{n} {kind}" for kind, n in s.edges.items())
    total = sum(s.edges.values())
    print(f"{args.package} at {args.root}: {s.files} files on {s.levels} levels, {total} edges ({edges})")
    print(f"edges pointing back up: {len(s.up)}")
    for a, b in s.up:
        print(f"  {a} -> {b} ({g[a][b]})")
    print(f"cycles: {len(s.cycles)}")
    for c in s.cycles:
        print("  " + ", ".join(c))
    if args.levels:
        by_level: dict[int, list[str]] = {}
        for module, n in levels(g).items():
            by_level.setdefault(n, []).append(module)
        for n in sorted(by_level):
            print(f"  {n}: {', '.join(sorted(by_level[n]))}")


if __name__ == "__main__":
    main()
