"""The floors of pdctl/ hold: imports point downward and nothing imports in a circle.

Read from the source (AST), so an import inside a function counts as much as one at the top of a
module; only imports under `if TYPE_CHECKING:` (annotations, never run) are left out. The floors,
lowest first: `science` and `engine` (side by side: neither imports the other), then `stages`,
then `report`, `harvest`, `inspect`, `sweep` and `cli`. `config`, `project`, `errors` and the
other top-level modules sit beside them. Known exceptions, each with its reason, are listed in
`KNOWN`: the rules skip them, and an xfail test per exception says when one is gone (then delete
its entry).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "pdctl"

# (importer's area, imported area) pairs that must not occur. An area is the package right
# under pdctl/ (`pdctl.stages.train` is in "stages"), or the top-level module's name.
UPPER = ("stages", "cli", "report", "harvest", "inspect", "sweep", "api")
RULES = {
    "science does not import engine": [("science", "engine")],
    "engine does not import science": [("engine", "science")],
    "science and engine import nothing above them": [
        (low, up) for low in ("science", "engine") for up in UPPER
    ],
    "stages do not import cli, report, harvest or inspect": [
        ("stages", up) for up in ("cli", "report", "harvest", "inspect")
    ],
    # the report shows what a harvest found (its line, its clusters); the harvest reads the
    # decomposition through stages.decomposition, never through the report
    "harvest does not import report": [("harvest", "report")],
    # the Python API (`pdctl.open`) is the top floor beside cli: only `import pdctl` reaches it
    "nothing imports the api": [
        (low, "api") for low in ("stages", "cli", "report", "harvest", "inspect", "sweep", "interp")
    ],
}

# Edges (importer module, imported module) that break a rule today, owned by other work.
KNOWN = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str) -> set[str]:
    """Every pdctl module that `module` imports, anywhere in it (resolved to the module that
    holds the name: `from pdctl.stages import train` imports pdctl.stages.train)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package
                pkg = module if module in PACKAGES else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m == "pdctl" or m.startswith("pdctl.")}


def import_graph(modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    """{module: the pdctl modules it imports}, from the source files."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = {m for m in _imports(tree, name) if m != name}
    return graph


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(graph: dict[str, set[str]], pairs: list[tuple[str, str]]) -> list[str]:
    bad = set(pairs)
    return sorted(
        f"{a} imports {b}"
        for a, targets in graph.items()
        for b in targets
        if (area(a), area(b)) in bad and (a, b) not in KNOWN
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles between modules (strongly connected components of more than one
    module), leaving out package __init__ modules and the KNOWN edges."""
    edges = {
        a: sorted(b for b in bs if b in graph and b not in PACKAGES and (a, b) not in KNOWN)
        for a, bs in graph.items()
        if a not in PACKAGES
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return sorted(out)


GRAPH = import_graph()


@pytest.mark.parametrize("rule", list(RULES))
def test_imports_point_downward(rule: str) -> None:
    assert violations(GRAPH, RULES[rule]) == [], rule


def test_no_import_circle() -> None:
    assert cycles(GRAPH) == []


@pytest.mark.parametrize(
    "edge",
    [pytest.param(e, marks=pytest.mark.xfail(strict=True, reason=why)) for e, why in KNOWN.items()],
    ids=lambda e: f"{e[0]}->{e[1]}",
)
def test_known_exception_is_gone(edge: tuple[str, str]) -> None:
    a, b = edge
    assert b not in GRAPH[a]


def test_the_checks_see_a_bad_import(tmp_path: Path) -> None:
    """A lazy upward import inside a function, and a circle made of two lazy imports, are found;
    an import for annotations only is not."""
    files = {
        "pdctl/engine/bad.py": "def f():\n    from pdctl.stages import runner\n",
        "pdctl/stages/a.py": "def f():\n    import pdctl.stages.b\n",
        "pdctl/stages/b.py": "from pdctl.stages.a import f\n",
        "pdctl/stages/c.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pdctl.cli import app\n"
        ),
        "pdctl/stages/runner.py": "",
        "pdctl/cli.py": "",
    }
    mods = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        mods[".".join(Path(rel).with_suffix("").parts)] = path
    graph = import_graph(mods)
    up = RULES["science and engine import nothing above them"]
    assert violations(graph, up) == ["pdctl.engine.bad imports pdctl.stages.runner"]
    assert cycles(graph) == [["pdctl.stages.a", "pdctl.stages.b"]]
    assert violations(graph, RULES["stages do not import cli, report, harvest or inspect"]) == []
