"""`[train] init_from`: a new decomposition that starts from another run's final one.

The parent's train checkpoint is split by item: `trainable` is the decomposition (V / U and the
CI functions); `opt_state`, `sources`, `src_opt` and `loop` are training state. Only the
decomposition is read, as host arrays without opening a checkpoint manager (nothing in the
parent run directory is written or cleaned up), checked leaf by leaf against this run's
structure, and placed into this run's shardings. The optimizer state, the PPGD sources and the
step counter start fresh, so this is a new train run that happens to begin where the parent
ended (a fine-tune on other data, with other loss coefficients or a longer schedule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdctl.engine import sharding
from pdctl.engine.checkpoint import complete_steps, read_host
from pdctl.errors import PdctlError
from pdctl.science.spd.stacked import per_site_tree

ITEM = "trainable"  # the decomposition item of a train checkpoint


def parent_checkpoint(root: Path, init_from: str) -> tuple[Path, Path, int]:
    """The parent run, its train checkpoint directory and newest complete step; a one-line
    error naming `train.init_from` when there is none."""
    from pdctl.project import Project
    from pdctl.stages.common import resolve

    run = resolve(root, init_from)
    toml = run / "pdctl.toml"
    if not toml.is_file():
        raise PdctlError(f"train.init_from: {run} is not a pdctl run directory (no pdctl.toml)")
    if run.resolve() == root.resolve():
        raise PdctlError("train.init_from: names this run itself; give another run's directory")
    directory = Project.load(toml).checkpoint_dir("train")
    steps = complete_steps(directory)
    if not steps:
        raise PdctlError(
            f"train.init_from: {run} has no train checkpoint (run `pdctl train` there first)"
        )
    return run, directory, steps[-1]


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


def parent_decomposition(root: Path, init_from: str, abstract: Any, shardings: Any):
    """The parent's final decomposition as this run's sharded arrays (this run's dtypes), and
    where it came from ({"run", "step"}) for `[state.train]`."""
    run, directory, step = parent_checkpoint(root, init_from)
    where = f"{run} (train checkpoint {step})"
    try:
        host = per_site_tree(read_host(directory, step, ITEM))  # stacked sites split
    except Exception as e:  # orbax/tensorstore raise many kinds; all mean "unreadable"
        from pdctl.stages.common import _one_line

        raise PdctlError(f"train.init_from: {where} does not restore ({_one_line(e)})") from None
    check_structure(host, abstract, where)
    cast = jax.tree.map(lambda x, a: np.asarray(x, dtype=a.dtype), host, abstract)
    arrays = jax.device_put(cast, shardings)
    return arrays, {"run": str(run), "step": step}
