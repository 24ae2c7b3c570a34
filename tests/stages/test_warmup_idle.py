"""Warmup at `steps = 0` (issue 51): the stage is done at once and saves nothing
(`runner._run_idle`, `[state.warmup] components_from = "init_weights"`); train builds the
components it starts from out of init-weights' checkpoint, as warmup would have
(`warmup.start_components`), so train's state is bit for bit the one of the old path, in which
warmup built and saved its whole state (AdamW moments included) for train to read back. What
reads warmup's decomposition (export, harvest, report, the Python API) rebuilds it on the host,
and refuses once init-weights or pretrain changed under it."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from helpers import cli, cli_ok, edit_config, make_run, state

from pdctl.engine.checkpoint import complete_steps, read_host
from pdctl.project import Project
from pdctl.stages import runner, train, warmup
from pdctl.stages.decomposition import load_decomposition
from pdctl.stages.env import StageEnv

# Every test here starts from a run whose init-weights and pretrain have run (~9 s on 2 cores):
# the slow tier. The fast tier's `test_pipeline_memory.test_a_stage_with_no_steps_compiles_no_step`
# checks that a `steps = 0` warmup in `pdctl run` saves no checkpoint.
pytestmark = pytest.mark.slow

TRAIN = {"steps": 3, "batch_size": 64, "log_every": 1, "eval_every": 3, "eval_batch_size": 64}
# a tiny GLU MLP whose every MLP matrix starts nonlinearity-aligned (some with fewer components
# than neurons: drawn at random, so the keys matter)
ALIGNED = {
    "target": {"glu": True},
    "decomp": {
        "init": "nonlinearity_aligned",
        "sites": [
            {"pattern": "layers.*.mlp.gate", "C": 64},
            {"pattern": "layers.*.mlp.up", "C": 40},
            {"pattern": "layers.*.mlp.down", "C": 64},
        ],
    },
    "train": {**TRAIN, "batch_size": 8, "eval_batch_size": 8},
}


def _upstream(parent: Path, template: str, **over: Any) -> Path:
    """A run with init-weights and pretrain done and `[warmup] steps = 0`."""
    run = make_run(parent, template, warmup={"steps": 0}, **over)
    cli_ok("--project", run, "init-weights")
    cli_ok("--project", run, "pretrain")
    return run


@pytest.fixture(scope="module")
def tms_upstream(tmp_path_factory) -> Path:
    return _upstream(tmp_path_factory.mktemp("idle"), "tms", train=TRAIN)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def old_warmup(monkeypatch) -> None:
    """Warmup as it ran before issue 51: at `steps = 0` it still builds its state and saves it
    as checkpoint 0, and train restores its components from there."""
    spec = dataclasses.replace(warmup.SPEC, idle=None)
    monkeypatch.setattr(warmup, "run", functools.partial(runner.run_stage, spec=spec))


def _components_train_starts_from(run: Path) -> dict[str, Any]:
    with StageEnv.open(Project.load(run / "pdctl.toml"), "train") as env:
        components, _, _ = train.fresh_inputs(env, None)
        return jax.tree.map(np.asarray, components)


def test_warmup_at_zero_steps_saves_nothing_and_train_starts_from_init(tms_upstream, tmp_path):
    """`pdctl warmup` at `steps = 0` is done at step 0 with no checkpoint (the old path saved
    its whole state as checkpoint 0), and a fresh train starts from init-weights' components."""
    run = _copy(tms_upstream, tmp_path / "run")
    cli_ok("--project", run, "warmup")
    warm = state(run, "warmup")
    assert warm["status"] == "done" and warm["step"] == 0 and warm["steps"] == 0, warm
    assert warm.get("components_from") == "init_weights", warm
    assert "checkpoint" not in warm, warm
    assert complete_steps(run / "checkpoints" / "warmup") == []
    assert not (run / "checkpoints" / "warmup").exists()
    init = read_host(run / "checkpoints" / "init_weights", 0, "components")
    got = _components_train_starts_from(run)
    assert jax.tree.structure(got) == jax.tree.structure(init)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(init), strict=True):
        np.testing.assert_array_equal(a, b)
    # what reads warmup's decomposition gets the same (tied sites expanded)
    dec = load_decomposition(Project.load(run / "pdctl.toml"), "warmup")
    assert dec.step == 0
    np.testing.assert_array_equal(dec.components["linear1"]["V"], init["linear1"]["V"])
    np.testing.assert_array_equal(dec.components["linear2"]["V"], init["linear1"]["U"].T)


def test_an_idle_warmup_replaces_the_checkpoints_of_an_earlier_run(tms_upstream, tmp_path):
    """A warmup that ran with steps, rerun at `steps = 0`: its old checkpoints go (as a fresh
    run's first checkpoint would replace them), so nothing reads them as its result."""
    run = _copy(tms_upstream, tmp_path / "run")
    edit_config(run, {"warmup": {"steps": 2, "log_every": 1}})
    cli_ok("--project", run, "warmup")
    assert complete_steps(run / "checkpoints" / "warmup") == [2]
    edit_config(run, {"warmup": {"steps": 0}})
    cli_ok("--project", run, "warmup")
    assert state(run, "warmup").get("components_from") == "init_weights"
    assert not (run / "checkpoints" / "warmup").exists()
    assert not (run / "checkpoints" / "warmup.previous").exists()
    assert (run / "metrics" / "warmup.jsonl").read_text() == ""  # its history starts over
    import pdctl

    assert pdctl.open(run).checkpoints("warmup") == [0]


def test_an_idle_warmup_is_stale_once_init_weights_reruns(tms_upstream, tmp_path):
    """Rerunning init-weights after an idle warmup makes warmup stale: train refuses, and
    export / the decomposition readers refuse to pass init-weights' new components off as
    warmup's, naming the command to run."""
    run = _copy(tms_upstream, tmp_path / "run")
    cli_ok("--project", run, "warmup")
    cli_ok("--project", run, "init-weights")
    out = cli("--project", run, "train")
    assert out.exit_code == 2 and "is stale" in out.stderr, out.stderr
    out = cli("--project", run, "export", "--stage", "warmup", "--out", tmp_path / "w.npz")
    assert out.exit_code == 2, out.stderr
    assert "rerun `pdctl warmup`" in out.stderr and "init_weights" in out.stderr, out.stderr
    with pytest.raises(LookupError, match="rerun `pdctl warmup`"):
        load_decomposition(Project.load(run / "pdctl.toml"), "warmup")


def _train_arrays(run: Path) -> dict[str, Any]:
    directory = run / "checkpoints" / "train"
    step = complete_steps(directory)[-1]
    names = ("trainable", "opt_state", "sources", "src_opt", "loop")
    return {n: read_host(directory, step, n) for n in names}


def _metrics(run: Path, stage: str) -> list[dict[str, Any]]:
    skip = ("step_ms", "samples_per_s", "tokens_per_s", "tflops_per_s", "mfu")
    lines = (run / "metrics" / f"{stage}.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in skip} for x in lines]


# two train stages (and, aligned, a tiny LM's pipeline): ~20-60 s on 2 cores
@pytest.mark.parametrize("case", ["tms", "llama-mlp-aligned"])
def test_train_after_an_idle_warmup_equals_the_old_path(case, tmp_path, monkeypatch):
    """Train's state after its steps (and every logged metric and evaluation) is bit for bit
    the old path's, with the nonlinearity-aligned init too (built by train from the trained
    target it restores once, not from a warmup checkpoint); the idle warmup saved nothing, and
    `export --stage warmup` and the API read the same components as the old checkpoint's."""
    import pdctl

    if case == "tms":
        base = _upstream(tmp_path / "base", "tms", train=TRAIN)
    else:
        base = _upstream(tmp_path / "base", "llama-mlp", **ALIGNED)
    new, old = _copy(base, tmp_path / "new"), _copy(base, tmp_path / "old")
    restores: list[str] = []
    from pdctl.stages import env as env_mod

    real = env_mod.pretrained_target

    def spy(env):
        restores.append(f"pretrained:{env.stage}")
        return real(env)

    monkeypatch.setattr(env_mod, "pretrained_target", spy)
    monkeypatch.setattr("pdctl.stages.init_weights.pretrained_target", spy)
    cli_ok("--project", new, "warmup")
    out = cli_ok("--project", new, "train")
    if case != "tms":
        assert "train: 3 MLP site(s) start nonlinearity-aligned" in out.output, out.output
    assert restores == ["pretrained:train"], restores  # the frozen target, read once
    assert "checkpoint" not in state(new, "warmup")
    with monkeypatch.context() as m:
        old_warmup(m)
        cli_ok("--project", old, "warmup")
        assert state(old, "warmup")["checkpoint"] == 0
        cli_ok("--project", old, "train")
    assert state(new, "train")["status"] == state(old, "train")["status"] == "done"
    a, b = _train_arrays(new), _train_arrays(old)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    assert _metrics(new, "train") == _metrics(old, "train")
    assert state(new, "train")["eval"] == state(old, "train")["eval"]
    # the readers of warmup's decomposition: the old checkpoint's components, bit for bit
    cli_ok("--project", new, "export", "--stage", "warmup", "--out", tmp_path / "new.npz")
    cli_ok("--project", old, "export", "--stage", "warmup", "--out", tmp_path / "old.npz")
    with np.load(tmp_path / "new.npz") as x, np.load(tmp_path / "old.npz") as y:
        assert sorted(x.files) == sorted(y.files)
        for k in x.files:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    da, db = pdctl.open(new).decomposition("warmup"), pdctl.open(old).decomposition("warmup")
    assert da.step == db.step == 0
    for x, y in zip(jax.tree.leaves(da.components), jax.tree.leaves(db.components), strict=True):
        np.testing.assert_array_equal(x, y)
