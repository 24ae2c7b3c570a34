"""`pdctl run` and `pdctl resume`: the stages as one pipeline."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from pdctl import registry
from pdctl.engine import ahead, runtime
from pdctl.engine.checkpoint import complete_steps
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.registry import STAGES, command
from pdctl.stages.policy import checkpoint_changes, guarded, resumable, stale_reason


def run_stage(project: Project, stage: str, **kwargs: Any) -> Any:
    """One stage, guarded: a clean stop on SIGTERM/SIGINT from its first instruction, `failed`
    and one line for any failure, its state put back after a user mistake."""
    with guarded(project, stage):
        return registry.stage(stage).load().run(project, **kwargs)


def plan(project: Project) -> list[tuple[str, str]]:
    """[(stage, "skip" | "run" | "resume" | "fresh")] for `pdctl run`, after checking every
    stage's config, so that a mistake in a later stage is found before anything is written.

    A stage with progress (interrupted, or crashed, with a checkpoint) that would have to
    start over is refused: `pdctl run` never drops a stage's progress silently."""
    check_configs(project)
    out: list[tuple[str, str]] = []
    rerun_downstream = False
    for stage in STAGES:
        st = project.stage(stage)
        stale = project.is_stale(stage)
        if stage == "pretrain" and project.config.target.kind == "hf":
            out.append((stage, "skip"))  # imported by init-weights, never trained here
            continue
        if project.is_done(stage) and not stale and not rerun_downstream:
            out.append((stage, "skip"))
            continue
        if stage == "init_weights":
            action = "run"
        elif resumable(project, stage) and not stale and not rerun_downstream:
            action = "resume"
        else:
            action = "fresh"
            latest = _progress(project, stage)
            if latest is not None:
                cli = command(stage)
                if not stale:
                    why, undo = "a stage before it runs again first", ""
                elif project.rerun_upstream(stage):
                    why, undo = stale_reason(project, stage), ""
                else:
                    changed = checkpoint_changes(project, stage, latest)
                    why = stale_reason(project, stage, changed)
                    undo = ", or restore the config and `pdctl run` continues it"
                raise PdctlError(
                    f"run: {stage} stopped at step {latest} ({st.get('status')}) and would have "
                    f"to start over ({why}); start it over with `pdctl {cli} --fresh`{undo}"
                )
        out.append((stage, action))
        rerun_downstream = True  # a stage that ran changes every stage after it
    return out


def _progress(project: Project, stage: str) -> int | None:
    """The step of an interrupted (or crashed) stage's latest checkpoint, if it has one."""
    if not resumable(project, stage):
        return None
    steps = complete_steps(project.checkpoint_dir(stage))
    return steps[-1] if steps else None


def check_configs(project: Project) -> None:
    """Every stage's config against the target and the mesh (site patterns, batch sizes that
    split over the devices and micro-batches, the text file): the checks a stage would make
    only once the stages before it had run."""
    from pdctl.engine import sharding
    from pdctl.stages.decomposition import decomposed_sites
    from pdctl.stages.inputs import check_tensor_parallel, target_from_config

    cfg = project.config
    mesh = sharding.mesh_from_config(cfg.mesh)
    target = target_from_config(cfg, project.root)
    check_tensor_parallel(target, mesh)
    decomposed_sites(cfg, target)
    if cfg.target.kind != "hf":  # an imported model is not pretrained
        sharding.check_batch_divides(
            cfg.pretrain.batch_size, mesh, "pretrain.batch_size", cfg.pretrain.grad_accum_steps
        )
    sharding.check_batch_divides(
        cfg.train.batch_size, mesh, "train.batch_size", cfg.train.grad_accum_steps
    )
    if target.output_kind == "logits" and cfg.data.path:
        path = (project.root / cfg.data.path).expanduser()
        if not path.exists():
            raise PdctlError(f"data.path: nothing at {path}")
    if target.kind == "hf" and cfg.data.eos_id is not None:
        _check_eos_id(cfg.data.eos_id, target)
    if cfg.train.init_from:  # the parent as train will read it (its metadata: no arrays)
        from pdctl.stages.decomposition import abstract_decomposition
        from pdctl.stages.init_from import check_parent

        dec = abstract_decomposition(cfg, target)
        check_parent(project.root, cfg, {"components": dec["components"], "ci_fns": dec["ci_fns"]})


def _check_eos_id(eos_id: int, target: Any) -> None:
    """`data.eos_id` is a token id of the imported model's embedding and of its tokenizer (its
    tokenizer.json, or a GGUF file's own), before any stage runs: train is the first stage to
    tokenize, after init-weights and warmup have run and saved."""
    vocab = target.spec.vocab_size
    if eos_id >= vocab:
        raise PdctlError(
            f"data.eos_id: {eos_id} is not a token id of the model in {target.spec.config_path} "
            f"(vocab_size {vocab})"
        )
    from pdctl.science import data
    from pdctl.science.targets import imported

    path = imported.tokenizer_path(target)
    if not path.is_file():
        return  # init-weights, the first stage, says so before it writes anything
    try:
        # The vocabulary's size: read with EOS 0 (an id of any tokenizer with one token), so
        # that only a tokenizer that does not load is an error here.
        size = data.corpus_tokenizer(path, 0).vocab_size
    except ValueError as e:
        raise PdctlError(f"target.path: {e}") from None
    if eos_id >= size:
        raise PdctlError(
            f"data.eos_id: {eos_id} is not a token id of the model's tokenizer {path} ({size} ids)"
        )


def run_all(project: Project, echo=print, until: int | None = None) -> dict[str, Any]:
    """init-weights → pretrain → warmup → train: skip stages that are done and not stale,
    continue an interrupted one, (re)run the rest. Everything is checked first. `until`: the
    train stage stops cleanly at that step of its schedule (`pdctl train --until`)."""
    results: dict[str, Any] = {}
    steps = plan(project)
    # One writer for the whole pipeline: no other pdctl can start between two stages.
    with project.locked() if runtime.is_writer() else contextlib.nullcontext():
        compile_ahead(project, steps)
        _run_planned(project, steps, results, echo, until)
    return results


def compile_ahead(project: Project, steps: list[tuple[str, str]]) -> None:
    """Queue, for the host thread that compiles ahead (`engine.ahead`), the steps of the stages
    that run after the first one that runs, into the compile cache, where each stage's own
    compile then finds them. A stage with nothing to do (warmup at `steps = 0`) has no program.
    The programs are built from the config alone (`StepProgram`), as each stage builds its own,
    so they are the same programs."""
    running = [s for s, action in steps if action != "skip"]
    if len(running) < 2 or not ahead.enabled(project.config.compile.ahead):
        return
    cfg = project.config

    def stepping(stage: str) -> Any:  # its SPEC if it compiles a step now, else None
        spec = getattr(registry.stage(stage).load(), "SPEC", None)
        if spec is None or (spec.idle is not None and spec.idle(cfg) is not None):
            return None
        return spec

    # Held back until the stage that runs first has queued its own step (it compiles that
    # first: a job already compiling cannot be overtaken), or has ended (`_run_planned`).
    queue_job = ahead.hold if stepping(running[0]) is not None else ahead.submit
    for stage in running[1:]:
        spec = stepping(stage)
        if spec is not None:
            queue_job(stage, functools.partial(_compile_step, project, spec), STAGES.index(stage))


def _compile_step(project: Project, spec: Any) -> None:
    """`spec`'s step into the compile cache, through a jit of its own: nothing of it (the
    program, its executable) stays in this process, on the devices, while earlier stages run."""
    from pdctl.engine import sharding
    from pdctl.stages.inputs import target_from_config

    cfg = project.config
    with ahead.TRACING:
        mesh = sharding.mesh_from_config(cfg.mesh)
        prog = spec.program(cfg, mesh, target_from_config(cfg, project.root))
        lowered = prog.lower(cached=False)
    del prog
    lowered.compile()


# How `run_stage` carries out an action of `plan` ("run": no arguments).
ACTION_KWARGS: dict[str, dict[str, bool]] = {"resume": {"resume": True}, "fresh": {"fresh": True}}


def _run_planned(
    project: Project, steps, results: dict[str, Any], echo, until: int | None = None
) -> None:
    previous = None
    for stage, action in steps:
        if action == "skip":
            echo(f"{stage}: {project.stage(stage).get('status', 'imported')}, skipped")
            continue
        signum = runtime.stop_requested()
        if signum is not None and previous is not None:  # it came as the last stage finished
            import signal

            from pdctl.engine.loop import Interrupted

            raise Interrupted(
                f"run: stopped by {signal.Signals(signum).name} after {previous} finished "
                f"(done); `pdctl run` continues with {stage}"
            )
        previous = stage
        if action == "resume":
            echo(f"{stage}: resuming from its latest checkpoint")
        kwargs: dict[str, bool | int] = dict(ACTION_KWARGS.get(action, {}))
        if stage == "train" and until is not None:
            kwargs["until"] = until
        try:
            results[stage] = host_side(run_stage(project, stage, **kwargs))
        finally:
            # Nothing of a stage stays on the devices for the next one (its state, the arrays
            # its result carried, its compiled programs and their reservations): each stage
            # of `pdctl run` fits where it fits alone (issue 49).
            runtime.release_device_memory()
            ahead.release()  # the later stages' compiles, if the stage queued none of its own
        echo(
            f"{stage}: {project.stage(stage).get('status')} at step "
            f"{project.stage(stage).get('step')}"
        )


def host_side(result: Any) -> Any:
    """A stage's result with its device arrays dropped (init-weights' `items`, a training
    stage's final `state`): what `pdctl run` keeps of a stage once the next one starts."""
    import dataclasses

    import jax

    def on_device(v: Any) -> bool:
        return any(isinstance(x, jax.Array) for x in jax.tree.leaves(v))

    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        fields = dataclasses.fields(result)
        return dataclasses.replace(
            result, **{f.name: None for f in fields if on_device(getattr(result, f.name))}
        )
    if isinstance(result, dict):
        return {k: v for k, v in result.items() if not on_device(v)}
    return result


def resume(project: Project, until: int | None = None) -> tuple[str, Any]:
    for stage in STAGES[1:]:
        if resumable(project, stage):
            kwargs = {"until": until} if until is not None and stage == "train" else {}
            return stage, run_stage(project, stage, resume=True, **kwargs)
    raise PdctlError(
        "nothing to resume: no stage is interrupted (see `pdctl status`); "
        "start one with `pdctl run`"
    )


def summary(project: Project) -> str:
    ev = project.stage("train").get("eval") or {}
    if "ci_errors" in ev:
        n = getattr(project.config.target, "n_features", 0)
        k = int(ev.get("recovered", 0))
        e = int(ev["ci_errors"].get("total", 0))
        mmcs = ev.get("mmcs") or {}
        mm = f", MMCS {min(mmcs.values()):.4f}" if mmcs else ""
        return f"recovered {k}/{n} features, CI errors {e}{mm}"
    parts = [
        f"{k} {v:.4g}"
        for k, v in ev.items()
        if k.startswith(("ce_", "kl_")) and isinstance(v, float)
    ]
    return "eval: " + ", ".join(parts) if parts else "train: no evaluation recorded"
