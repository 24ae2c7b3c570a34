"""What every command module shares: the consoles, the global options, the run directory, and
`guard`, which turns a user mistake (`PdctlError`) into one line on stderr and its exit code."""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from pdctl.cli.process import STOPS_CLEANLY
from pdctl.errors import PdctlError

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


class Globals:
    project: Path | None = None
    dist = None


def guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a PdctlError into one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if fn.__name__ not in STOPS_CLEANLY:
            from pdctl import supervisor

            supervisor.release_signals()
        try:
            return fn(*args, **kwargs)
        except PdctlError as e:
            if e.__cause__ is not None and os.environ.get("PDCTL_TRACEBACK"):
                traceback.print_exception(e.__cause__)
            err_console.print(f"error: {e}", markup=False)
            from pdctl import supervisor

            supervisor.tell_said(e.exit_code)
            raise typer.Exit(e.exit_code) from None

    return wrapper


def project(ctx: typer.Context):
    """The run directory: `--project`, or the current directory or a parent."""
    from pdctl.project import Project

    return Project.find(explicit=ctx.obj.project if ctx.obj else None)
