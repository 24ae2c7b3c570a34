"""`pdctl run`, `pdctl resume` and `pdctl export`: the stages as one pipeline."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdctl import __version__
from pdctl.engine import runtime
from pdctl.engine.checkpoint import complete_steps, has_key, read_host
from pdctl.engine.sharding import path_str
from pdctl.errors import PdctlError
from pdctl.files import atomic_output
from pdctl.project import Project
from pdctl.science.spd.stacked import per_site_tree
from pdctl.stages import registry
from pdctl.stages.common import checkpoint_changes, guarded, stale_reason
from pdctl.stages.registry import STAGES, command


def resumable(project: Project, stage: str) -> bool:
    """Interrupted, `running` with nobody holding the lock (a crash), or `failed` because a
    process of its run was lost (`lost_process`: nothing was wrong with the stage itself)."""
    st = project.stage(stage)
    status = st.get("status")
    if status == "failed":
        return st.get("lost_process") is not None
    return status == "interrupted" or (status == "running" and project.lock_is_free())


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
    from pdctl.stages.common import check_tensor_parallel, target_from_config
    from pdctl.stages.init_weights import decomposed_sites

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
        from pdctl.stages.init_from import check_parent
        from pdctl.stages.warmup import abstract_decomposition

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


def run_all(project: Project, echo=print) -> dict[str, Any]:
    """init-weights → pretrain → warmup → train: skip stages that are done and not stale,
    continue an interrupted one, (re)run the rest. Everything is checked first."""
    results: dict[str, Any] = {}
    steps = plan(project)
    # One writer for the whole pipeline: no other pdctl can start between two stages.
    with project.locked() if runtime.is_writer() else contextlib.nullcontext():
        _run_planned(project, steps, results, echo)
    return results


# How `run_stage` carries out an action of `plan` ("run": no arguments).
ACTION_KWARGS: dict[str, dict[str, bool]] = {"resume": {"resume": True}, "fresh": {"fresh": True}}


def _run_planned(project: Project, steps, results: dict[str, Any], echo) -> None:
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
        results[stage] = run_stage(project, stage, **ACTION_KWARGS.get(action, {}))
        echo(
            f"{stage}: {project.stage(stage).get('status')} at step "
            f"{project.stage(stage).get('step')}"
        )


def resume(project: Project) -> tuple[str, Any]:
    for stage in STAGES[1:]:
        if resumable(project, stage):
            return stage, run_stage(project, stage, resume=True)
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


EXPORT_FORMATS = ("npz", "safetensors")


def export(
    project: Project, stage: str | None, out: Path, fmt: str | None = None
) -> dict[str, tuple[int, ...]]:
    """Write the stage's final arrays as flat `path -> array` entries: an .npz file, or a
    .safetensors file whose components are named by their site (`model.layers.1.mlp.down_proj.V`)
    with a `metadata` entry holding the config fingerprints. Tied components (TMS linear2) are
    written out as the transposes they are; an imported model's own weights are not copied."""
    fmt = fmt or (out.suffix.lstrip(".") if out.suffix in (".npz", ".safetensors") else None)
    if fmt not in EXPORT_FORMATS:
        raise PdctlError(
            f"--format: {fmt!r} is not one of {', '.join(EXPORT_FORMATS)} "
            "(or name the --out file .npz or .safetensors)"
        )
    if stage is None:
        stage = _default_export_stage(project)
    if stage not in STAGES:
        raise PdctlError(f"--stage: unknown stage {stage!r} (choose from {', '.join(STAGES)})")
    imported = project.stage("pretrain").get("status") == "imported"
    if stage == "pretrain" and imported:
        raise PdctlError(
            "--stage: pretrain of an imported model has no arrays of its own; its weights are "
            f"at {project.stage('pretrain').get('source')}"
        )
    if not project.is_done(stage):
        from pdctl.stages.common import how_to_finish

        status = project.stage(stage).get("status", "pending")
        raise PdctlError(f"--stage: {stage} is {status}, not done; {how_to_finish(project, stage)}")
    if out.suffix != f".{fmt}":
        raise PdctlError(f"--out: {out} must end in .{fmt}")
    try:
        if out.is_dir():
            raise PdctlError(f"--out: {out} is a directory; name a file, e.g. {out / 'arrays.npz'}")
        for parent in out.absolute().parents:
            if parent.exists():
                if not parent.is_dir():
                    raise PdctlError(f"--out: {parent} is a file, not a directory")
                break
    except OSError as e:
        raise PdctlError(f"--out: cannot write {out} ({e.strerror or e})") from None
    arrays: dict[str, np.ndarray] = {}
    if stage in ("warmup", "train") and not imported:  # the target they decomposed
        arrays.update(_load(project, "pretrain", ("params",), rename={"params": "target"}))
    items = registry.stage(stage).exports
    if imported:
        items = tuple(i for i in items if i != "target")
    if stage == "train" and not _has_latest(project, stage, "sources"):
        # a train checkpoint copied without its `training` item: the decomposition alone
        items = tuple(i for i in items if i != "sources")
    arrays.update(_load(project, stage, items, rename={"params": "target", "trainable": ""}))
    if stage == "warmup":  # warmup trains V/U only: its CI functions and sources are init's
        arrays.update(_load(project, "init_weights", ("ci_fns", "sources")))
    _expand_tied(project, arrays)
    _write_export(project, stage, arrays, out, fmt)
    return {k: tuple(v.shape) for k, v in arrays.items()}


def _default_export_stage(project: Project) -> str:
    """The last stage that has run, which must be done: after a failed or interrupted train,
    exporting warmup's arrays instead would pass off the wrong stage as the result."""
    ran = [s for s in STAGES if project.stage(s).get("status", "pending") != "pending"]
    ran = [s for s in ran if project.stage(s).get("status") != "imported"]
    if not ran:
        raise PdctlError("export: no stage is done yet; run `pdctl run` first")
    stage = ran[-1]
    if project.is_done(stage):
        return stage
    from pdctl.stages.common import how_to_finish

    status = project.stage(stage).get("status")
    done = [s for s in ran if project.is_done(s)]
    if not done:
        raise PdctlError(
            f"export: no stage is done yet ({stage}, the last stage run, is {status}); "
            f"{how_to_finish(project, stage)}"
        )
    # Which stage to name is the user's choice (warmup's arrays are not train's result), so
    # the line leads with the flag that exports the last finished one.
    raise PdctlError(
        f"--stage: not given, and {stage}, the last stage run, is {status}: pass `--stage "
        f"{done[-1]}` to export the last stage that is done, or finish {stage} first "
        f"({how_to_finish(project, stage)})"
    )


def _write_export(
    project: Project, stage: str, arrays: dict[str, np.ndarray], out: Path, fmt: str
) -> None:
    """Write `out` whole or not at all: through a temporary file renamed into place, and the
    directories made for it removed again when the write fails."""
    made = [p for p in out.absolute().parents if not p.exists()]  # deepest first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # never a half-written file under the name asked for
        with atomic_output(out, suffix=out.suffix) as tmp:
            if fmt == "npz":
                np.savez(tmp, **arrays)
            else:
                _save_safetensors(project, stage, arrays, tmp)
    except (OSError, _SafetensorIOError) as e:
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise PdctlError(f"--out: cannot write {out} ({reason})") from None


class _SafetensorIOError(Exception):
    """safetensors' writer failing on the file system (it raises its own error type)."""


def _expand_tied(project: Project, arrays: dict[str, np.ndarray]) -> None:
    """Add the tied sites' components (their source's transposes), so an export shows every
    decomposed site."""
    from pdctl.science.spd.components import component_ties
    from pdctl.stages.common import target_from_config

    sites = project.stage("init_weights").get("sites") or {}
    if not isinstance(sites, dict) or not all(
        isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in sites.values()
    ):
        raise PdctlError(
            f"state.init_weights.sites: must be a table of site = C (components, an integer "
            f"> 0), got {str(sites)[:60]} ([state.*] is written by pdctl: restore it, or "
            "delete [state.init_weights] and rerun the stage)"
        )
    ties = component_ties(target_from_config(project.config, project.root).tied_sites(), sites)
    for tied, src in ties.items():
        for mine, theirs in (("V", "U"), ("U", "V")):
            key = f"components.{src}.{theirs}"
            if key in arrays:
                arrays[f"components.{tied}.{mine}"] = np.ascontiguousarray(arrays[key].T)


def _save_safetensors(
    project: Project, stage: str, arrays: dict[str, np.ndarray], path: Path
) -> None:
    import json

    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    named = {k.removeprefix("components."): np.ascontiguousarray(v) for k, v in arrays.items()}
    meta = {
        "stage": stage,
        "fingerprint": json.dumps({s: project.stage(s).get("fingerprint") for s in STAGES}),
        "pdctl_version": __version__,
    }
    try:
        save_file(named, str(path), metadata=meta)
    except SafetensorError as e:  # "Error while serializing: I/O error: <why> (os error N) ..."
        msg = " ".join(str(e).split())
        why = msg.split("I/O error: ", 1)[-1].split(" (os error")[0] if "I/O error" in msg else msg
        raise _SafetensorIOError(why[:160]) from None


def _has_latest(project: Project, stage: str, name: str) -> bool:
    directory = project.checkpoint_dir(stage)
    steps = complete_steps(directory)
    return bool(steps) and has_key(directory, steps[-1], name)


def _load(
    project: Project, stage: str, names, rename: dict[str, str] | None = None
) -> dict[str, np.ndarray]:
    """The stage's latest checkpoint's items `names` as flat `item.path -> array` entries, an
    item's prefix renamed by `rename` ("" drops it)."""
    rename = rename or {}
    # Read-only and as host arrays: no CheckpointManager (opening one cleans up an in-flight
    # save), and no shardings, so a run trained on N devices exports on any device count.
    directory = project.checkpoint_dir(stage)
    steps = complete_steps(directory)
    if not steps:
        raise PdctlError(f"{stage} has no checkpoint in {directory}")
    step = steps[-1]
    try:
        # a train state's stacked sites come out per site (`science.spd.stacked`)
        items = {name: per_site_tree(read_host(directory, step, name)) for name in names}
    except Exception as e:  # truncated or missing files: orbax/tensorstore errors of all kinds
        reason = " ".join(str(e).split())[:160] or type(e).__name__
        raise PdctlError(
            f"{stage}'s checkpoint {step} does not restore ({type(e).__name__}: {reason}); "
            f"rerun `pdctl {command(stage)} --fresh`"
        ) from None
    flat = {}
    for name, tree in items.items():
        prefix = rename.get(name, name)
        for p, x in jax.tree_util.tree_leaves_with_path(tree):
            key = ".".join(s for s in (prefix, path_str(p)) if s)
            flat[key] = np.asarray(x)
    return flat
