"""What the benchmarks share: the line that says where a measurement was taken, a measurement
run in a fresh child process on this checkout's code, and the tiny imported Llama.

A benchmark runs as `python benchmarks/NAME.py`, so this directory is on its path:
`from _harness import machine_line, run_child`. Importing this module imports nothing heavy
(no JAX, no torch): the parent of a child run must not start a device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def git_commit(repo: Path = ROOT, short: bool = True) -> str:
    """The commit checked out in `repo` ("" when it is not a git checkout)."""
    cmd = ["git", "-C", str(repo), "rev-parse", *(["--short"] if short else []), "HEAD"]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()


def machine_line() -> str:
    """pdctl's commit, the host's CPUs and load average, and the time (UTC): the first line a
    benchmark prints, so a figure can be traced to the code and the machine that gave it."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (
        f"pdctl {git_commit() or '?'}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}, {when}"
    )


def child_env(root: Path = ROOT, **extra: str) -> dict[str, str]:
    """This environment for a child process that imports pdctl from `root` (this checkout,
    or another revision's worktree): `root` first on PYTHONPATH, then the parent's path (a
    machine image's JAX may come through it); then `extra`."""
    path = [str(root), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        **extra,
    }


def run_child(
    argv: list[str],
    *,
    what: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Run `python argv...` (in child_env() unless `env` is given) and return the JSON object
    on the last line of its stdout; when it fails, exit naming `what` with the end of its
    output."""
    r = subprocess.run(
        [python, *argv],
        env=child_env() if env is None else env,
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        sys.exit(f"{what} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def tiny_llama(root: Path, **kw: Any) -> dict[str, Path]:
    """tests/fixtures.py's tiny random Llama (tokenizer and corpus with it), built in `root`;
    see there for the keywords. Needs transformers, torch and tokenizers."""
    return _fixtures().tiny_llama(root, **kw)


def rendezvous_llama(root: Path) -> dict[str, Path]:
    """tests/fixtures.py's d-64 Llama that tests/engine/test_rendezvous.py runs, built in `root`."""
    return _fixtures().rendezvous_llama(root)


def _fixtures():
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import fixtures

    return fixtures
