"""The commands that read a finished stage: `report`, `harvest`, `browse` and `export`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, overload

import typer

from pdctl.cli.base import console, err_console, project
from pdctl.errors import PdctlError


def report(
    ctx: typer.Context,
    stage: Annotated[
        str, typer.Option("--stage", help="Stage to report: pretrain | warmup | train.")
    ] = "train",
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Directory to write (default: <run>/report/)."),
    ] = None,
) -> None:
    """Figures of a stage (training curves, CI matrices, densities, ...) and an index.html."""
    from pdctl import report as rep
    from pdctl.engine import runtime

    proj = project(ctx)
    # JAX as the stages start it: the CPU alone where libtpu is installed without TPU chips (the
    # tpu-aot extra), which otherwise loads it and prints its initialization errors
    runtime.setup_logging()
    runtime.initialize(proj.config, None, root=proj.root)
    with rep.progress_bar(err_console) as progress:
        result = rep.build_report(proj, stage=stage, out=out, progress=progress)
    for line in result.missing:
        console.print(f"missing: {line}", markup=False)
    console.print(f"wrote {len(result.files)} files; open {result.index}", markup=False)


@overload
def int_flag(text: str, flag: str) -> int: ...
@overload
def int_flag(text: None, flag: str) -> None: ...
@overload
def int_flag(text: str | None, flag: str) -> int | None: ...
def int_flag(text: str | None, flag: str) -> int | None:
    """An integer option given as text ("1000", "1e6"): one line naming `flag` for anything
    else (click's own check prints a usage block of three lines)."""
    if text is None:
        return None
    from decimal import Decimal, InvalidOperation

    try:
        d = Decimal(text.strip().replace("_", ""))
        if d.is_finite() and d == d.to_integral_value() and abs(d) < 10**30:
            return int(d)
    except (InvalidOperation, ValueError):
        pass
    raise PdctlError(f"{flag}: must be an integer, got {text!r}")


def harvest(
    ctx: typer.Context,
    stage: Annotated[
        str, typer.Option("--stage", help="Decomposition to harvest: train | warmup.")
    ] = "train",
    tokens: Annotated[
        str | None,
        typer.Option(
            "--tokens", metavar="N", help="Tokens to harvest (toys: inputs); default: the split."
        ),
    ] = None,
    batch_size: Annotated[
        str | None,
        typer.Option("--batch-size", metavar="B", help="Sequences (toys: inputs) per batch."),
    ] = None,
    split: Annotated[str, typer.Option("--split", help="eval | train (LMs).")] = "eval",
    top_k: Annotated[
        str,
        typer.Option(
            "--top-k", metavar="K", help="Top and sampled examples kept per component (1-1000)."
        ),
    ] = "20",
    effects: Annotated[
        str,
        typer.Option(
            "--effects",
            metavar="N",
            help="LMs: output effect of the N most often firing components.",
        ),
    ] = "256",
    cooc_max: Annotated[
        str,
        typer.Option(
            "--cooc-max",
            metavar="N",
            help="Co-occurrence: dense over every component up to N of them; beyond, a second "
            "pass over the N most often firing.",
        ),
    ] = "8192",
    sites: Annotated[
        str | None,
        typer.Option(
            "--sites",
            metavar="PATTERNS",
            help="Only the sites matching these glob patterns, comma-separated (e.g. "
            "'model.layers.0.*,model.layers.15.*'): a smaller harvest of a whole model.",
        ),
    ] = None,
    skip_first: Annotated[
        str | None,
        typer.Option(
            "--skip-first",
            metavar="N",
            help="LMs: each sequence's first N positions left out (still shown as context): "
            "sequences are cut from the joined corpus, so the first token has no context and "
            "many components fire on it whatever it is.  [default: 1]",
        ),
    ] = None,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Harvest again from the start, even when harvest.db is complete for these "
            "options or a stopped harvest could go on.",
        ),
    ] = False,
) -> None:
    """What each component does over a corpus: firing frequency, CI statistics, top and
    sampled examples, co-occurring components and input tokens, into <run>/harvest/harvest.db
    (resumable: run it again after an interruption; a harvest already complete for the same
    checkpoint and options is left as it is)."""
    from pdctl import report as rep
    from pdctl.engine import runtime
    from pdctl.harvest import run as hv

    options: dict[str, Any] = {  # `harvest`'s keyword arguments
        "n_tokens": int_flag(tokens, "--tokens"),
        "batch_size": int_flag(batch_size, "--batch-size"),
        "split": split,
        "top_k": int_flag(top_k, "--top-k"),
        "effects": int_flag(effects, "--effects"),
        "cooc_max": int_flag(cooc_max, "--cooc-max"),
        "sites": tuple(sites.split(",")) if sites is not None else (),
        "skip_first": int_flag(skip_first, "--skip-first"),
    }
    hv.check_options(stage=stage, **options)  # before anything starts
    proj = project(ctx)
    runtime.setup_logging()
    runtime.initialize(proj.config, ctx.obj.dist if ctx.obj else None, root=proj.root)
    with rep.progress_bar(err_console) as progress:
        task = progress.add_task("harvest", total=None)

        def on_batch(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        result = hv.harvest(proj, stage=stage, on_batch=on_batch, fresh=fresh, **options)
    if result.already is not None:
        console.print(result.already, markup=False, soft_wrap=True)
        return
    again = f" (went on from batch {result.resumed_from})" if result.resumed_from else ""
    by = f" by {result.processes} processes" if result.processes > 1 else ""
    console.print(
        f"harvested {result.n_positions} positions in {result.batches} batches{by}{again}: "
        f"{result.path}",
        markup=False,
    )
    for line in result.kept:  # what it kept of the database it replaced: one line each
        console.print(line, markup=False, soft_wrap=True)


def browse(
    ctx: typer.Context,
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8765,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind (default: this machine only).")
    ] = "127.0.0.1",
) -> None:
    """A local web app over the run's harvest (`pdctl harvest` first): sites, a sortable
    component table, component pages, token search. Read-only; Ctrl-C stops it."""
    from pdctl.harvest import browse as br

    proj = project(ctx)
    app_ = br.make_app(proj)
    br.check_port(host, port)
    console.print(f"pdctl browse: http://{host}:{port}/ (Ctrl-C stops it)", markup=False)
    import uvicorn

    uvicorn.run(app_, host=host, port=port, log_level="warning")


def export(
    ctx: typer.Context,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="The file to write (.npz or .safetensors).")
    ],
    stage: Annotated[
        str | None,
        typer.Option(
            "--stage", help="Stage to export (default: the last stage run, which must be done)."
        ),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option("--format", help="npz | safetensors (default: from the --out suffix)."),
    ] = None,
) -> None:
    """Write a stage's final arrays (target, V/U per site, CI functions, sources) to an .npz
    file, or to a .safetensors file with V/U under each site's own name and the config
    fingerprints in its metadata."""
    from pdctl.engine import runtime
    from pdctl.stages import export as exporting

    proj = project(ctx)
    runtime.setup_logging()
    runtime.initialize(proj.config, None, root=proj.root)  # JAX as the stages start it
    shapes = exporting.export(proj, stage, out, fmt)
    console.print(f"wrote {len(shapes)} arrays to {out}")
