"""The Typer commands over a finished harvest that add to its harvest.db: `pdctl cluster` and
`pdctl attributions` (registered in `pdctl.cli.app`, which wraps them in its error guard)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer

from pdctl.errors import PdctlError


def _float_flag(text: str, flag: str) -> float:
    """A float option given as text: one line naming `flag` for anything else."""
    try:
        v = float(text.strip())
    except ValueError:
        v = math.nan
    if not math.isfinite(v):
        raise PdctlError(f"{flag}: must be a number, got {text!r}")
    return v


def cluster(
    ctx: typer.Context,
    min_jaccard: Annotated[
        str,
        typer.Option(
            "--min-jaccard",
            metavar="J",
            help="Cut the tree where the average Jaccard between two groups falls below J.",
        ),
    ] = "0.5",
    min_count: Annotated[
        str,
        typer.Option("--min-count", metavar="N", help="Cluster components that fired >= N times."),
    ] = "1",
    max_components: Annotated[
        str,
        typer.Option(
            "--max-components", metavar="N", help="At most the N most often firing components."
        ),
    ] = "8192",
) -> None:
    """Group the harvest's components by co-activation (average-linkage clustering on the
    Jaccard distance of their firings) and write the clusters into harvest.db (`pdctl
    browse` and `pdctl report` show them)."""
    from pdctl.cli.base import console
    from pdctl.cli.base import project as _project
    from pdctl.cli.post import int_flag as _int_flag
    from pdctl.harvest import cluster as cl

    options: dict[str, Any] = {  # `cluster`'s keyword arguments
        "min_jaccard": _float_flag(min_jaccard, "--min-jaccard"),
        "min_count": _int_flag(min_count, "--min-count"),
        "max_components": _int_flag(max_components, "--max-components"),
    }
    cl.check_options(**options)  # before anything is read
    res = cl.cluster(_project(ctx), **options)
    console.print(
        f"clustered {res.n_components} components: {res.n_clusters} clusters of two or more "
        f"(largest {res.largest}), {res.n_singletons} alone: {res.path}",
        markup=False,
    )


def attributions(
    ctx: typer.Context,
    components: Annotated[
        str,
        typer.Option(
            "--components", metavar="N", help="Attribute the N most often firing components."
        ),
    ] = "64",
    top: Annotated[
        str,
        typer.Option("--top", metavar="K", help="Upstream components kept per sign."),
    ] = "10",
) -> None:
    """LM harvests: for each component, the input positions and upstream components that most
    raise its CI (gradient x input on its top examples), written into harvest.db (`pdctl
    browse` shows them)."""
    from pdctl import report as rep
    from pdctl.cli.base import console, err_console
    from pdctl.cli.base import project as _project
    from pdctl.cli.post import int_flag as _int_flag
    from pdctl.engine import runtime
    from pdctl.harvest import attributions as at

    options: dict[str, Any] = {"n_components": _int_flag(components, "--components"),
               "top": _int_flag(top, "--top")}  # fmt: skip
    at.check_options(**options)
    proj = _project(ctx)
    runtime.setup_logging()
    runtime.initialize(proj.config, None, root=proj.root)
    with rep.progress_bar(err_console) as progress:
        task = progress.add_task("attributions", total=None)

        def on_component(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        res = at.attributions(proj, on_component=on_component, **options)
    console.print(
        f"attributed {res.n_components} components over {res.n_examples} examples: {res.path}",
        markup=False,
    )
