"""`pdctl export`: a finished stage's arrays as one .npz or .safetensors file, read from its
latest checkpoint on the host (any device count)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdctl import __version__, registry
from pdctl.engine.checkpoint import complete_steps, has_key, read_host
from pdctl.engine.sharding import path_str
from pdctl.errors import PdctlError
from pdctl.files import atomic_output
from pdctl.project import Project
from pdctl.registry import STAGES, command
from pdctl.science.spd.stacked import per_site_tree
from pdctl.stages.decomposition import warmup_components, warmup_kept_init
from pdctl.stages.policy import how_to_finish

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
    if stage == "warmup" and warmup_kept_init(project):  # steps = 0: init-weights' components
        try:
            arrays.update(_flat({"components": warmup_components(project)}))
        except LookupError as e:
            raise PdctlError(f"export: {e}") from None
    else:
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
                # numpy's stub matches **arrays against savez's `allow_pickle: bool` keyword
                np.savez(tmp, **arrays)  # type: ignore[arg-type]
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
    from pdctl.stages.inputs import target_from_config

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
    return _flat(items, rename)


def _flat(items: dict[str, Any], rename: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Items as flat `item.path -> array` entries, an item's prefix renamed by `rename`."""
    rename = rename or {}
    flat = {}
    for name, tree in items.items():
        prefix = rename.get(name, name)
        for p, x in jax.tree_util.tree_leaves_with_path(tree):
            key = ".".join(s for s in (prefix, path_str(p)) if s)
            flat[key] = np.asarray(x)
    return flat
