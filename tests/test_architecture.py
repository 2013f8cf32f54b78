"""The floors of docs/ARCHITECTURE.md, checked on the source: kvarn's import graph, drawn with `ast` from every file
(imports inside functions and under TYPE_CHECKING included, as import-linter's `.importlinter` contracts draw it),
has no import cycle and no import from a floor up to a higher one.

    lab > engines > kernels > attention > cache > presets > quant > ops > base

Each floor may import the floors below it and its own; the lab may import anything; the root `kvarn` (the public
names) may import the core but not the lab. Every module of the package must be on a floor (FLOORS below): a new
top-level module or package is placed there first.

KNOWN_CYCLES and KNOWN_UPWARD list tolerated violations (a ratchet: a new violation fails, and so does a listed one
that no longer occurs). Both are empty: main at b4326b0 had 2 cycles and 11 upward imports, which issue 17 removed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvarn

PACKAGE = Path(kvarn.__file__).parent

# module-name prefix -> floor (the longest prefix wins); higher floors come first
FLOORS: dict[str, str] = {
    **dict.fromkeys(["kvarn.eval", "kvarn.bench", "kvarn.commands", "kvarn.cli", "kvarn.demo", "kvarn.models",
                     "kvarn.model_fetch", "kvarn.console", "kvarn.synthetic", "kvarn.decoding", "kvarn.generation"],
                    "lab"),
    "kvarn.integrations": "engines",
    "kvarn.kernels": "kernels",
    "kvarn.attention": "attention",
    "kvarn.cache": "cache",
    "kvarn.presets": "presets",
    "kvarn.quant": "quant",
    "kvarn.ops": "ops",
    "kvarn.paths": "base",  # where the cache folder is (the kernel build must not import kvarn.models for it)
}
RANK = {name: i for i, name in enumerate(["base", "ops", "quant", "presets", "cache", "attention", "kernels",
                                          "engines", "lab"])}

# The violations found at b4326b0 (issue 17) are gone; a new one fails, and so would one listed here that has gone.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()


def module_names() -> dict[str, Path]:
    """kvarn's modules (a package is its __init__), by dotted name."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("kvarn", *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The kvarn modules one import statement names (`from a import b` names a.b where that is a module, else a)."""
    def deepest(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        found = {deepest(a.name) for a in node.names}
    else:
        base = node.module or ""
        if node.level:  # relative: resolved against the importing module's package
            package = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        found = {deepest(f"{base}.{a.name}") if f"{base}.{a.name}" in known else deepest(base) for a in node.names}
    return {m for m in found if m is not None and m.split(".")[0] == "kvarn"}


def import_graph() -> dict[str, set[str]]:
    """module -> the kvarn modules it imports anywhere in its file (functions, TYPE_CHECKING blocks included)."""
    mods = module_names()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= imported(node, name, path.name == "__init__.py", known)
        graph[name] = edges - {name}
    return graph


def floor(module: str) -> str | None:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in FLOORS:
            return FLOORS[".".join(parts[:i])]
    return None


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs that go from a floor up to a higher one (or from the root `kvarn` to the lab)."""
    out = set()
    for src, targets in graph.items():
        for dst in targets:
            fs, fd = floor(src), floor(dst)
            if src == "kvarn":
                if fd == "lab":
                    out.add((src, dst))
            elif fs is not None and fd is not None and RANK[fd] > RANK[fs]:
                out.add((src, dst))
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_imports_inside_functions(graph):
    # kvarn.cli discovers its commands at run time; kvarn/commands/*.py import their work inside `run`
    assert any(dst.startswith("kvarn.eval") for dst in graph["kvarn.commands.eval"])
    assert len(graph) > 50 and sum(map(len, graph.values())) > 200


def test_every_module_is_on_a_floor(graph):
    unplaced = sorted(m for m in graph if m != "kvarn" and floor(m) is None)
    assert not unplaced, f"place these modules on a floor (FLOORS in {__file__}): {unplaced}"


def test_no_import_cycle(graph):
    found = cycles(graph)
    new = sorted(sorted(c) for c in found - KNOWN_CYCLES)
    gone = sorted(sorted(c) for c in KNOWN_CYCLES - found)
    assert not new, f"import cycles: {new}"
    assert not gone, f"these cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_no_upward_import(graph):
    found = upward(graph)
    new = sorted((s, d, f"{floor(s)} -> {floor(d)}") for s, d in found - KNOWN_UPWARD)
    gone = sorted(KNOWN_UPWARD - found)
    assert not new, f"imports from a floor up to a higher one: {new}"
    assert not gone, f"these upward imports are gone: remove them from KNOWN_UPWARD: {gone}"
