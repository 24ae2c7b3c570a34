"""`[train] init_from`: a train run that starts from another run's final decomposition."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import TINY, cli_fails, cli_ok, edit_config, make_run, state

from pdctl.engine import sharding
from pdctl.engine.checkpoint import complete_steps, read_host
from pdctl.project import Project
from pdctl.stages import train
from pdctl.stages.env import StageEnv
from pdctl.stages.inputs import target_from_config

RUN = {"warmup": {"steps": 4}, "train": {"steps": 6, "batch_size": 32, "eval_every": 6}}
TINY_SITES = TINY["tms"]["decomp"]


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


@pytest.mark.slow
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
    parent_rid = state(parent, "train")["run_id"]
    assert proj.stage("train")["init_from"] == {"run": str(parent), "step": last,
                                                "run_id": parent_rid}  # fmt: skip
    assert proj.stage("train")["upstream"]["init_from"] == parent_rid  # a parent rerun: stale


@pytest.mark.slow
def test_train_from_a_parent_end_to_end(parent: Path, tmp_path: Path) -> None:
    """`pdctl train --fresh` with init_from: a new run of 6 steps from the parent's final
    decomposition (its first loss is the parent's last step's regime, not a fresh init's)."""
    child = _child(parent, tmp_path, loss={"importance_minimality": 2e-3})
    cli_ok("--project", child, "train", "--fresh")
    st = state(child, "train")
    assert st["status"] == "done" and st["step"] == 6
    assert st["init_from"]["run"] == str(parent)
    assert st["run_id"] != state(parent, "train")["run_id"]


@pytest.mark.slow
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


# ---- the parent checked first, done, and upstream of the child --------------------------------
# A parent made without training (its train checkpoints written directly, zeros of the right
# shapes), so that these run in the fast tier.


def _fake_parent(root: Path, status: str = "done", steps: tuple[int, ...] = (3, 6)) -> Path:
    from pdctl.engine.checkpoint import Checkpointer
    from pdctl.stages.decomposition import abstract_decomposition

    run = make_run(root, "tms", "parent", **RUN)
    proj = Project.load(run / "pdctl.toml")
    dec = abstract_decomposition(proj.config, target_from_config(proj.config))
    trainable = {k: jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), dec[k])
                 for k in ("components", "ci_fns")}  # fmt: skip
    ckpt = Checkpointer(proj.checkpoint_dir("train"), keep=10, async_save=False)
    for step in steps:
        ckpt.save(step, {"trainable": trainable}, {"step": step, "run_id": "parentrun1"})
    ckpt.close()
    proj.update_stage("train", status=status, step=steps[-1], steps=6, run_id="parentrun1",
                      checkpoint=steps[-1])  # fmt: skip
    return run


def _fresh_child(root: Path, parent: Path, **train) -> Path:
    """A new run (nothing run yet) whose train starts from `parent`."""
    return make_run(root, "tms", "child", **{**RUN, "train": {**RUN["train"],
                    "init_from": str(parent), **train}})  # fmt: skip


def _untouched(run: Path) -> bool:
    return sorted(p.name for p in run.iterdir()) == ["README.md", "pdctl.toml"] and not (
        Project.load(run / "pdctl.toml").state
    )


@pytest.mark.parametrize("status", ["interrupted", "failed", "running"])
def test_7_a_parent_whose_train_is_not_done_is_refused_unless_a_step_is_named(
    tmp_path: Path, status: str
) -> None:
    """It used to start silently from the partial decomposition (step 5 of 10)."""
    from pdctl.stages.init_from import parent_checkpoint

    parent = _fake_parent(tmp_path, status=status)
    child = _fresh_child(tmp_path, parent)
    line = cli_fails(2, "--project", child, "run")
    assert f"train.init_from: {parent}'s train is {status} at step 6 of 6, not done" in line
    assert "train.init_from_step" in line and _untouched(child), line
    # an explicit step is accepted (and is what train records); one with no checkpoint is not
    assert parent_checkpoint(child, str(parent), 3).step == 3
    edit_config(child, {"train": {"init_from_step": 4}})
    line = cli_fails(2, "--project", child, "run")
    assert "train.init_from_step: " in line and "no complete train checkpoint at step 4" in line
    assert "(it has steps 3, 6)" in line and _untouched(child), line
    edit_config(child, {"train": {"init_from": "", "init_from_step": 3}})
    line = cli_fails(2, "--project", child, "run")
    assert "train.init_from_step: names a step of the init_from run; set init_from" in line


def test_8_a_rerun_of_the_parent_makes_the_child_stale(tmp_path: Path) -> None:
    """The parent's train run id is in the child's upstream, as an upstream stage's is: after
    the parent's `train --fresh` (a new run id) the child is stale and `pdctl run` reruns it;
    before, it stayed `done` and was skipped."""
    from pdctl.registry import STAGES
    from pdctl.stages import pipeline

    parent = _fake_parent(tmp_path)
    child = _fresh_child(tmp_path, parent)
    proj = Project.load(child / "pdctl.toml")
    for stage in STAGES:  # every stage done with this config, train from the parent
        upstream = {"init_from": "parentrun1"} if stage == "train" else {}
        proj.update_stage(stage, status="done", fingerprint=proj.fingerprint(stage),
                          run_id=f"{stage}1", upstream=upstream)  # fmt: skip
    assert not proj.is_stale("train")
    assert [a for _, a in pipeline.plan(proj)] == ["skip"] * 4
    Project.load(parent / "pdctl.toml").update_stage("train", run_id="parentrun2")
    proj = Project.load(child / "pdctl.toml")
    assert proj.is_stale("train")
    assert dict(pipeline.plan(proj))["train"] == "fresh"
    from pdctl.stages.policy import stale_reason

    assert stale_reason(proj, "train") == (
        "the train of train.init_from's run ran again since train started"
    )


def test_9_the_parent_is_checked_before_anything_runs(tmp_path: Path) -> None:
    """Another C, a tampered checkpoint, a parent pdctl.toml that does not load: one line naming
    train.init_from from `pdctl run`, before init-weights (it used to come after init-weights,
    pretrain and warmup had run, and the tampered checkpoint as a traceback)."""
    parent = _fake_parent(tmp_path)
    child = _fresh_child(tmp_path, parent)
    edit_config(child, {"decomp": {"sites": [{"pattern": "linear1", "C": 6},
                                             {"pattern": "linear2", "C": 6}]}})  # fmt: skip
    line = cli_fails(2, "--project", child, "run")
    assert "train.init_from: components.linear1.U is (4, 2)" in line and "(6, 2) here" in line
    assert _untouched(child), line
    edit_config(child, {"decomp": TINY_SITES})
    meta = parent / "checkpoints" / "train" / "6" / "decomposition" / "_METADATA"
    meta.write_text("garbage")
    line = cli_fails(2, "--project", child, "run")
    assert line.startswith(f"error: train.init_from: {parent} (train checkpoint 6) does not "
                           "restore ("), line  # fmt: skip
    assert _untouched(child)
    (parent / "pdctl.toml").write_text("[run\nseed = ")
    line = cli_fails(2, "--project", child, "run")
    assert line.startswith(f"error: train.init_from: {parent / 'pdctl.toml'} does not load ("), line
    assert _untouched(child)
