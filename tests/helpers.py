"""Shared test utilities: the CLI in-process and in fresh processes, a run's stage state, a
harvest's rows; and, re-exported from pdctl.testing.runs (which the benchmarks import too),
tiny run directories and the pretrain step on any hand-made mesh.

Import with `from helpers import ...` (pyproject's `pythonpath` puts `tests/` on sys.path).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from pdctl.project import Project
from pdctl.testing.runs import (  # the builders the benchmarks use too, re-exported for the tests
    TEMPLATES,
    TINY,
    Pretrain,
    edit_config,
    fresh_train_state,
    make_loop,
    make_run,
    merge,
    pretrain_on,
    run_steps,
)

__all__ = ["TEMPLATES", "TINY", "Pretrain", "edit_config", "fresh_train_state", "make_loop",
           "make_run", "merge", "pretrain_on", "run_steps"]  # fmt: skip

# ---- the CLI, in-process ---------------------------------------------------------------------


def cli(*args: str) -> Any:
    """Invoke the real Typer app in-process; the result has exit_code, stdout and stderr."""
    from pdctl.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def error_lines(result: Any) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def cli_fails(code: int, *args: Any) -> str:
    """Run the CLI: exit `code`, exactly one line on stderr (`error: ...`), no traceback; that
    line."""
    result = cli(*args)
    assert result.exit_code == code, (args, result.stdout, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    return lines[0]


def cli_ok(*args: Any) -> Any:
    result = cli(*args)
    assert result.exit_code == 0, (args, result.stdout, result.stderr, result.exception)
    return result


def state(run: Path, stage: str) -> dict[str, Any]:
    return Project.load(run / "pdctl.toml").stage(stage)


def session_compile_cache_dir(tmp_path_factory: Any) -> Path:
    """The test session's persistent compile cache (conftest points JAX at it); also usable as
    a run's `[compile] cache_dir`, so a test's child processes share it."""
    return tmp_path_factory.getbasetemp() / "jax-session-cache"


# ---- the CLI in a fresh process --------------------------------------------------------------


def pdctl_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """This environment for a child process: JAX on `devices` simulated CPU devices (the flag
    replaced, other XLA flags kept), wandb off, unbuffered output, then `extra`."""
    env = dict(os.environ)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if "xla_force_host_platform_device_count" not in f
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env.update(
        XLA_FLAGS=" ".join(flags),
        JAX_PLATFORMS="cpu",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
        # no compile cache unless the run's `[compile] cache_dir` asks for one (pdctl's
        # default puts one in the run directory; the tests' children ran without one)
        PDCTL_COMPILE_CACHE="",
    )
    env.update(extra)
    return env


def pdctl_argv(*args: Any, project: Path | None = None) -> list[str]:
    """`python -m pdctl [--project PROJECT] ARGS` for this interpreter."""
    head = ["--project", str(project)] if project is not None else []
    return [sys.executable, "-m", "pdctl", *head, *(str(a) for a in args)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pdctl_processes(
    n: int, *args: Any, project: Path, devices: int = 1, timeout: float = 600
) -> list[tuple[int, str]]:
    """`pdctl ARGS` as `n` processes of one jax.distributed job on localhost (each on `devices`
    CPU devices), run to completion: [(returncode, stdout + stderr)] by process id."""
    port = free_port()
    head = ("--coordinator", f"127.0.0.1:{port}", "--num-processes", n)
    procs = [
        subprocess.Popen(
            pdctl_argv(*head, "--process-id", pid, *args, project=project),
            env=pdctl_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(n)
    ]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


def pdctl_process(
    *args: Any,
    project: Path | None = None,
    cwd: Path | None = None,
    devices: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """`python -m pdctl [--project PROJECT] ARGS` run to completion in a fresh process on
    `devices` CPU devices (`env` added to `pdctl_env`), with stdout/stderr captured as text.
    For a process to signal or kill, `subprocess.Popen(pdctl_argv(...), env=pdctl_env(n))`."""
    return subprocess.run(
        pdctl_argv(*args, project=project),
        cwd=cwd,
        env=pdctl_env(devices, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def harvest_rows(path: Path) -> list[str]:
    """Every row of a harvest.db as SQL, but the time it was written: two harvests that did
    the same work compare equal."""
    from pdctl.harvest import db

    con = db.open_readonly(path)
    try:
        return [r for r in con.iterdump() if "INSERT" in r and "'created'" not in r]
    finally:
        con.close()


def harvest_labels(run: Path) -> dict:
    """The labels in the run's harvest.db (`db.read_labels`' form)."""
    from pdctl.harvest import db

    con = db.open_readonly(run / "harvest" / "harvest.db")
    try:
        return db.read_labels(con)
    finally:
        con.close()
