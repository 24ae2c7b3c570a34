"""What the benchmarks share: the line that says where a measurement was taken, and a
measurement run in a fresh child process on this checkout's code.

A benchmark runs as a module from the checkout's root, `python -m benchmarks.QUESTION.NAME`, so
`benchmarks` and `pdctl` import from there with no path set by hand: `from benchmarks._harness
import machine_line, run_child`. What the tests build on too (tiny runs, tiny Hugging Face
models, a synthetic harvest, a headless browser) is in `pdctl.testing`. Importing this module
imports nothing heavy (no JAX, no torch): the parent of a child run must not start a device.
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


def child_env(root: Path = ROOT, *, path: tuple[Path, ...] = (), **extra: str) -> dict[str, str]:
    """This environment for a child process that imports pdctl (and the benchmarks) from `root`
    (this checkout, or another revision's worktree): `path` (another code base the child
    imports, such as the torch reference's checkout) and `root` first on PYTHONPATH, then this
    checkout (the benchmarks, where `root` has none of its own), then the parent's path (a
    machine image's JAX may come through it); then `extra`."""
    here = [str(ROOT)] if root != ROOT else []
    path_ = [*(str(p) for p in path), str(root), *here, os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in path_ if p),
        **extra,
    }


def module_argv(module: str, *args: object) -> list[str]:
    """`-m MODULE ARGS` (str each): a benchmark's child, itself (`__spec__.name`) or another, for
    `run_child` or `[sys.executable, *module_argv(...)]` with `child_env()` (this checkout on
    PYTHONPATH). A child that measures another revision's pdctl runs this file by its path
    instead, with `child_env(that_root)`: `-m` would put the working directory first."""
    return ["-m", module, *(str(a) for a in args)]


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
