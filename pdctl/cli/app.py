"""The pdctl command line: parse, call one engine function, print, map errors to exit codes.

Every command is thin. User mistakes raise `PdctlError` anywhere below; `base.guard` prints them
as one line on stderr and exits 2 (no traceback). This module is the wiring: the global options,
the small commands about the run directory, and below, in the order `pdctl --help` lists them,
every command with the module that holds it:

    stages    init-weights, pretrain, warmup, train (one body: `stages.run_stage`), run, resume
    post      report, harvest, browse, export
    analysis  cluster, attributions (over a finished harvest)
    sharding  inspect-sharding (over `pdctl.inspect`)
    sweep     sweep new | run | status | report
    interp    interp export | import | score (pdctl.cli.interp)
    render    what they print; process: clean stops and how the process ends
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from pdctl import __version__
from pdctl.cli import analysis, post, process, render, sharding, stages, sweep
from pdctl.cli import interp as interp_cli
from pdctl.cli.base import Globals, console, err_console, guard, project

app = typer.Typer(
    name="pdctl",
    help="Stochastic Parameter Decomposition of neural networks with JAX, driven by pdctl.toml.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        console.print(f"pdctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
    project: Annotated[
        Path | None,
        typer.Option(
            "--project",
            "-p",
            help="Run directory (or its pdctl.toml). Default: the current directory or a parent.",
        ),
    ] = None,
    coordinator: Annotated[
        str | None,
        typer.Option("--coordinator", help="HOST:PORT of process 0 for a multi-process run."),
    ] = None,
    num_processes: Annotated[
        int | None, typer.Option("--num-processes", help="Processes in a multi-process run.")
    ] = None,
    process_id: Annotated[
        int | None, typer.Option("--process-id", help="This process's index (0-based).")
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
    log_format: Annotated[
        str | None,
        typer.Option(
            "--log-format",
            help="How a stage logs: auto (a progress bar on a terminal, else text) | text (a "
            "line when a program compiles, each logging step and evaluation) | json (the same "
            "records as JSON lines).",
        ),
    ] = None,
) -> None:
    """pdctl: decompose a network's parameters with SPD. Start with `pdctl new NAME`."""
    from pdctl.engine.runtime import LOG_FORMAT_ENV, LOG_FORMATS, DistributedFlags

    if log_format is not None:
        if log_format not in LOG_FORMATS:
            err_console.print(
                f"error: --log-format: must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}",
                markup=False,
            )
            raise typer.Exit(2)
        os.environ[LOG_FORMAT_ENV] = log_format  # read by the stage's process too

    ctx.obj = Globals()
    ctx.obj.project = project
    ctx.obj.dist = DistributedFlags(coordinator, num_processes, process_id)


def new(
    name: Annotated[str, typer.Argument(help="Directory to create (a plain name).")],
    template: Annotated[
        str, typer.Option("--template", "-t", help="Template: see `pdctl templates`.")
    ] = "tms",
) -> None:
    """Create NAME/pdctl.toml and NAME/README.md from a template."""
    from pdctl.templates import create_run

    run = create_run(name, template, Path.cwd())
    console.print(f"created {run}/pdctl.toml from template {template!r}")
    console.print(f"next: pdctl --project {name} run")


def templates() -> None:
    """List the run templates."""
    from pdctl.templates import available

    for name, line in available().items():
        typer.echo(f"{name:<10} {line}")


def status(
    ctx: typer.Context,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON object keyed by stage (init_weights, pretrain, warmup, train); each "
            "holds the stage's state fields plus `stale`.",
        ),
    ] = False,
) -> None:
    """Show every stage: status, step, last metrics, timings, checkpoint, staleness."""
    proj = project(ctx)
    report = proj.status_report()
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
    render.status(proj, report)


def _add(to: typer.Typer, commands) -> None:
    for name, fn in commands:
        to.command(name)(guard(fn))


_add(
    app,
    (
        ("new", new),
        ("templates", templates),
        ("status", status),
        ("report", post.report),
        ("harvest", post.harvest),
        ("browse", post.browse),
        ("cluster", analysis.cluster),
        ("attributions", analysis.attributions),
        ("init-weights", stages.init_weights),
        ("pretrain", stages.pretrain),
        ("warmup", stages.warmup),
        ("train", stages.train),
        ("run", stages.run_pipeline),
        ("resume", stages.resume),
        ("export", post.export),
        ("inspect-sharding", sharding.inspect_sharding),
    ),
)
sweep_app = typer.Typer(help=sweep.HELP, no_args_is_help=True)
_add(
    sweep_app,
    (
        ("new", sweep.sweep_new),
        ("run", sweep.sweep_run),
        ("status", sweep.sweep_status),
        ("report", sweep.sweep_report),
    ),
)
app.add_typer(sweep_app, name="sweep")
app.add_typer(interp_cli.app, name="interp")


def main() -> None:
    """The `pdctl` command (`process.run`: stage commands run supervised)."""
    process.run(app)
