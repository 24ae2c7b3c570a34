"""`inspect-sharding --devices N`: the same inspection in a child process that JAX starts with N
simulated CPU devices (this process's JAX already has its device count)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax

from pdctl.config import Config
from pdctl.errors import PdctlError
from pdctl.inspect.layout import check_mesh_fits, mesh_config

CHILD_ENV = "PDCTL_INSPECT_CHILD"
# The most simulated CPU devices a preview starts (a v4 pod's chips): XLA:CPU creates each one
# in the child process, and 100,000 of them gave no answer in 120 s; a larger TPU slice is
# previewed by --topology, on compile-only TPU devices
MAX_SIMULATED = 4096


def needs_child(n: int, cfg: Config, override: dict[str, int] | None) -> bool:
    """Whether `--devices N` needs a child process (JAX here sees another device count); checks
    N and an explicit --mesh against N first, so a bad preview fails without starting one."""
    if n < 1:
        raise PdctlError(f"--devices: must be >= 1, got {n}")
    if n > MAX_SIMULATED:
        raise PdctlError(
            f"--devices: at most {MAX_SIMULATED} simulated CPU devices, got {n} (for a larger "
            "TPU slice: --topology)"
        )
    if override:
        check_mesh_fits(mesh_config(cfg, override), n, from_flag=True)
    have = jax.device_count()
    if have == n:
        return False
    if os.environ.get(CHILD_ENV):
        raise PdctlError(f"--devices: asked for {n} simulated devices but JAX sees {have}")
    return True


def child_env(n: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={n}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env[CHILD_ENV] = "1"
    # The child imports the pdctl this process runs, also when that one is importable only
    # from the directory this process was started in (a source checkout).
    root = str(Path(__file__).resolve().parents[2])
    if root not in _import_path():
        env["PYTHONPATH"] = os.pathsep.join(
            [root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
        )
    return env


def _import_path() -> set[str]:
    """The directories on this interpreter's import path that a child started with `-P` has
    too: all but the current or script directory Python put first."""
    entries = sys.path if sys.flags.safe_path else sys.path[1:]
    return {os.path.realpath(p) for p in entries if p}


CHILD_CWD = "/"  # not the run directory: nothing there is imported, even via PYTHONPATH=":..."


def child_argv(project: Path | None) -> list[str]:
    """`python -P -m pdctl --project RUN`: `-P` keeps the current directory off the child's
    import path (a `typer.py` or `jax.py` next to someone else's pdctl.toml would otherwise
    run), and the run directory is named explicitly since the child does not start in it.
    Not `-I`: that would also drop PYTHONPATH and the user site, where pdctl may live."""
    from pdctl.project import find_project_file

    path = find_project_file(explicit=Path(project)) if project is not None else find_project_file()
    return [sys.executable, "-P", "-m", "pdctl", "--project", str(path)]


def child_death(n: int, returncode: int, stderr: str) -> str | None:
    """The one line to end with when the child died instead of exiting (0 done, 1 pdctl's own
    error line already printed, 2 a user mistake): a signal or a C++ abort gives no error
    line of pdctl's. Seen: 64 simulated devices of an 8B model, where XLA:CPU's LLVM ran out
    of section memory after 7.5 min ("LLVM ERROR: Unable to allocate section memory!", exit
    250) with 22 GiB free: the process's memory-map count is bounded by vm.max_map_count
    (65,530 by default); with 262,144 the same compile finished in 12.5 min."""
    if returncode in (0, 1, 2, 3):
        return None
    how = f"signal {-returncode}" if returncode < 0 else f"exit {returncode}"
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    said = f" (its last line: {last[:200]!r})" if last else ""
    if "section memory" in stderr:  # LLVM's JIT out of memory maps, not of RAM
        fix = (
            "raise the memory-map limit (sysctl -w vm.max_map_count=262144) or use fewer --devices"
        )
    else:
        fix = "try fewer --devices on this machine, or more memory"
    return (
        f"inspect-sharding: the process compiling for {n} simulated devices died ({how}){said}; "
        + fix
    )


def run_child(
    n: int,
    project: Path | None,
    stage: str,
    mesh: str | None,
    compile: bool,
    as_json: bool,
    expand: bool,
    columns: int | None = None,
    device_memory: str | None = None,
    device_kind: str | None = None,
) -> subprocess.CompletedProcess:
    """Rerun this inspection in `sys.executable -P -m pdctl` with N simulated CPU devices,
    started outside the run directory with the current directory off its import path."""
    argv = child_argv(project)
    argv += ["inspect-sharding", "--stage", stage, "--devices", str(n)]
    if mesh is not None:
        argv += ["--mesh", mesh]
    argv += [f for f, on in (("--compile", compile), ("--json", as_json), ("--all", expand)) if on]
    for flag, value in (("--device-memory", device_memory), ("--device-kind", device_kind)):
        if value:
            argv += [flag, value]
    env = child_env(n)
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run(argv, env=env, cwd=CHILD_CWD, capture_output=True, text=True, check=False)


def relay(n: int, project: Path | None, *args: Any, **kwargs: Any) -> tuple[int, str | None]:
    """`run_child`, its output passed on as it wrote it: (the exit code to end with, and the
    error line to end with when the child died instead of exiting, `child_death`)."""
    child = run_child(n, project, *args, **kwargs)
    sys.stdout.write(child.stdout)
    sys.stderr.write(child.stderr)
    died = child_death(n, child.returncode, child.stderr)
    return (1, died) if died else (child.returncode, None)
