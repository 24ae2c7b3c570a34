"""`[train] init_from`: a train run that starts from another run's final decomposition."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import cli_fails, cli_ok, edit_config, make_run, state

from pdctl.engine import sharding
from pdctl.engine.checkpoint import complete_steps, read_host
from pdctl.project import Project
from pdctl.stages import train
from pdctl.stages.common import StageEnv, target_from_config

RUN = {"warmup": {"steps": 4}, "train": {"steps": 6, "batch_size": 32, "eval_every": 6}}


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny TMS run with every stage done."""
    run = make_run(tmp_path_factory.mktemp("init-from"), "tms", "parent", **RUN)
    cli_ok("--project", run, "run")
    return run


def _child(parent: Path, tmp_path: Path, **overrides) -> Path:
    """A copy of the parent (same target, its stages done) whose train starts from the parent."""
    child = tmp_path / "child"
    shutil.copytree(parent, child)
    edit_config(child, {"train": {"init_from": str(parent), **overrides}})
    return child


def test_fresh_inputs_are_the_parents_final_decomposition(parent: Path, tmp_path: Path) -> None:
    child = _child(parent, tmp_path)
    proj = Project.load(child / "pdctl.toml")
    mesh = sharding.make_mesh(1, 4)  # another mesh than the parent's: resharded on the way in
    env = StageEnv(proj, "train", mesh, target_from_config(proj.config))
    prog = train.program(proj.config, mesh, env.target)
    components, ci_fns, sources = train.fresh_inputs(env, prog)

    directory = Project.load(parent / "pdctl.toml").checkpoint_dir("train")
    last = complete_steps(directory)[-1]
    want = read_host(directory, last, "trainable")
    got = jax.device_get({"components": components, "ci_fns": ci_fns})
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit: nothing recomputed
    V = components["linear1"]["V"]
    assert V.sharding == prog.state_shardings["trainable"]["components"]["linear1"]["V"]
    # fresh sources: this run's init-weights', not the parent's trained ones
    init = read_host(proj.checkpoint_dir("init_weights"), 0, "sources")
    for a, b in zip(jax.tree.leaves(jax.device_get(sources)), jax.tree.leaves(init), strict=True):
        np.testing.assert_array_equal(a, b)
    assert proj.stage("train")["init_from"] == {"run": str(parent), "step": last}


def test_train_from_a_parent_end_to_end(parent: Path, tmp_path: Path) -> None:
    """`pdctl train --fresh` with init_from: a new run of 6 steps from the parent's final
    decomposition (its first loss is the parent's last step's regime, not a fresh init's)."""
    child = _child(parent, tmp_path, loss={"importance_minimality": 2e-3})
    cli_ok("--project", child, "train", "--fresh")
    st = state(child, "train")
    assert st["status"] == "done" and st["step"] == 6
    assert st["init_from"]["run"] == str(parent)
    assert st["run_id"] != state(parent, "train")["run_id"]


def test_init_from_errors_are_one_line(parent: Path, tmp_path: Path) -> None:
    # a different C: the structure check names the leaf and both shapes
    child = _child(parent, tmp_path)
    edit_config(child, {"decomp": {"sites": [{"pattern": "linear1", "C": 6},
                                             {"pattern": "linear2", "C": 6}]}})  # fmt: skip
    line = cli_fails(2, "--project", child, "run")  # init-weights and warmup run again first
    assert "train.init_from: components.linear1.U is (4, 2)" in line and "(6, 2) here" in line
    assert state(child, "train")["status"] != "running"
    # nothing there / not a run / no train checkpoint
    for bad, says in (
        (tmp_path / "nowhere", "not a pdctl run directory"),
        (child, "this run itself"),
    ):
        edit_config(child, {"train": {"init_from": str(bad)}})
        line = cli_fails(2, "--project", child, "run")
        assert "train.init_from" in line and says in line, line
    fresh = make_run(tmp_path, "tms", "untrained")
    edit_config(child, {"train": {"init_from": str(fresh)}})
    line = cli_fails(2, "--project", child, "run")
    assert "has no train checkpoint" in line, line
