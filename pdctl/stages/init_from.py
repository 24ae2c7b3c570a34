"""`[train] init_from`: a new decomposition that starts from another run's final one.

The parent's train checkpoint is split by item: `trainable` is the decomposition (V / U and the
CI functions); `opt_state`, `sources`, `src_opt` and `loop` are training state. Only the
decomposition is read, as host arrays without opening a checkpoint manager (nothing in the
parent run directory is written or cleaned up), checked leaf by leaf against this run's
structure, and placed into this run's shardings. The optimizer state, the PPGD sources and the
step counter start fresh, so this is a new train run that happens to begin where the parent
ended (a fine-tune on other data, with other loss coefficients or a longer schedule).

The parent is checked before any stage runs (`pipeline.check_configs` calls `check_parent`):
its pdctl.toml loads, its train is done (or `init_from_step` names one of its checkpoints),
and that checkpoint's decomposition has this run's structure (from its metadata: no array is
read). The parent's train run id goes into `[state.train] upstream`, so a rerun of the parent
makes this train stale, as a rerun of warmup does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdctl.engine import sharding
from pdctl.engine.checkpoint import complete_steps, item_tree, read_host
from pdctl.errors import PdctlError
from pdctl.science.spd.stacked import per_site_tree

ITEM = "trainable"  # the decomposition item of a train checkpoint
UPSTREAM_KEY = "init_from"  # the parent's train run id, in [state.train] upstream


@dataclass(frozen=True)
class Parent:
    run: Path  # the parent run directory
    directory: Path  # its train checkpoints
    step: int  # the checkpoint this train starts from
    run_id: str | None  # the parent train's run id

    @property
    def where(self) -> str:
        return f"{self.run} (train checkpoint {self.step})"

    def origin(self) -> dict[str, Any]:
        """What `[state.train] init_from` records."""
        return {"run": str(self.run), "step": self.step, "run_id": self.run_id}


def parent_checkpoint(root: Path, init_from: str, at_step: int | None = None) -> Parent:
    """The parent run and the train checkpoint this run starts from: its final one when its
    train is done, or `at_step` (`train.init_from_step`); a one-line error naming the key
    otherwise."""
    from pdctl.project import Project
    from pdctl.stages.inputs import resolve

    run = resolve(root, init_from)
    toml = run / "pdctl.toml"
    if not toml.is_file():
        raise PdctlError(f"train.init_from: {run} is not a pdctl run directory (no pdctl.toml)")
    if run.resolve() == root.resolve():
        raise PdctlError("train.init_from: names this run itself; give another run's directory")
    try:
        parent = Project.load(toml)
    except PdctlError as e:
        raise PdctlError(f"train.init_from: {toml} does not load ({e})") from None
    st = parent.stage("train")
    directory = parent.checkpoint_dir("train")
    steps = complete_steps(directory)
    if not steps:
        raise PdctlError(
            f"train.init_from: {run} has no train checkpoint (run `pdctl train` there first)"
        )
    if at_step is None:
        status = st.get("status", "pending")
        if status != "done":
            raise PdctlError(
                f"train.init_from: {run}'s train is {status} at step {st.get('step')} of "
                f"{st.get('steps')}, not done; finish it there, or start from one of its "
                f"checkpoints (steps {', '.join(map(str, steps[-5:]))}) with "
                "train.init_from_step"
            )
        step = steps[-1]
    else:
        if at_step not in steps:
            raise PdctlError(
                f"train.init_from_step: {run} has no complete train checkpoint at step "
                f"{at_step} (it has steps {', '.join(map(str, steps[-5:]))})"
            )
        step = at_step
    return Parent(run, directory, step, st.get("run_id"))


def _shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def check_structure(parent: Any, abstract: Any, where: str) -> None:
    """The parent's decomposition has exactly this run's leaves and shapes."""
    leaves = jax.tree_util.tree_leaves_with_path
    got = {sharding.path_str(p): _shape_of(x) for p, x in leaves(parent)}
    want = {sharding.path_str(p): _shape_of(x) for p, x in leaves(abstract)}
    # components first: a different C shows as V's shape, the clearest message
    for path, shape in sorted(want.items(), key=lambda kv: (not kv[0].startswith("comp"), kv[0])):
        if path not in got:
            raise PdctlError(
                f"train.init_from: {where} has no {path} (its decomposed sites or CI function "
                f"differ from this run's [decomp])"
            )
        if got[path] != shape:
            raise PdctlError(
                f"train.init_from: {path} is {got[path]} in {where} but {shape} here (a "
                f"different C, CI function or model)"
            )
    extra = sorted(set(got) - set(want))
    if extra:
        raise PdctlError(
            f"train.init_from: {where} decomposes more than this run ({extra[0]}); use the same "
            f"[decomp] sites"
        )


def check_parent(root: Path, cfg: Any, abstract: Any) -> Parent:
    """Everything about the parent that can be checked before any stage runs: the checkpoint
    (`parent_checkpoint`) and its decomposition's structure against `abstract` (this run's,
    per site), from the checkpoint's metadata alone."""
    parent = parent_checkpoint(root, cfg.train.init_from, cfg.train.init_from_step)
    try:
        tree = item_tree(parent.directory, parent.step, ITEM)
        # shapes only: each leaf a zero-strided view, so stacked sites split as arrays do
        shapes = jax.tree.map(
            lambda m: np.broadcast_to(np.zeros((), np.float32), tuple(m.shape)), tree
        )
        shapes = per_site_tree(shapes)
    except Exception as e:  # orbax raises many kinds; all mean "unreadable"
        from pdctl.errors import one_line

        raise PdctlError(
            f"train.init_from: {parent.where} does not restore ({one_line(e)})"
        ) from None
    check_structure(shapes, abstract, parent.where)
    return parent


def parent_decomposition(root: Path, cfg: Any, abstract: Any, shardings: Any):
    """The parent's decomposition (its final one, or at `init_from_step`) as this run's sharded
    arrays (this run's dtypes), and the `Parent` it came from."""
    parent = parent_checkpoint(root, cfg.train.init_from, cfg.train.init_from_step)
    where = parent.where
    try:
        host = per_site_tree(read_host(parent.directory, parent.step, ITEM))  # stacked split
    except Exception as e:  # orbax/tensorstore raise many kinds; all mean "unreadable"
        from pdctl.errors import one_line

        raise PdctlError(f"train.init_from: {where} does not restore ({one_line(e)})") from None
    check_structure(host, abstract, where)
    bad = [
        sharding.path_str(p)
        for p, x in jax.tree_util.tree_leaves_with_path(host)
        if np.issubdtype(np.asarray(x).dtype, np.inexact) and not np.isfinite(x).all()
    ]
    if bad:  # a train saves only finite states: this one was altered
        raise PdctlError(f"train.init_from: {where} holds non-finite values ({bad[0]})")
    cast = jax.tree.map(lambda x, a: np.asarray(x, dtype=a.dtype), host, abstract)
    arrays = jax.device_put(cast, shardings)
    return arrays, parent
