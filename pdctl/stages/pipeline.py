"""`pdctl run`, `pdctl resume` and `pdctl export`: the stages as one pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdctl.config import STAGES
from pdctl.engine.checkpoint import Checkpointer
from pdctl.engine.sharding import path_str
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.stages.common import CLI_NAME


def _stage_module(stage: str):
    from pdctl.stages import init_weights, pretrain, train, warmup

    return {"init_weights": init_weights, "pretrain": pretrain, "warmup": warmup, "train": train}[
        stage
    ]


def resumable(project: Project, stage: str) -> bool:
    """Interrupted, or `running` with nobody holding the lock (a crash)."""
    status = project.stage(stage).get("status")
    return status == "interrupted" or (status == "running" and project.lock_is_free())


def run_all(project: Project, echo=print) -> dict[str, Any]:
    """init-weights → pretrain → warmup → train: skip stages that are done and not stale,
    continue an interrupted one, (re)run the rest."""
    results: dict[str, Any] = {}
    rerun_downstream = False
    for stage in STAGES:
        st = project.stage(stage)
        done = st.get("status") == "done" and not project.is_stale(stage)
        if done and not rerun_downstream:
            echo(f"{stage}: done, skipped")
            continue
        mod = _stage_module(stage)
        if stage == "init_weights":
            results[stage] = mod.run(project)
        elif resumable(project, stage) and not project.is_stale(stage) and not rerun_downstream:
            echo(f"{stage}: resuming from its latest checkpoint")
            results[stage] = mod.run(project, resume=True)
        else:
            results[stage] = mod.run(project, fresh=True)
        rerun_downstream = True  # a stage that ran changes every stage after it
        echo(
            f"{stage}: {project.stage(stage).get('status')} at step "
            f"{project.stage(stage).get('step')}"
        )
    return results


def resume(project: Project) -> tuple[str, Any]:
    for stage in STAGES[1:]:
        if resumable(project, stage):
            return stage, _stage_module(stage).run(project, resume=True)
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


_EXPORT_ITEMS = {
    "init_weights": ("target", "components", "ci_fns", "sources"),
    "pretrain": ("params",),
    "warmup": ("components",),
    "train": ("trainable", "sources"),
}


def export(project: Project, stage: str | None, out: Path) -> dict[str, tuple[int, ...]]:
    """Write the stage's final arrays as flat `path -> array` entries of an .npz file."""
    if stage is None:
        done = [s for s in STAGES if project.is_done(s)]
        if not done:
            raise PdctlError("export: no stage is done yet; run `pdctl run` first")
        stage = done[-1]
    if stage not in STAGES:
        raise PdctlError(f"--stage: unknown stage {stage!r} (choose from {', '.join(STAGES)})")
    if not project.is_done(stage):
        raise PdctlError(f"--stage: {stage} is not done; run `pdctl {CLI_NAME[stage]}` first")
    if out.suffix != ".npz":
        raise PdctlError(f"--out: {out} must end in .npz")
    arrays: dict[str, np.ndarray] = {}
    if stage in ("warmup", "train"):  # the target they decomposed
        arrays.update(_load(project, "pretrain", ("params",), rename={"params": "target"}))
    arrays.update(
        _load(project, stage, _EXPORT_ITEMS[stage], rename={"params": "target", "trainable": ""})
    )
    if stage == "warmup":
        arrays.update(_load(project, "init_weights", ("ci_fns", "sources")))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **arrays)
    return {k: tuple(v.shape) for k, v in arrays.items()}


def _load(project: Project, stage: str, names, rename) -> dict[str, np.ndarray]:
    ckpt = Checkpointer(project.checkpoint_dir(stage), keep=project.config.checkpoint.keep)
    step = ckpt.latest_step()
    if step is None:
        raise PdctlError(f"{stage} has no checkpoint in {ckpt.directory}")
    items = ckpt.restore_host(step, list(names))
    ckpt.close()
    flat = {}
    for name, tree in items.items():
        prefix = rename.get(name, name)
        for p, x in jax.tree_util.tree_leaves_with_path(tree):
            key = ".".join(s for s in (prefix, path_str(p)) if s)
            flat[key] = np.asarray(x)
    return flat
