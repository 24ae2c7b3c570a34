"""What the commands print: the status table, a stage's last line and its evaluation, and the
sweep's table."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.table import Table

from pdctl.cli.base import console


def fmt_metrics(metrics: dict[str, Any] | None, limit: int = 3) -> str:
    if not metrics:
        return ""
    skip = {
        "loss",
        "total",
        "finite",
        "max_bad_run",
        "step_ms",
        "samples_per_s",
        "tokens_per_s",
        "tflops_per_s",
        "mfu",
        "lr",
        "grad_norm",
    }
    keys = [k for k in ("loss",) if k in metrics] + [k for k in metrics if k not in skip]
    parts = [f"{k}={metrics[k]:.4g}" for k in keys[:limit] if isinstance(metrics[k], int | float)]
    return " ".join(parts)


def status(proj: Any, report: dict[str, Any]) -> None:
    """`pdctl status`: one row per stage, then the report's and the harvest's line."""
    from pdctl.report import eval_summary, report_line

    table = Table(title=f"{proj.root}", title_justify="left")
    table.add_column("stage", no_wrap=True)  # the names are what users type: never wrapped
    for col in ("status", "step", "metrics", "eval", "wall s", "compile s", "checkpoint"):
        table.add_column(col)
    for stage, st in report.items():
        status_txt = st["status"]
        if st.get("stale"):
            status_txt += " (stale)"
        if st.get("crashed"):
            status_txt += " (crashed: `pdctl resume`)"
        if st["status"] == "failed" and st.get("lost_process") is not None:
            status_txt += f" (process {st['lost_process']} lost: `pdctl resume`)"
        steps = st.get("steps")
        step = f"{st.get('step', '')}" + (f"/{steps}" if steps else "")
        compile_s = st.get("compile_s")
        if isinstance(compile_s, dict):
            compile_s = sum(v for v in compile_s.values() if isinstance(v, int | float))
        table.add_row(
            stage,
            status_txt,
            step,
            fmt_metrics(st.get("metrics")),
            eval_summary(st, stage),
            f"{st['wall_s']:.1f}" if "wall_s" in st else "",
            f"{compile_s:.1f}" if isinstance(compile_s, int | float) else "",
            str(st.get("checkpoint", "")),
        )
    console.print(table)
    from pdctl.harvest.run import harvest_line

    for line in (report_line(proj), harvest_line(proj)):
        if line:
            console.print(line, markup=False)


def done_line(stage: str, result) -> None:
    m = result.metrics
    loss = m.get("loss")
    loss_txt = f", loss {loss:.5g}" if loss is not None else ""
    console.print(f"{stage}: {result.status} at step {result.step}{loss_txt}")


def print_eval(ev: dict) -> None:
    if not ev:
        return
    if "ci_errors" in ev:
        errs = int(ev["ci_errors"].get("total", sum(ev["ci_errors"].values())))
        mmcs = ev.get("mmcs") or {}
        mm = f", MMCS {min(mmcs.values()):.4f}" if mmcs else ""
        console.print(f"eval: CI errors {errs}{mm}, L0 {ev.get('l0')}")
    else:
        keys = [k for k in ev if k.startswith(("ce_", "kl_"))]
        console.print("eval: " + ", ".join(f"{k} {ev[k]:.4g}" for k in keys))


def sweep_status(sweep, as_json: bool) -> None:
    from pdctl.sweep import table

    rows = table.rows(sweep)
    points = table.by_point(sweep, rows)
    if as_json:
        typer.echo(json.dumps({"members": rows, "points": points}))
        return
    t = Table(title=f"sweep {sweep.name}")
    keep = [i for i, h in enumerate(table.STATUS_HEADER) if h != "grid point" or sweep.grid]
    for i in keep:  # a long member name folds rather than squeezing the other columns away
        t.add_column(table.STATUS_HEADER[i], overflow="fold" if i < 2 else "ellipsis")
    for line in table.status_lines(sweep, rows):
        t.add_row(*(line[i] for i in keep))
    console.print(t)
    for g in points:
        frac = f"{g['success']}/{g['finished']}" if g["finished"] else "none finished"
        console.print(f"{g['point']}: success {frac} ({g['members']} members)", markup=False)
