"""The floors of pdctl/ hold: every package imports only what the table below allows it, and
nothing imports in a circle.

Read from the source (AST), so an import inside a function counts as much as one at the top of a
module. `ALLOWED` names every area (a package right under pdctl/, or a top-level module) with the
areas it may import; an area missing from it fails, and so does any import the table does not
allow. Imports under `if TYPE_CHECKING:` (annotations, never run) are left out of the table's
check but not of the circle check: a circle of annotations is still a circle a reader has to
untangle. ARCHITECTURE.md's floor diagram is drawn from the table (`floors`), and a test keeps
the two equal. Known exceptions, each with its reason, are listed in `KNOWN`: the check skips
them, and a test fails when one is gone (then delete its entry).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "pdctl"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"

# area -> the areas it may import (besides itself). "pdctl" is the package's __init__
# (`__version__`), which any area may read; its lazy `pdctl.open` is `ENTRY`, below.
# Adding an import between areas means adding it here, where the floors can be seen.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "pdctl": set(),
    # the one table of stages: plain data the schema, `pdctl new` and every floor read
    "registry": set(),
    "files": {"errors"},
    "config": {"errors", "registry"},
    "project": {"config", "errors", "files", "registry"},
    "templates": {"errors", "project"},
    # the maths and the machinery: neither imports the other
    "science": {"config", "errors", "files"},
    "engine": {"config", "errors", "files"},
    "supervisor": {"engine", "errors", "pdctl", "project"},
    "stages": {"config", "engine", "errors", "files", "pdctl", "project", "registry", "science",
               "supervisor"},
    # what reads or drives finished / planned stages: through stages, never through cli
    "harvest": {"config", "engine", "errors", "files", "project", "science", "stages"},
    "inspect": {"config", "engine", "errors", "project", "registry", "science", "stages"},
    "sweep": {"config", "engine", "errors", "files", "project", "registry", "science", "stages",
              "templates"},
    # the report shows what a harvest found (its line, its clusters); never the other way
    "report": {"engine", "errors", "harvest", "pdctl", "project", "registry", "science", "stages"},
    "interp": {"errors", "files", "harvest"},
    # the Python API (`pdctl.open`): only `import pdctl` reaches it
    "api": {"engine", "errors", "harvest", "project", "registry", "science", "stages"},
    "cli": {"engine", "errors", "files", "harvest", "inspect", "interp", "pdctl", "project",
            "registry", "report", "stages", "supervisor", "sweep", "templates"},
    "__main__": {"cli", "supervisor"},
    # tiny runs, models, a synthetic harvest and a browser for the tests and the benchmarks:
    # pdctl itself never imports it
    "testing": {"engine", "errors", "harvest", "project", "science", "stages", "templates"},
}  # fmt: skip

# The one import that runs up by design: `pdctl.open` imports the API on first use.
ENTRY = {("pdctl", "pdctl.api")}

# Edges (importer module, imported module) the table does not allow today, owned by other work,
# each with why it is there: none left.
KNOWN: dict[tuple[str, str], str] = {}


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


def _imports(tree: ast.AST, module: str, type_only: bool = False) -> set[str]:
    """Every pdctl module that `module` imports, anywhere in it (resolved to the module that
    holds the name: `from pdctl.stages import train` imports pdctl.stages.train); those under
    `if TYPE_CHECKING:` only with `type_only`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node) and not type_only:
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


def import_graph(
    modules: dict[str, Path] = MODULES, type_only: bool = False
) -> dict[str, set[str]]:
    """{module: the pdctl modules it imports}, from the source files (with `type_only`, the
    imports for annotations too)."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = {m for m in _imports(tree, name, type_only) if m != name}
    return graph


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pdctl"


def violations(graph: dict[str, set[str]], allowed: dict[str, set[str]] = ALLOWED) -> list[str]:
    """Each import between areas that `allowed` does not list (nor `ENTRY`, nor `KNOWN`), and
    each area that `allowed` does not name."""
    out = {f"{area(a)}: not in the table" for a in graph if area(a) not in allowed}
    for a, targets in graph.items():
        for b in targets:
            pa, pb = area(a), area(b)
            if pa == pb or (a, b) in ENTRY or (a, b) in KNOWN or pa not in allowed:
                continue
            if pb not in allowed[pa]:
                out.add(f"{a} imports {b} ({pa} may not import {pb})")
    return sorted(out)


def floors(allowed: dict[str, set[str]] = ALLOWED) -> list[list[str]]:
    """The areas by floor, lowest first: an area sits one floor above the highest it may
    import. Raises on a circle in the table itself."""
    level: dict[str, int] = {}

    def of(a: str, path: tuple[str, ...] = ()) -> int:
        if a in path:
            raise ValueError(f"the table has a circle: {' -> '.join((*path, a))}")
        if a not in level:
            level[a] = 1 + max((of(b, (*path, a)) for b in allowed[a]), default=-1)
        return level[a]

    for a in allowed:
        of(a)
    out: list[list[str]] = [[] for _ in range(max(level.values()) + 1)]
    for a, n in level.items():
        out[n].append(a)
    return [sorted(f) for f in out]


def diagram(allowed: dict[str, set[str]] = ALLOWED) -> str:
    """The floors as ARCHITECTURE.md draws them, the top floor first."""
    return "\n".join("  ".join(f) for f in reversed(floors(allowed)))


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
TYPED = import_graph(type_only=True)


def test_every_import_is_in_the_table() -> None:
    assert violations(GRAPH) == []


def test_no_import_circle() -> None:
    """Between modules, annotations included; and between the table's areas."""
    assert cycles(TYPED) == []
    assert floors()  # raises on a circle in the table


def test_the_floor_diagram_is_the_table() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    m = re.search(r"<!-- floors: tests/test_layering.py -->\n```\n(.*?)\n```", text, re.S)
    assert m, "ARCHITECTURE.md: no floor diagram after '<!-- floors: tests/test_layering.py -->'"
    assert m.group(1) == diagram(), f"ARCHITECTURE.md's floors should read:\n{diagram()}"


def private_crossings(modules: dict[str, Path] = MODULES) -> list[str]:
    """Each private name (`_x`) one area takes from another: `from pdctl.a import _x`, or
    `m._x` on a pdctl module imported as `m`. A name another package uses is public."""
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        aliases: dict[str, str] = {}  # local name -> the pdctl module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pdctl"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in modules:
                        aliases[a.asname or a.name] = sub
                    elif (a.name.startswith("_") and not a.name.startswith("__")
                          and area(node.module or "") != area(name)):  # fmt: skip
                        out.append(f"{name} takes {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("pdctl.") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):  # fmt: skip
                mod = aliases[node.value.id]
                if area(mod) != area(name):
                    out.append(f"{name} takes {mod}.{node.attr}")
    return sorted(set(out))


def test_no_private_name_crosses_a_package() -> None:
    assert private_crossings() == []


def test_every_known_exception_is_still_there() -> None:
    """A `KNOWN` edge whose import is gone is deleted from `KNOWN`."""
    assert [e for e in KNOWN if e[1] not in TYPED.get(e[0], set())] == []


def test_the_checks_see_a_bad_import(tmp_path: Path) -> None:
    """A lazy upward import inside a function, an area the table does not name, circles made
    of lazy imports or of annotations, and private names taken across packages are found; an
    annotation-only upward import is not a table violation."""
    files = {
        "pdctl/engine/bad.py": "def f():\n    from pdctl.stages import runner\n",
        "pdctl/stages/a.py": "def f():\n    import pdctl.stages.b\n",
        "pdctl/stages/b.py": "from pdctl.stages.a import f\n",
        "pdctl/stages/c.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pdctl.cli import app\n"
        ),
        "pdctl/stages/d.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pdctl.stages.e\n"
        ),
        "pdctl/stages/e.py": "import pdctl.stages.d\n",
        "pdctl/stages/runner.py": "",
        "pdctl/harvest/priv.py": (
            "from pdctl.stages.a import _hidden\nfrom pdctl.stages import runner\n"
            "runner._inner()\nrunner.__name__\n"
        ),
        "pdctl/newpkg/x.py": "from pdctl import errors\n",
        "pdctl/errors.py": "",
        "pdctl/cli.py": "",
    }
    mods = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        mods[".".join(Path(rel).with_suffix("").parts)] = path
    assert violations(import_graph(mods)) == [
        "newpkg: not in the table",
        "pdctl.engine.bad imports pdctl.stages.runner (engine may not import stages)",
    ]
    assert cycles(import_graph(mods)) == [["pdctl.stages.a", "pdctl.stages.b"]]
    assert cycles(import_graph(mods, type_only=True)) == [
        ["pdctl.stages.a", "pdctl.stages.b"],
        ["pdctl.stages.d", "pdctl.stages.e"],
    ]
    with pytest.raises(ValueError, match="circle: a -> b -> a"):
        floors({"a": {"b"}, "b": {"a"}})
    assert diagram({"x": set(), "y": {"x"}, "z": {"x"}}) == "y  z\nx"
    assert private_crossings(mods) == [
        "pdctl.harvest.priv takes pdctl.stages.a._hidden",
        "pdctl.harvest.priv takes pdctl.stages.runner._inner",
    ]
