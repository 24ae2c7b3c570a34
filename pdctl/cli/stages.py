"""The commands that run stages: `init-weights`, `pretrain`, `warmup`, `train` (one body,
`run_stage`, which finds the stage in `pdctl.registry` by its command name), `run` and
`resume`. Each runs `supervised`: SIGTERM/SIGINT stop it cleanly with a checkpoint."""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

import typer

from pdctl.cli import render
from pdctl.cli.base import console, project
from pdctl.cli.process import stopping_cleanly
from pdctl.errors import PdctlError

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


def stage_project(ctx: typer.Context):
    """Load the project and set up JAX for a stage (multi-host runtime, compile cache)."""
    from pdctl import supervisor
    from pdctl.engine import runtime

    proj = project(ctx)
    supervisor.adopt(proj)  # supervised: the parent process holds the run directory's lock
    from pdctl.engine import peers

    # supervised: the parent keeps copies of the connections to the other processes, to tell
    # after an abort whether another process had died first
    peers.report_to(supervisor.share_peer, lambda pid: supervisor.tell(left=pid))
    runtime.setup_logging()
    runtime.initialize(proj.config, ctx.obj.dist if ctx.obj else None, root=proj.root)
    runtime.freeze_heap()  # JAX, orbax and the stages are imported: none of it is garbage
    return proj


@contextlib.contextmanager
def supervised(ctx: typer.Context):
    """Yields (the pipeline module, the project) for a command that runs stages: SIGTERM/SIGINT
    stop it cleanly from the first instruction (`process.stopping_cleanly`; from the real entry
    point the work runs in a supervised child process), then the project is loaded and JAX set
    up (`stage_project`)."""
    with stopping_cleanly():
        from pdctl.stages import pipeline

        yield pipeline, stage_project(ctx)


def check_stage_flags(
    *, until: int | None, resume: bool, fresh: bool, steps: int | None = None
) -> None:
    if resume and fresh:
        raise PdctlError("--resume and --fresh: choose one (continue the stage, or start it over)")
    if until is not None and until < 1:
        raise PdctlError(f"--until: must be a step >= 1, got {until}")
    if steps is not None and steps < 1:
        raise PdctlError(f"--steps: must be >= 1, got {steps}")


def parse_range(value: str | None, key: str) -> tuple[int, int] | None:
    if not value:
        return None
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        raise PdctlError(f"{key}: expected A:B (two step numbers), got {value!r}") from None
    if not 0 <= a < b:
        raise PdctlError(f"{key}: need 0 <= A < B, got {value!r}")
    return a, b


def run_stage(ctx: typer.Context, **flags: Any) -> tuple[str, Any]:
    """The body of every `pdctl <stage>` command: the stage is the registry's for the command's
    name; its flags are checked before anything starts (a mistake starts no process), and the
    rest go to the stage's `run` as given. Returns (the stage, what its run returned)."""
    from pdctl import registry

    if ctx.info_name is None:  # click names every command's context; a bare Context has none
        raise TypeError("run_stage needs the context of a `pdctl <stage>` command")
    stage = registry.by_command(ctx.info_name).name
    check_stage_flags(
        until=flags.get("until"),
        resume=flags.get("resume", False),
        fresh=flags.get("fresh", False),
        steps=flags.get("steps"),
    )
    if "profile_steps" in flags:
        flags["profile"] = parse_range(flags.pop("profile_steps"), "--profile-steps")
    with supervised(ctx) as (pipeline, proj):
        return stage, pipeline.run_stage(proj, stage, **flags)


def init_weights(ctx: typer.Context) -> None:
    """Seeded, sharded init of the target, the components (V/U), CI functions and sources."""
    stage, out = run_stage(ctx)
    total = sum(out["compile_s"].values())
    console.print(
        f"{stage}: done ({out['param_count']:,} target parameters, "
        f"{len(out['sites'])} sites, {total:.2f} s compiling)"
    )


def pretrain(
    ctx: typer.Context,
    steps: Steps = None,
    until: Until = None,
    resume: Resume = False,
    fresh: Fresh = False,
    profile_steps: Profile = None,
) -> None:
    """Train the target model (AdamW + schedule from [pretrain])."""
    render.done_line(
        *run_stage(
            ctx, steps=steps, until=until, resume=resume, fresh=fresh, profile_steps=profile_steps
        )
    )


def warmup(
    ctx: typer.Context,
    until: Until = None,
    resume: Resume = False,
    fresh: Fresh = False,
    profile_steps: Profile = None,
) -> None:
    """Faithfulness warmup of the components (V/U) toward the pretrained target weights."""
    render.done_line(
        *run_stage(ctx, until=until, resume=resume, fresh=fresh, profile_steps=profile_steps)
    )


def train(
    ctx: typer.Context,
    until: Until = None,
    resume: Resume = False,
    fresh: Fresh = False,
    profile_steps: Profile = None,
) -> None:
    """Stochastic Parameter Decomposition training (the full SPD step of [train])."""
    stage, result = run_stage(
        ctx, until=until, resume=resume, fresh=fresh, profile_steps=profile_steps
    )
    render.done_line(stage, result)
    render.print_eval(result.eval)


TrainUntil = Annotated[
    int | None,
    typer.Option(
        "--until", help="Stop the train stage cleanly at this step of its schedule (interrupted)."
    ),
]


def run_pipeline(ctx: typer.Context, until: TrainUntil = None) -> None:
    """Run init-weights → pretrain → warmup → train, skipping what is done and not stale."""
    check_stage_flags(until=until, resume=False, fresh=False)
    with supervised(ctx) as (pipeline, proj):
        pipeline.run_all(proj, echo=lambda s: console.print(s, markup=False), until=until)
    console.print(pipeline.summary(proj), markup=False)


def resume(ctx: typer.Context, until: TrainUntil = None) -> None:
    """Continue the interrupted (or crashed) stage from its latest checkpoint, to the end."""
    check_stage_flags(until=until, resume=False, fresh=False)
    with supervised(ctx) as (pipeline, proj):
        stage, result = pipeline.resume(proj, until=until)
    render.done_line(stage, result)
