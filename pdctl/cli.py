"""The pdctl command line: parse, call one engine function, print, map errors to exit codes.

Every command is thin. User mistakes raise `PdctlError` anywhere below; `_guard` prints them as
one line on stderr and exits 2 (no traceback).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from pdctl import __version__
from pdctl.errors import PdctlError

app = typer.Typer(
    name="pdctl",
    help="Stochastic Parameter Decomposition of neural networks with JAX, driven by pdctl.toml.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


class Globals:
    project: Path | None = None
    dist = None


# The commands that turn SIGTERM/SIGINT into a clean stop (`_stopping_cleanly`): a signal that
# came while `main` started is theirs to act on. Every other command gets it back as it begins.
_STOPS_CLEANLY = {"init_weights", "pretrain", "warmup", "train", "run_pipeline", "resume",
                  "sweep_run"}  # fmt: skip


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a PdctlError into one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if fn.__name__ not in _STOPS_CLEANLY:
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
) -> None:
    """pdctl: decompose a network's parameters with SPD. Start with `pdctl new NAME`."""
    from pdctl.engine.runtime import DistributedFlags

    ctx.obj = Globals()
    ctx.obj.project = project
    ctx.obj.dist = DistributedFlags(coordinator, num_processes, process_id)


def _project(ctx: typer.Context):
    from pdctl.project import Project

    return Project.find(explicit=ctx.obj.project if ctx.obj else None)


@app.command()
@_guard
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


@app.command()
@_guard
def templates() -> None:
    """List the run templates."""
    from pdctl.templates import available

    for name, line in available().items():
        typer.echo(f"{name:<10} {line}")


def _fmt_metrics(metrics: dict[str, Any] | None, limit: int = 3) -> str:
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


@app.command()
@_guard
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
    proj = _project(ctx)
    report = proj.status_report()
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
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
            _fmt_metrics(st.get("metrics")),
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


@app.command()
@_guard
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

    proj = _project(ctx)
    with rep.progress_bar(err_console) as progress:
        result = rep.build_report(proj, stage=stage, out=out, progress=progress)
    for line in result.missing:
        console.print(f"missing: {line}", markup=False)
    console.print(f"wrote {len(result.files)} files; open {result.index}", markup=False)


def _int_flag(text: str | None, flag: str) -> int | None:
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


@app.command()
@_guard
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
) -> None:
    """What each component does over a corpus: firing frequency, CI statistics, top and
    sampled examples, co-occurring components and input tokens, into <run>/harvest/harvest.db
    (resumable: run it again after an interruption)."""
    from pdctl import report as rep
    from pdctl.engine import runtime
    from pdctl.harvest import run as hv

    options = {
        "n_tokens": _int_flag(tokens, "--tokens"),
        "batch_size": _int_flag(batch_size, "--batch-size"),
        "split": split,
        "top_k": _int_flag(top_k, "--top-k"),
        "effects": _int_flag(effects, "--effects"),
        "cooc_max": _int_flag(cooc_max, "--cooc-max"),
    }
    hv.check_options(stage=stage, **options)  # before anything starts
    proj = _project(ctx)
    runtime.setup_logging()
    runtime.initialize(proj.config, ctx.obj.dist if ctx.obj else None, root=proj.root)
    with rep.progress_bar(err_console) as progress:
        task = progress.add_task("harvest", total=None)

        def on_batch(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        result = hv.harvest(proj, stage=stage, on_batch=on_batch, **options)
    again = f" (went on from batch {result.resumed_from})" if result.resumed_from else ""
    by = f" by {result.processes} processes" if result.processes > 1 else ""
    console.print(
        f"harvested {result.n_positions} positions in {result.batches} batches{by}{again}: "
        f"{result.path}",
        markup=False,
    )


@app.command()
@_guard
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

    proj = _project(ctx)
    app_ = br.make_app(proj)
    br.check_port(host, port)
    console.print(f"pdctl browse: http://{host}:{port}/ (Ctrl-C stops it)", markup=False)
    import uvicorn

    uvicorn.run(app_, host=host, port=port, log_level="warning")


from pdctl.harvest import analysis_cli  # noqa: E402  (commands over a finished harvest)

app.command()(_guard(analysis_cli.cluster))
app.command()(_guard(analysis_cli.attributions))


def _stage_project(ctx: typer.Context):
    """Load the project and set up JAX for a stage (multi-host runtime, compile cache)."""
    from pdctl import supervisor
    from pdctl.engine import runtime

    proj = _project(ctx)
    supervisor.adopt(proj)  # supervised: the parent process holds the run directory's lock
    from pdctl.engine import peers

    # supervised: the parent keeps copies of the connections to the other processes, to tell
    # after an abort whether another process had died first
    peers.report_to(supervisor.share_peer, lambda pid: supervisor.tell(left=pid))
    runtime.setup_logging()
    runtime.initialize(proj.config, ctx.obj.dist if ctx.obj else None, root=proj.root)
    return proj


@contextlib.contextmanager
def _stopping_cleanly():
    """SIGTERM/SIGINT from here on ask the stage to stop with a checkpoint (exit 3) instead of
    killing the process: installed before JAX is imported, the run restored or compiled.

    From the real entry point (`main`), the stage runs in a supervised child process instead
    (`pdctl.supervisor`): this process forwards the signals and answers for a child that dies
    by one."""
    from pdctl import supervisor

    if supervisor.active():
        import sys

        raise typer.Exit(supervisor.run_child(sys.argv[1:]))
    from pdctl.engine import runtime

    with runtime.stop_signals():
        for s in supervisor.take_held():  # a stop that came while the process started
            os.kill(os.getpid(), s)
        supervisor.tell(ready=True)
        runtime.on_stop(supervisor.tell_stopping)
        yield


def _check_stage_flags(
    *, until: int | None, resume: bool, fresh: bool, steps: int | None = None
) -> None:
    if resume and fresh:
        raise PdctlError("--resume and --fresh: choose one (continue the stage, or start it over)")
    if until is not None and until < 1:
        raise PdctlError(f"--until: must be a step >= 1, got {until}")
    if steps is not None and steps < 1:
        raise PdctlError(f"--steps: must be >= 1, got {steps}")


def _parse_range(value: str | None, key: str) -> tuple[int, int] | None:
    if not value:
        return None
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        raise PdctlError(f"{key}: expected A:B (two step numbers), got {value!r}") from None
    if not 0 <= a < b:
        raise PdctlError(f"{key}: need 0 <= A < B, got {value!r}")
    return a, b


def _done_line(stage: str, result) -> None:
    m = result.metrics
    loss = m.get("loss")
    loss_txt = f", loss {loss:.5g}" if loss is not None else ""
    console.print(f"{stage}: {result.status} at step {result.step}{loss_txt}")


Steps = Annotated[int | None, typer.Option("--steps", help="Total steps (overrides the config).")]
Until = Annotated[
    int | None,
    typer.Option("--until", help="Stop cleanly at this step of the schedule (status interrupted)."),
]
Resume = Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint.")]
Fresh = Annotated[
    bool, typer.Option("--fresh", help="Start over, dropping this stage's checkpoints.")
]
Profile = Annotated[
    str | None,
    typer.Option("--profile-steps", help="Write a jax.profiler trace of steps A:B to profiles/."),
]


@app.command("init-weights")
@_guard
def init_weights(ctx: typer.Context) -> None:
    """Seeded, sharded init of the target, the components (V/U), CI functions and sources."""
    with _stopping_cleanly():
        from pdctl.stages import pipeline

        out = pipeline.run_stage(_stage_project(ctx), "init_weights")
    total = sum(out["compile_s"].values())
    console.print(
        f"init_weights: done ({out['param_count']:,} target parameters, "
        f"{len(out['sites'])} sites, {total:.2f} s compiling)"
    )


@app.command()
@_guard
def pretrain(
    ctx: typer.Context,
    steps: Steps = None,
    until: Until = None,
    resume: Resume = False,
    fresh: Fresh = False,
    profile_steps: Profile = None,
) -> None:
    """Train the target model (AdamW + schedule from [pretrain])."""
    _check_stage_flags(until=until, resume=resume, fresh=fresh, steps=steps)
    profile = _parse_range(profile_steps, "--profile-steps")
    with _stopping_cleanly():
        from pdctl.stages import pipeline

        result = pipeline.run_stage(
            _stage_project(ctx),
            "pretrain",
            steps=steps,
            until=until,
            resume=resume,
            fresh=fresh,
            profile=profile,
        )
    _done_line("pretrain", result)


@app.command()
@_guard
def warmup(
    ctx: typer.Context,
    until: Until = None,
    resume: Resume = False,
    fresh: Fresh = False,
    profile_steps: Profile = None,
) -> None:
    """Faithfulness warmup of the components (V/U) toward the pretrained target weights."""
    _check_stage_flags(until=until, resume=resume, fresh=fresh)
    profile = _parse_range(profile_steps, "--profile-steps")
    with _stopping_cleanly():
        from pdctl.stages import pipeline

        result = pipeline.run_stage(
            _stage_project(ctx), "warmup", until=until, resume=resume, fresh=fresh, profile=profile
        )
    _done_line("warmup", result)


@app.command()
@_guard
def train(
    ctx: typer.Context,
    until: Until = None,
    resume: Resume = False,
    fresh: Fresh = False,
    profile_steps: Profile = None,
) -> None:
    """Stochastic Parameter Decomposition training (the full SPD step of [train])."""
    _check_stage_flags(until=until, resume=resume, fresh=fresh)
    profile = _parse_range(profile_steps, "--profile-steps")
    with _stopping_cleanly():
        from pdctl.stages import pipeline

        result = pipeline.run_stage(
            _stage_project(ctx), "train", until=until, resume=resume, fresh=fresh, profile=profile
        )
    _done_line("train", result)
    _print_eval(result.eval)


def _print_eval(ev: dict) -> None:
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


@app.command("run")
@_guard
def run_pipeline(ctx: typer.Context) -> None:
    """Run init-weights → pretrain → warmup → train, skipping what is done and not stale."""
    with _stopping_cleanly():
        from pdctl.stages import pipeline

        proj = _stage_project(ctx)
        pipeline.run_all(proj, echo=lambda s: console.print(s, markup=False))
    console.print(pipeline.summary(proj), markup=False)


@app.command()
@_guard
def resume(ctx: typer.Context) -> None:
    """Continue the interrupted (or crashed) stage from its latest checkpoint, to the end."""
    with _stopping_cleanly():
        from pdctl.stages import pipeline

        stage, result = pipeline.resume(_stage_project(ctx))
    _done_line(stage, result)


@app.command()
@_guard
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
    from pdctl.stages import pipeline

    shapes = pipeline.export(_project(ctx), stage, out, fmt)
    console.print(f"wrote {len(shapes)} arrays to {out}")


@app.command("inspect-sharding")
@_guard
def inspect_sharding(
    ctx: typer.Context,
    stage: Annotated[
        str, typer.Option("--stage", help="init_weights | pretrain | warmup | train.")
    ] = "train",
    devices: Annotated[
        int | None,
        typer.Option("--devices", help="Preview a mesh of N devices (simulated CPU devices)."),
    ] = None,
    mesh: Annotated[
        str | None,
        typer.Option("--mesh", help="Override [mesh]: data=A,fsdp=B,tp=C (-1 = the rest)."),
    ] = None,
    compile_step: Annotated[
        bool,
        typer.Option("--compile", help="Compile the step; print XLA's per-device memory."),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object: rows, totals, memory.")
    ] = False,
    show_all: Annotated[
        bool, typer.Option("--all", help="One row per array (no grouping of same-shaped sites).")
    ] = False,
    device_memory: Annotated[
        str | None,
        typer.Option(
            "--device-memory",
            help="Fit check: compile the step and the evaluation's programs and compare each "
            "one's per-device peak with this much memory (80GiB, 40GB).",
        ),
    ] = None,
    device_kind: Annotated[
        str | None,
        typer.Option(
            "--device-kind",
            help="Fit check against a device's memory: a100-40, a100-80, h100, h200, b200, "
            "tpu-v5e, tpu-v5p.",
        ),
    ] = None,
) -> None:
    """Show each array's shape, PartitionSpec and bytes per device, without allocating."""
    import sys

    from pdctl.engine import runtime
    from pdctl.stages import inspect as insp

    runtime.configure_devices()  # the devices a stage would see
    runtime.check_backend()  # JAX_PLATFORMS=gpu without a GPU: one line, exit 2

    from pdctl.stages import fit

    stage = insp.parse_stage(stage)
    override = insp.parse_mesh(mesh)
    budget = fit.device_budget(device_memory, device_kind)
    proj = _project(ctx)
    if devices is not None and insp.needs_child(devices, proj.config, override):
        child = insp.run_child(
            devices,
            ctx.obj.project if ctx.obj else None,
            stage,
            mesh,
            compile_step,
            as_json,
            show_all,
            columns=console.width,
            device_memory=device_memory,
            device_kind=device_kind,
        )
        sys.stdout.write(child.stdout)
        sys.stderr.write(child.stderr)
        died = insp.child_death(devices, child.returncode, child.stderr)
        if died:
            err_console.print(f"error: {died}", markup=False)
            raise typer.Exit(1)
        raise typer.Exit(child.returncode)
    report = insp.inspect(
        proj.config,
        stage,
        override,
        compile=compile_step,
        expand=show_all,
        root=proj.root,
        budget=budget,
    )
    if as_json:
        typer.echo(json.dumps(report))
        return
    insp.render(report, console)


sweep_app = typer.Typer(
    help="Many runs of one template: seeds x a grid of config values, trained together.",
    no_args_is_help=True,
)
app.add_typer(sweep_app, name="sweep")


def _sweep(name: str):
    from pdctl.sweep.spec import Sweep

    return Sweep.load(Path(name))


@sweep_app.command("new")
@_guard
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


@sweep_app.command("run")
@_guard
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
    sweep = _sweep(name)
    with _stopping_cleanly():
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
    _sweep_status(sweep, as_json=False)


def _sweep_status(sweep, as_json: bool) -> None:
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


@sweep_app.command("status")
@_guard
def sweep_status(
    name: Annotated[str, typer.Argument(help="Sweep directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """One row per member (varied values, status, CI errors, min MMCS, L0, alive) and the
    success fraction per grid point."""
    _sweep_status(_sweep(name), as_json)


@sweep_app.command("report")
@_guard
def sweep_report(name: Annotated[str, typer.Argument(help="Sweep directory.")]) -> None:
    """The metrics per grid point with their spread over seeds; writes NAME/report.md."""
    from pdctl.files import atomic_write
    from pdctl.sweep import table

    sweep = _sweep(name)
    text = table.report_markdown(sweep, table.by_point(sweep, table.rows(sweep)))
    atomic_write(sweep.root / "report.md", text.encode("utf-8"))
    typer.echo(text, nl=False)
    console.print(f"wrote {sweep.root / 'report.md'}")


def main() -> None:
    """The `pdctl` command. Stage commands run supervised (`pdctl.supervisor`). A stage that
    stopped while a compile, restore or evaluation was still running on a worker thread ends
    the process with os._exit once its state and last line are written: that C++ call cannot
    be cancelled, and the interpreter would wait for it on the way out."""
    import sys

    from pdctl import supervisor

    supervisor.hold_signals()  # a stop while Python starts up is acted on, not fatal
    from pdctl.engine import runtime

    runtime.cpu_xla_flags()  # before JAX starts (any command)
    supervisor.enable()
    try:
        app(prog_name="pdctl")
    except SystemExit as e:
        runtime = sys.modules.get("pdctl.engine.runtime")
        peers = sys.modules.get("pdctl.engine.peers")
        code = e.code if isinstance(e.code, int) else 1
        if runtime is not None and runtime.abandoned():
            sys.stdout.flush()
            sys.stderr.flush()
            if peers is not None:
                peers.say_bye()
            runtime.leave_together()
            os._exit(code)
        if peers is not None and peers.lost() is not None:
            # another process of the run died after this one's stage ended: JAX's shutdown
            # at exit would wait for it until the heartbeat timeout, then abort
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        raise


if __name__ == "__main__":
    main()
