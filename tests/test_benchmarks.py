"""The benchmarks stay runnable as the code moves: each is a module of `benchmarks/<question>/`
that goes through `benchmarks._harness` (the machine line, the child runs), sets no import path
by hand, reaches into no test module, and imports only modules that exist (anywhere in the file,
a lazy import in a function too; the torch reference's own modules and pdctl's optional extras
aside: the README's test command installs `.[dev]` only). The fast check reads
the source (AST); the slow one runs every benchmark's `--help` in a fresh process."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# what tests/ holds that a benchmark could be tempted to import (pdctl.testing has the shared parts)
TEST_MODULES = {"helpers", "fixtures", "real_model", "conftest"}
# what only the torch reference's own environment has (benchmarks/*/torch_step.py run there)
REFERENCE_ONLY = {"spd", "datasets"}
# what only an optional extra installs (parity: torch, transformers, accelerate; tpu-aot: libtpu)
_EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
OPTIONAL = {re.split(r"[^A-Za-z0-9_-]", spec, maxsplit=1)[0].replace("-", "_")
            for name, specs in _EXTRAS.items() if name != "dev" for spec in specs}  # fmt: skip


def _scripts() -> list[Path]:
    return sorted(p for p in BENCH.glob("*/*.py") if p.name != "__init__.py")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if (
            isinstance(f, ast.Attribute)
            and f.attr in ("insert", "append", "extend")
            and isinstance(f.value, ast.Attribute)
            and f.value.attr == "path"
            and isinstance(f.value.value, ast.Name)
            and f.value.value.id == "sys"
        ):
            out.append(f"sets sys.path (line {node.lineno})")
    mods = _imports(tree)
    if not any(m == "benchmarks._harness" or m == "benchmarks" for m in mods):
        out.append("does not go through benchmarks._harness")
    for m in sorted(mods):
        top = m.split(".")[0]
        if top in TEST_MODULES or top.startswith("test_") or top == "tests":
            out.append(f"imports the test module {m}")
        elif top not in REFERENCE_ONLY | OPTIONAL and not _exists(m):
            out.append(f"imports {m}, which does not exist")
    return out


def test_every_script_is_in_a_question_folder() -> None:
    loose = sorted(
        p.name for p in BENCH.glob("*.py") if p.name not in ("__init__.py", "_harness.py")
    )
    assert loose == [], f"benchmarks/ holds scripts outside a question folder: {loose}"
    for folder in (p for p in BENCH.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert (folder / "__init__.py").is_file(), f"{folder.name}/ has no __init__.py"
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8")))
        assert doc, f"benchmarks/{folder.name}/__init__.py should say which question it answers"


def test_every_script_goes_through_the_harness_and_sets_no_path() -> None:
    found = {_module(p): _problems(p) for p in _scripts()}
    assert len(found) >= 30
    assert {m: v for m, v in found.items() if v} == {}


def test_the_harness_reaches_into_no_test(tmp_path: Path) -> None:
    mods = _imports(ast.parse((BENCH / "_harness.py").read_text(encoding="utf-8")))
    assert not {m for m in mods if m.split(".")[0] in TEST_MODULES | {"tests"}}
    # and the check above sees a bad script
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.path.insert(0, 'tests')\nfrom helpers import make_run\n"
                   "def f():\n    import tpu_fit\n")  # fmt: skip
    assert _problems(bad) == [
        "sets sys.path (line 2)",
        "does not go through benchmarks._harness",
        "imports the test module helpers",
        "imports tpu_fit, which does not exist",  # a sibling by its old flat name
    ]


@pytest.mark.slow  # ~2 s a script: 33 fresh interpreters, most importing JAX
def test_every_benchmark_answers_help() -> None:
    """`python -m benchmarks.Q.NAME --help` exits 0 (its imports resolve as a user runs it);
    `tpu/accel_check.py` is a tool of subcommands that accel_check.sh runs, its own test is
    tests/commands/test_accel_check.py."""
    failed = {}
    for path in _scripts():
        if path.name == "accel_check.py":
            continue
        r = subprocess.run(
            [sys.executable, "-m", _module(path), "--help"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if r.returncode or "usage" not in r.stdout:
            failed[_module(path)] = (r.stdout + r.stderr)[-400:]
    assert failed == {}
