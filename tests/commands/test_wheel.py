"""The built wheel works on its own: templates inside it, `pdctl new` / `templates` without JAX.

The fresh environment gets only what those commands import (typer, rich, pydantic, tomli-w), not
pdctl's full dependency list: installing JAX again would cost minutes, and its absence proves the
scaffolding commands never import it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Every template in the repository, so a new one is checked without editing this file.
TEMPLATES = tuple(sorted(p.parent.name for p in (ROOT / "templates").glob("*/pdctl.toml")))
LIGHT_DEPS = ["typer", "rich", "pydantic", "tomli-w"]

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
        cwd=out,
        env=os.environ.copy(),
    )
    [whl] = out.glob("pdctl-*.whl")
    return whl


def test_wheel_contains_the_templates(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for t in TEMPLATES:
        for f in ("pdctl.toml", "README.md"):
            member = f"pdctl/templates/{t}/{f}"
            assert member in names
            assert zipfile.ZipFile(wheel).read(member) == (ROOT / "templates" / t / f).read_bytes()
    assert "pdctl/cli/app.py" in names and "pdctl/config/schema.py" in names
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "pdctl = pdctl.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert not [n for n in names if n.startswith("tests/") or "__pycache__" in n]


def test_installed_wheel_scaffolds_a_run_without_jax(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=env)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q"]
    _run([*pip, "--no-deps", str(wheel)], cwd=tmp_path, env=env)
    _run([*pip, *LIGHT_DEPS], cwd=tmp_path, env=env)

    work = tmp_path / "work"  # outside the repository
    work.mkdir()
    probe = "import importlib.util as u, pdctl; print(pdctl.__file__, u.find_spec('jax'))"
    where, jax_spec = _run([str(py), "-c", probe], cwd=work, env=env).stdout.split()
    assert Path(where).resolve().is_relative_to(venv.resolve()), where
    assert jax_spec == "None", "the fresh environment must not have JAX"

    pdctl = str(venv / "bin" / "pdctl")
    listed = _run([pdctl, "templates"], cwd=work, env=env).stdout
    assert [line.split()[0] for line in listed.splitlines()] == list(TEMPLATES)

    _run([pdctl, "new", "demo", "-t", "llama-mlp"], cwd=work, env=env)
    run = work / "demo"
    assert sorted(p.name for p in run.iterdir()) == ["README.md", "pdctl.toml"]
    src = ROOT / "templates" / "llama-mlp"
    assert (run / "pdctl.toml").read_bytes() == (src / "pdctl.toml").read_bytes()
    assert (run / "README.md").read_text(encoding="utf-8").startswith("# demo\n")

    report = json.loads(_run([pdctl, "status", "--json"], cwd=run, env=env).stdout)
    assert report == {
        s: {"status": "pending", "stale": False}
        for s in ("init_weights", "pretrain", "warmup", "train")
    }
