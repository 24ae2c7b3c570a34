"""`pdctl sweep new | run | status | report`: many runs of one template, trained together."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdctl.cli import render
from pdctl.cli.base import console
from pdctl.cli.process import stopping_cleanly
from pdctl.errors import PdctlError

HELP = "Many runs of one template: seeds x a grid of config values, trained together."


def load(name: str):
    from pdctl.sweep.spec import Sweep

    return Sweep.load(Path(name))


def sweep_new(
    name: Annotated[str, typer.Argument(help="Sweep directory to create (a plain name).")],
    template: Annotated[str, typer.Option("--template", "-t", help="Template of every member.")] = (
        "tms"
    ),
    seeds: Annotated[int, typer.Option("--seeds", help="Seeds per grid point.")] = 1,
    grid: Annotated[
        list[str] | None,
        typer.Option("--grid", help="KEY=V1,V2,...: a config key and its values (repeatable)."),
    ] = None,
    sets: Annotated[
        list[str] | None,
        typer.Option("--set", help="KEY=VALUE for every member (repeatable)."),
    ] = None,
) -> None:
    """Create NAME/sweep.toml and one run directory per member under NAME/runs/."""
    from pdctl.sweep.spec import create_sweep, parse_grid, parse_sets

    sweep = create_sweep(
        name, template, seeds, parse_grid(grid or []), parse_sets(sets or []), Path.cwd()
    )
    console.print(f"created {sweep.root}/sweep.toml: {len(sweep.members)} members under runs/")
    console.print(f"next: pdctl sweep run {name}")


def sweep_run(
    name: Annotated[str, typer.Argument(help="Sweep directory.")],
    strategy: Annotated[
        str | None,
        typer.Option(
            "--strategy",
            help="How a device steps its members: map (one after another; default on CPU) or "
            "vmap (batched; default on GPU/TPU).",
        ),
    ] = None,
) -> None:
    """Run (or continue) every member; members that differ only in their seed and in traced
    numbers (loss coefficients, learning rates, p, beta, feature probability) train as one
    program per stage."""
    from pdctl.sweep.stacked import STRATEGIES

    if strategy is not None and strategy not in STRATEGIES:
        raise PdctlError(f"--strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}")
    sweep = load(name)
    with stopping_cleanly():
        from pdctl.engine import runtime
        from pdctl.engine.loop import Interrupted
        from pdctl.sweep.run import run_sweep

        runtime.setup_logging()
        first = sweep.project(sweep.members[0])
        runtime.initialize(first.config, None, root=first.root)
        try:
            run_sweep(sweep, strategy, echo=lambda s: console.print(s, markup=False))
        except Interrupted as e:
            raise Interrupted(f"{e}; `pdctl sweep run {name}` continues the sweep") from None
    render.sweep_status(sweep, as_json=False)


def sweep_status(
    name: Annotated[str, typer.Argument(help="Sweep directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """One row per member (varied values, status, CI errors, min MMCS, L0, alive) and the
    success fraction per grid point."""
    render.sweep_status(load(name), as_json)


def sweep_report(name: Annotated[str, typer.Argument(help="Sweep directory.")]) -> None:
    """The metrics per grid point with their spread over seeds; writes NAME/report.md."""
    from pdctl.files import atomic_write
    from pdctl.sweep import table

    sweep = load(name)
    text = table.report_markdown(sweep, table.by_point(sweep, table.rows(sweep)))
    atomic_write(sweep.root / "report.md", text.encode("utf-8"))
    typer.echo(text, nl=False)
    console.print(f"wrote {sweep.root / 'report.md'}")
