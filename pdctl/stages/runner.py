"""The one way a training stage runs: `run_stage(project, spec)` opens the run (`StageEnv`),
finds where to start (`policy.resume_point`), builds the stage's program, makes or restores its
state, feeds it batches and hands it to `engine.loop.Loop`."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdctl.engine import ahead, runtime
from pdctl.engine.checkpoint import drop_checkpoints
from pdctl.engine.loop import Loop, LoopResult
from pdctl.engine.tracking import JsonlTracker
from pdctl.project import Project
from pdctl.registry import STAGES
from pdctl.stages.env import StageEnv, batches_state, text_batches
from pdctl.stages.inputs import peak_flops
from pdctl.stages.policy import resume_point


@dataclass(frozen=True)
class StageSpec:
    """What a training stage is, besides its program: what a fresh run
    starts from (the upstream arrays `make_state` takes), its frozen arguments (the trained
    target, for warmup and train) and, optionally, how it evaluates."""

    name: str  # in the registry, which says what it requires
    program: Callable[..., Any]  # (cfg, mesh, target, **options) -> StepProgram
    fresh_inputs: Callable[[StageEnv, Any], tuple[Any, ...]]
    frozen: Callable[[StageEnv, Any], tuple[Any, ...]] | None = None
    evaluation: Callable[[StageEnv, tuple[Any, ...], Any], Callable[[Any], dict]] | None = None
    # (env, step, program) -> (state, meta); default `env.restore_state` into the program's
    # abstract state (train converts an older checkpoint layout)
    restore: Callable[[StageEnv, int, Any], tuple[Any, dict[str, Any]]] | None = None
    # (the config it runs with) -> None, or, for a stage whose result would be the state it
    # starts from (warmup at `steps = 0`), the fields its `[state.<stage>]` records instead of a
    # checkpoint: a fresh run of it then builds, restores and saves nothing (`_run_idle`), and
    # the stages that read its result rebuild it from its inputs
    idle: Callable[[Any], dict[str, Any] | None] | None = None
    # (cfg, program, target, mesh) -> {name: lowered}: the evaluation's own programs, lowered
    # from abstract arguments, for compiling them ahead (`[compile] ahead`) and the fit check
    eval_programs: Callable[..., dict[str, Any]] | None = None


@dataclass(frozen=True)
class RunOptions:
    """How this run of a stage goes, from the command line: where it stops, whether it continues
    or starts over, what it profiles, and config keys it overrides (`--steps`)."""

    until: int | None = None
    resume: bool = False
    fresh: bool = False
    profile: tuple[int, int] | None = None
    # {"pretrain.steps": 3}: part of the stage's fingerprint and its checkpoints' config
    overrides: dict[str, Any] = field(default_factory=dict)
    program_options: dict[str, Any] = field(default_factory=dict)  # spec.program(..., **these)


@dataclass
class _Start:
    """Where the loop starts: the state, the frozen arguments, the step, and what feeds it."""

    state: Any
    frozen: tuple[Any, ...]
    step: int
    batches: Any = None
    eval_fn: Callable[[Any], dict] | None = None
    eval_owed: bool = False  # the checkpoint was saved by a stop during its evaluation


def run_stage(
    project: Project,
    spec: StageSpec,
    *,
    until: int | None = None,
    resume: bool = False,
    fresh: bool = False,
    profile: tuple[int, int] | None = None,
    overrides: dict[str, Any] | None = None,
    program_options: dict[str, Any] | None = None,
):
    """Run any training stage: open the run, find where to start (fresh or a checkpoint), build
    the stage's program, make or restore its state, feed it batches and hand it to the loop."""
    opts = RunOptions(until, resume, fresh, profile, overrides or {}, program_options or {})
    with StageEnv.open(project, spec.name) as env:
        return _run_stage(env, spec, opts)


def _run_stage(env: StageEnv, spec: StageSpec, opts: RunOptions):
    env.overrides.update(opts.overrides)
    cfg = env.cfg
    idle = spec.idle(env.effective_config()) if spec.idle is not None else None
    if idle is None:
        prog = spec.program(cfg, env.mesh, env.target, **opts.program_options)
    ckpt_step = resume_point(env, resume=opts.resume, fresh=opts.fresh)
    if idle is not None:
        if ckpt_step is None:
            return _run_idle(env, idle)
        prog = spec.program(cfg, env.mesh, env.target, **opts.program_options)
    step_ready = None
    rank = STAGES.index(spec.name) if spec.name in STAGES else len(STAGES)
    end = min(prog.total_steps, opts.until or prog.total_steps)
    if ahead.enabled(cfg.compile.ahead) and (ckpt_step is None or ckpt_step < end):
        # compiled on the host thread while the state is restored and the data read (after
        # `pdctl run`'s compile of it, if it queued one: then read from the cache); the loop's
        # compile then finds it in process (`StepProgram.jit` is one object)
        step_ready = ahead.submit(spec.name, functools.partial(_compile_step, prog), rank)
    # Restores, tokenization and the compiles inside them are long calls into C++: each runs
    # `interruptible`, so a stop request is acted on within seconds (runtime.StopNow).
    later = runtime.interruptible
    frozen = later(spec.frozen, env, prog, what="restoring the target") if spec.frozen else ()
    data_state = None
    if ckpt_step is None:
        env.begin(fresh=True, steps=prog.total_steps)
        state = later(
            lambda: prog.jit_make_state()(*spec.fresh_inputs(env, prog)),
            what="restoring the stage's inputs",
        )
        step = 0
    else:
        env.begin(fresh=False, steps=prog.total_steps)
        if spec.restore is not None:
            state, meta = later(
                spec.restore, env, ckpt_step, prog, what=f"restoring checkpoint {ckpt_step}"
            )
        else:
            state, meta = later(
                env.restore_state,
                ckpt_step,
                prog.abstract_state,
                prog.state_shardings,
                what=f"restoring checkpoint {ckpt_step}",
            )
        step, data_state = int(meta["step"]), meta.get("data")
    start = _Start(state, frozen, step)
    if ckpt_step is not None:
        start.eval_owed = bool(meta.get("eval_owed"))
    if not prog.makes_own_batch:
        start.batches = later(
            text_batches,
            env,
            prog.examples_per_step,
            seed=cfg.run.seed,
            state=data_state,
            sharding=prog.batch_shardings["tokens"],
            what="reading and tokenizing the corpus",
        )
    if spec.evaluation:
        start.eval_fn = later(spec.evaluation, env, frozen, prog, what="preparing the evaluation")
        every = getattr(getattr(cfg, spec.name), "eval_every", 0)
        if spec.eval_programs is not None and every > 0 and step_ready is not None:
            # compiled on the host thread after the step, while the steps run; the evaluation
            # waits for it and finds them in process
            done = ahead.submit(f"{spec.name} evaluation", functools.partial(
                compile_eval_programs, spec, cfg, prog, env.target, env.mesh), rank)  # fmt: skip
            start.eval_fn = _after_ahead(start.eval_fn, done)
    result = _loop(env, spec, prog, start, opts, step_ready)
    if result.status == "done" and result.eval:
        env.on_state(eval=result.eval)
    return result


def _compile_step(prog: Any) -> None:
    with ahead.TRACING:
        lowered = prog.lower()
    lowered.compile()


def compile_eval_programs(spec: StageSpec, cfg: Any, prog: Any, target: Any, mesh: Any) -> None:
    """Compile the stage's evaluation programs (`StageSpec.eval_programs`), kept in process for
    its evaluation (and in the compile cache); not where the evaluation runs replicated
    instead (several CPU devices: `runtime.collective_free_eval`)."""
    if spec.eval_programs is None or runtime.collective_free_eval(mesh):
        return
    with ahead.TRACING:
        lowered = spec.eval_programs(cfg, prog, target, mesh)
    for program in lowered.values():
        program.compile()


def _after_ahead(eval_fn: Callable[[Any], dict], done: Any) -> Callable[[Any], dict]:
    """`eval_fn` that first waits for `done` (the event of a job compiling its programs ahead:
    `engine.ahead`), so that it finds them instead of compiling them a second time (the loop
    runs an evaluation on a worker thread: a stop is acted on while it waits)."""

    def wrapped(state: Any) -> dict:
        done.wait()
        return eval_fn(state)

    return wrapped


def _run_idle(env: StageEnv, fields: dict[str, Any]) -> LoopResult:
    """A fresh run of a stage with nothing to do (`StageSpec.idle`): done at step 0 at once. No
    program, no restore, no state and no checkpoint (warmup at `steps = 0` would otherwise build
    and save the whole decomposition state, AdamW moments included, for the next stage to read
    back its components unchanged: 27 s and ~20 s of a TPU run of every MLP of SmolLM2). The
    previous run's checkpoints go, as a fresh run's first checkpoint would replace them, once
    the state says done; its metrics history starts over."""
    t0 = time.perf_counter()
    env.begin(fresh=True, steps=0)
    project = env.project
    if project.writer:
        JsonlTracker(project.metrics_path(env.stage)).truncate_after(-1)
    env.on_state(
        status="done",
        step=0,
        metrics={},
        wall_s=round(time.perf_counter() - t0, 3),
        **fields,
    )
    drop_checkpoints(project.checkpoint_dir(env.stage))
    return LoopResult(None, 0, "done")


def _loop(
    env: StageEnv, spec: StageSpec, prog: Any, start: _Start, opts: RunOptions,
    step_ready: Any = None,
):  # fmt: skip
    """Run the engine loop on the stage's program with this stage's checkpointer, state writer
    and trackers; its cadences and bad-step limit come from the stage's config table.
    `step_ready`: the event of the step's compile ahead (`engine.ahead`), if one was queued."""
    table = getattr(env.cfg, spec.name)
    step_fn = prog.jit()
    tracker = env.tracker(start.step)
    batches = start.batches
    examples = prog.examples_per_step
    is_text = env.target.output_kind == "logits"
    try:
        return Loop(
            stage=env.stage,
            step_fn=step_fn,
            state=start.state,
            frozen=start.frozen,
            total_steps=prog.total_steps,
            start_step=start.step,
            until=opts.until,
            checkpointer=env.checkpointer(),
            on_state=env.on_state,
            tracker=tracker,
            log_every=table.log_every,
            checkpoint_every=env.cfg.checkpoint.every,
            batches=batches,
            batches_state=batches_state(batches) if batches is not None else None,
            max_bad_steps=table.max_bad_steps,
            eval_fn=start.eval_fn,
            eval_every=getattr(table, "eval_every", 0),
            examples_per_step=examples,
            tokens_per_step=examples * env.target.n_tokens_per_example() if is_text else 0,
            lr_fn=prog.lr_fn,
            peak_flops=peak_flops(env.cfg),
            profile=opts.profile,
            profile_dir=env.project.profiles_dir / env.stage,
            meta=env.run_meta() if isinstance(env.project, Project) else {},
            eval_owed=start.eval_owed,
            compiled_ahead=step_ready,
        ).run()
    finally:
        tracker.finish()
        if batches is not None:
            batches.close()
