"""Fault injection: the promises of docs/commands.md (exit codes, checkpoints, the config kept)
under a review's list of faults, one test per item (the tests' names keep its numbers).

- a mistake in the input exits 2 with one line and writes nothing;
- a failed stage exits 1, status `failed`, keeping the last good checkpoint;
- SIGTERM exits 3 after a checkpoint;
- every byte the user wrote above `[state.*]` is kept.

Runs are the issue's reproduction: `pdctl new r` (TMS 5-2, C=20) with pretrain.steps=20,
warmup.steps=5, train.steps=10, batch 64, log_every 5, train.eval_every 5, checkpoint.every 5.
The whole pipeline (`done`) and init-weights alone (`initialized`) are built once per session
in-process and copied per test. Most commands run in-process through the real Typer app
(`helpers.cli`); those that need a real process (signals, kill -9, an environment variable read
at JAX start-up, a read-only mount) run `python -m pdctl`, some with a fault injected by a few
lines of Python run before the CLI (`_inject`). Item 7 (`decomp.sites = []`) and `lr = inf` of
item 12 are config validation, tested in test_config.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from helpers import cli, cli_fails, edit_config, pdctl_argv, pdctl_env, pdctl_process

from pdctl.engine.checkpoint import Checkpointer
from pdctl.engine.sharding import path_str
from pdctl.project import Project, split_state
from pdctl.templates import create_run

ISSUE: dict[str, Any] = {
    "checkpoint": {"every": 5},
    "pretrain": {"steps": 20, "batch_size": 64, "log_every": 5},
    "warmup": {"steps": 5, "log_every": 5},
    "train": {"steps": 10, "batch_size": 64, "log_every": 5, "eval_every": 5},
}


# ---- helpers ---------------------------------------------------------------------------------


def _ok(*args: Any) -> Any:
    result = cli(*args)
    assert result.exit_code == 0, (args, result.stdout, result.stderr, result.exception)
    return result


_fails = cli_fails  # exit `code`, exactly one line on stderr, no traceback


def _state(run: Path, stage: str) -> dict[str, Any]:
    return Project.load(run / "pdctl.toml").stage(stage)


def _report(run: Path) -> dict[str, Any]:
    return json.loads(_ok("--project", run, "status", "--json").stdout)


def _snapshot(run: Path) -> dict[str, bytes | None]:
    """Every path under the run and its bytes (the lock file aside: its content is a pid)."""
    return {
        str(p.relative_to(run)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(run.rglob("*"))
        if p.name != ".pdctl.lock"
    }


def _steps(directory: Path) -> list[int]:
    """Complete checkpoints by name (orbax writes `<step>.orbax-checkpoint-tmp*`, then renames)."""
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _ckpts(run: Path, stage: str) -> list[int]:
    return _steps(run / "checkpoints" / stage)


def _arrays(run: Path, stage: str, step: int | None = None) -> dict[str, np.ndarray]:
    ckpt = Checkpointer(run / "checkpoints" / stage, keep=100)
    step = ckpt.latest_step() if step is None else step
    items = ckpt.restore_host(step, ckpt.item_names(step))
    ckpt.close()
    return {
        f"{name}.{path_str(p)}": np.asarray(x)
        for name, tree in items.items()
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def _pdctl(run: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return pdctl_process(*args, project=run, env=env, timeout=300)


def _inject(run: Path, hook: str, *args: str) -> subprocess.CompletedProcess:
    """`pdctl --project RUN ARGS` in a process where `hook` (Python run before the CLI, with
    `os`, `signal` and `patch(obj, name, before)` at hand) has planted a fault."""
    code = (
        "import os, signal, sys\n"
        "def patch(obj, name, before):\n"
        "    orig = getattr(obj, name)\n"
        "    def hooked(*a, **k):\n"
        "        before()\n"
        "        return orig(*a, **k)\n"
        "    setattr(obj, name, hooked)\n"
        f"{hook}\n"
        "from pdctl.cli import app\n"
        "app(['--project', sys.argv[1], *sys.argv[2:]], prog_name='pdctl')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(run), *args],
        env=pdctl_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("pdctl: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


# ---- the session's runs ----------------------------------------------------------------------


def _base(tmp_path_factory: pytest.TempPathFactory, name: str, commands: list[str]) -> Path:
    root = tmp_path_factory.getbasetemp() / f"faults-{name}"
    run = root / "r"
    if (root / "ready").exists():
        return run
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    create_run("r", "tms", root)
    edit_config(run, ISSUE)
    for cmd in commands:
        _ok("--project", run, cmd)
    (root / "ready").touch()
    return run


@pytest.fixture(scope="module")
def initialized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """init-weights done, nothing else."""
    return _base(tmp_path_factory, "init", ["init-weights"])


def done_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pdctl run` done: every stage done, checkpoints pretrain 15/20, warmup 5, train 5/10.
    Built once per session and shared (test_resume and test_harvest copy it too, for fast tests
    that need any trained TMS run): copy it; never write into it."""
    return _base(tmp_path_factory, "done", ["run"])


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return done_run(tmp_path_factory)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory, initialized: Path) -> Path:
    """init-weights done, pretrain interrupted at step 5 (`--until 5`)."""
    root = tmp_path_factory.getbasetemp() / "faults-interrupted"
    if not (root / "ready").exists():
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(initialized, root / "r")
        _ok("--project", root / "r", "pretrain", "--until", "5")
        (root / "ready").touch()
    return root / "r"


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "r"
    shutil.copytree(src, dst)
    return dst


# ---- 1. edits made while a stage runs --------------------------------------------------------


@pytest.mark.slow
def test_1_edits_made_while_a_stage_runs_are_kept(
    initialized: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user edits pdctl.toml once the stage has begun (status running, before it compiles):
    every later state write keeps the edit, comment and value, as it is on disk."""
    from pdctl.engine.loop import Loop

    run = _copy(initialized, tmp_path)
    path = run / "pdctl.toml"
    compile_ = Loop.compile

    def edit_then_compile(self, *a, **k):
        assert tomllib.loads(path.read_text())["state"]["pretrain"]["status"] == "running"
        user, state = split_state(path.read_text(encoding="utf-8"))
        head, tail = user.split("[train.optim]\n", 1)
        tail = re.sub(r"(?m)^lr = .*$", "lr = 0.002", tail, count=1)
        user = "# my comment, added while pretrain runs\n" + head + "[train.optim]\n" + tail
        path.write_text(user + state, encoding="utf-8")
        return compile_(self, *a, **k)

    monkeypatch.setattr(Loop, "compile", edit_then_compile)
    _ok("--project", run, "pretrain")
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# my comment, added while pretrain runs\n")
    assert Project.load(path).config.train.optim.lr == 0.002
    assert tomllib.loads(text)["state"]["pretrain"]["status"] == "done"


# ---- 2. resume ignores staleness -------------------------------------------------------------


@pytest.mark.slow
def test_2_resuming_a_stale_stage_is_refused(done: Path, tmp_path: Path) -> None:
    run = _copy(done, tmp_path)
    _ok("--project", run, "train", "--fresh", "--until", "5")
    edit_config(run, {"train": {"loss": {"importance_minimality": 0.5}}})
    assert _report(run)["train"]["stale"] is True
    before = _snapshot(run)
    for args in (["resume"], ["train", "--resume"]):
        line = _fails(2, "--project", run, *args)
        assert "train.loss.importance_minimality" in line and "0.5" in line, line
        assert "pdctl train --fresh" in line and "restore the config" in line, line
        assert _snapshot(run) == before
    # Restoring the config is one way on: the run then continues where it stopped.
    edit_config(run, {"train": {"loss": {"importance_minimality": 0.003}}})
    assert "train: done at step 10" in _ok("--project", run, "resume").stdout


# ---- 3. non-finite runs fail cleanly ---------------------------------------------------------


@pytest.mark.slow
def test_3_a_non_finite_train_fails_cleanly_keeping_the_checkpoints(
    done: Path, tmp_path: Path
) -> None:
    """lr = 1e30: the step-5 evaluation sees overflowed components. The stage fails (exit 1,
    one line, status failed), and the previous run's checkpoints survive the `--fresh`."""
    run = _copy(done, tmp_path)
    old = _arrays(run, "train")
    edit_config(run, {"train": {"steps": 60, "optim": {"lr": 1e30}}})
    line = _fails(1, "--project", run, "train", "--fresh")
    assert line.startswith("error: train: ") and "step 5" in line, line
    st = _state(run, "train")
    assert st["status"] == "failed" and st["step"] == 5 and "checkpoint" not in st
    assert _ckpts(run, "train") == [5, 10]
    got = _arrays(run, "train")
    assert got.keys() == old.keys()
    for k in old:
        np.testing.assert_array_equal(got[k], old[k], err_msg=k)
    # Later commands work: status reads, and a run with a sane lr starts over.
    assert _report(run)["train"]["status"] == "failed"


def test_3_bad_steps_are_counted_every_step_not_at_log_steps(
    initialized: Path, tmp_path: Path
) -> None:
    """Nothing is logged before step 60, yet the stage stops at the 10th bad step in a row."""
    run = _copy(initialized, tmp_path)
    edit_config(
        run,
        {"pretrain": {"steps": 60, "log_every": 100, "max_bad_steps": 10, "optim": {"lr": 1e30}}},
    )
    line = _fails(1, "--project", run, "pretrain")
    assert "pretrain: 10 consecutive non-finite steps (max_bad_steps = 10) by step 11" in line
    st = _state(run, "pretrain")
    assert st["status"] == "failed" and st["step"] == 11 and st["checkpoint"] == 10
    assert _ckpts(run, "pretrain") == [5, 10]


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("eval-raises", "evaluation at step 4 failed (ValueError: matrix contains invalid"),
        ("eval-nan", "evaluation at step 4 is not finite (x.site)"),
        ("state-inf", "the state is not finite at step 4"),
    ],
)
def test_3_the_loop_never_keeps_or_evaluates_a_non_finite_run(
    tmp_path: Path, fault: str, expected: str
) -> None:
    """The loop itself, with a step that claims to be finite: an evaluation that raises or
    returns NaN, or a state that overflowed, ends `failed` (StageFailed, exit 1) with the
    checkpoint before it kept; no checkpoint of the bad state is written."""
    import jax.numpy as jnp
    from helpers import make_loop

    from pdctl.engine.loop import guard_update, loop_counters
    from pdctl.errors import StageFailed

    def step(state, batch):
        v = state["w"]["v"] + 1.0
        if fault == "state-inf":  # overflows at step 3 though every check says finite
            v = jnp.where(state["loop"]["step"] >= 2, jnp.inf, v)
        return guard_update(state, {"w": {"v": v}}, jnp.bool_(True), {"loss": v.sum()})

    def eval_fn(state):
        if int(state["loop"]["step"]) < 4 or fault == "state-inf":
            return {"x": 1.0}
        if fault == "eval-raises":
            raise ValueError("matrix contains invalid numeric entries")
        return {"x": {"site": float("nan")}}

    # Separate buffers for every leaf: the step donates them all.
    loop_state = {
        k: jnp.array(v, copy=True) for k, v in loop_counters(jax.random.PRNGKey(0)).items()
    }
    state = {"w": {"v": jnp.zeros(3)}, "loop": loop_state}
    loop, _, states = make_loop(
        jax.jit(step, donate_argnums=0),
        state,
        tmp_path,
        total=8,
        log_every=2,
        checkpoint_every=2,
        eval_fn=eval_fn,
        eval_every=2,
    )
    with pytest.raises(StageFailed) as err:
        loop.run()
    msg = str(err.value)
    assert msg.startswith(f"pretrain: {expected}"), msg
    assert "the last good checkpoint is step 2" in msg, msg
    assert states[-1]["status"] == "failed" and states[-1]["checkpoint"] == 2
    assert _steps(tmp_path / "ckpt") == [2]


# ---- 4. --steps ------------------------------------------------------------------------------


def test_4_steps_is_validated_and_makes_later_stages_stale(done: Path, tmp_path: Path) -> None:
    run = _copy(done, tmp_path)
    before = _snapshot(run)
    for bad in ("-1", "0"):
        line = _fails(2, "--project", run, "pretrain", "--fresh", "--steps", bad)
        assert "--steps" in line, line
        assert _snapshot(run) == before
    _ok("--project", run, "pretrain", "--fresh", "--steps", "3")
    report = _report(run)
    assert report["pretrain"]["step"] == 3
    # pretrain ran 3 steps where pdctl.toml says 20; warmup and train read the old pretrain.
    assert [report[s]["stale"] for s in ("pretrain", "warmup", "train")] == [True] * 3
    assert "pretrain is stale" in _fails(2, "--project", run, "train", "--fresh")
    # pretrain as configured again: it is current, but warmup and train read the 3-step one.
    _ok("--project", run, "pretrain", "--fresh")
    report = _report(run)
    assert [report[s]["stale"] for s in ("pretrain", "warmup", "train")] == [False, True, True]
    line = _fails(2, "--project", run, "train", "--fresh")
    assert "warmup is stale (pretrain ran again since warmup started)" in line, line


# ---- 5. a corrupt latest checkpoint ----------------------------------------------------------


def test_5_a_corrupt_latest_checkpoint_falls_back_to_an_older_one(
    initialized: Path, tmp_path: Path
) -> None:
    straight = _copy(initialized, tmp_path / "straight")
    _ok("--project", straight, "pretrain")
    run = _copy(initialized, tmp_path / "broken")
    _ok("--project", run, "pretrain", "--until", "12")
    assert _ckpts(run, "pretrain") == [10, 12]
    for f in (run / "checkpoints" / "pretrain" / "12" / "params" / "d").iterdir():
        f.write_bytes(b"")
    result = _ok("--project", run, "pretrain", "--resume")
    assert "checkpoint pretrain/12 does not restore" in result.stderr, result.stderr
    assert "resuming from checkpoint 10" in result.stderr, result.stderr
    assert "pretrain: done at step 20" in result.stdout
    # The resumed run is the straight one, bit for bit; the bad checkpoint is kept aside.
    a, b = _arrays(straight, "pretrain"), _arrays(run, "pretrain")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    assert (run / "checkpoints" / "pretrain.corrupt" / "12").is_dir()


# ---- 6. a crash before the first checkpoint --------------------------------------------------


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.005)


def _status_on_disk(run: Path, stage: str) -> str | None:
    try:
        raw = tomllib.loads((run / "pdctl.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return raw.get("state", {}).get(stage, {}).get("status")


@pytest.mark.slow
def test_6_kill_9_before_the_first_checkpoint_then_resume(done: Path, tmp_path: Path) -> None:
    """`pretrain --fresh` killed before its first checkpoint: the previous run's checkpoints
    are still there, and `pdctl resume` starts the stage over, saying so."""
    run = _copy(done, tmp_path)
    edit_config(run, {"pretrain": {"steps": 10**7}, "checkpoint": {"every": 10**7}})
    proc = subprocess.Popen(
        pdctl_argv("pretrain", "--fresh", project=run),
        env=pdctl_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(lambda: _status_on_disk(run, "pretrain") == "running", proc)
        time.sleep(0.5)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _ckpts(run, "pretrain") == [15, 20]  # --fresh deleted nothing yet
    report = _report(run)["pretrain"]
    assert report["status"] == "running" and report["crashed"] is True
    edit_config(run, {"pretrain": {"steps": 20}, "checkpoint": {"every": 5}})
    result = _ok("--project", run, "resume")
    assert "crashed before its first checkpoint; starting it over" in result.stderr, result.stderr
    assert "pretrain: done at step 20" in result.stdout
    assert _ckpts(run, "pretrain") == [15, 20]
    assert not (run / "checkpoints" / "pretrain.previous").exists()


# ---- 8. SIGTERM before the step loop ---------------------------------------------------------

_SIGTERM_NOW = "lambda: os.kill(os.getpid(), signal.SIGTERM)"


@pytest.mark.slow
def test_8_sigterm_while_restoring_a_fresh_start(initialized: Path, tmp_path: Path) -> None:
    """SIGTERM while the stage restores init-weights (before anything is compiled): exit 3,
    `interrupted` with a checkpoint at step 0, and `pdctl resume` finishes it."""
    run = _copy(initialized, tmp_path)
    hook = f"import pdctl.stages.env as c; patch(c.StageEnv, 'restore_items', {_SIGTERM_NOW})"
    proc = _inject(run, hook, "pretrain")
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert "stopped by SIGTERM at step 0" in proc.stderr and "Traceback" not in proc.stderr
    st = _state(run, "pretrain")
    assert st["status"] == "interrupted" and st["checkpoint"] == 0
    assert _ckpts(run, "pretrain") == [0]
    assert "pretrain: done at step 20" in _ok("--project", run, "resume").stdout


@pytest.mark.slow
def test_8_sigterm_while_restoring_a_resume(initialized: Path, tmp_path: Path) -> None:
    run = _copy(initialized, tmp_path)
    _ok("--project", run, "pretrain", "--until", "7")
    hook = f"import pdctl.stages.env as c; patch(c.StageEnv, 'restore_state', {_SIGTERM_NOW})"
    proc = _inject(run, hook, "pretrain", "--resume")
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert "stopped by SIGTERM at step 7" in proc.stderr
    st = _state(run, "pretrain")
    assert st["status"] == "interrupted" and st["step"] == 7 and st["checkpoint"] == 7


# ---- 9. a symlinked pdctl.toml ---------------------------------------------------------------


def test_9_a_symlinked_pdctl_toml_keeps_its_run_dir_and_stays_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configs = tmp_path / "configs"
    create_run("configs", "tms", tmp_path)
    edit_config(configs, ISSUE)
    run = tmp_path / "r"
    run.mkdir()
    (run / "pdctl.toml").symlink_to(Path("..") / "configs" / "pdctl.toml")
    _ok("--project", run / "pdctl.toml", "init-weights")
    assert (run / "pdctl.toml").is_symlink()
    assert _ckpts(run, "init_weights") == [0]
    assert not (configs / "checkpoints").exists()
    # The same run directory however pdctl is pointed at it.
    monkeypatch.chdir(run)
    for args in ([], ["--project", "."], ["--project", "pdctl.toml"]):
        assert json.loads(_ok(*args, "status", "--json").stdout)["init_weights"]["status"] == (
            "done"
        )
    assert tomllib.loads((configs / "pdctl.toml").read_text())["state"]["init_weights"]


# ---- 10. every stage's config is checked before anything is written --------------------------


def test_10_run_checks_later_stages_before_writing(tmp_path: Path) -> None:
    create_run("r", "tms", tmp_path)
    run = tmp_path / "r"
    edit_config(run, {**ISSUE, "pretrain": {**ISSUE["pretrain"], "grad_accum_steps": 3}})
    before = _snapshot(run)
    line = _fails(2, "--project", run, "run")
    assert "pretrain.batch_size" in line and "grad_accum" in line, line
    assert _snapshot(run) == before


# ---- 11. run and a stale interrupted stage ---------------------------------------------------


def test_11_run_refuses_to_restart_a_stale_interrupted_stage(
    initialized: Path, tmp_path: Path
) -> None:
    run = _copy(initialized, tmp_path)
    _ok("--project", run, "pretrain", "--until", "10")
    edit_config(run, {"pretrain": {"optim": {"lr": 0.001}}})
    before = _snapshot(run)
    line = _fails(2, "--project", run, "run")
    assert "pretrain stopped at step 10" in line and "pretrain.optim.lr" in line, line
    assert "pdctl pretrain --fresh" in line
    assert _snapshot(run) == before
    assert _state(run, "pretrain")["status"] == "interrupted"


# ---- 12. conflicting or impossible flags -----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["pretrain", "--resume", "--fresh"], "--resume and --fresh"),
        (["warmup", "--fresh", "--resume"], "--resume and --fresh"),
        (["train", "--resume", "--fresh"], "--resume and --fresh"),
        (["pretrain", "--until", "-1"], "--until: must be a step >= 1, got -1"),
        (["train", "--until", "0"], "--until: must be a step >= 1, got 0"),
    ],
    ids=["pretrain-both", "warmup-both", "train-both", "until-negative", "until-zero"],
)
def test_12_conflicting_flags_are_one_line_errors(
    interrupted: Path, tmp_path: Path, args: list[str], expected: str
) -> None:
    """On an interrupted pretrain, where either flag alone would be accepted."""
    run = _copy(interrupted, tmp_path)
    before = _snapshot(run)
    assert expected in _fails(2, "--project", run, *args)
    assert _snapshot(run) == before


# ---- 13. one line instead of a traceback -----------------------------------------------------


def _ro_mount(run: Path, *args: str) -> subprocess.CompletedProcess:
    """`pdctl ARGS` with `run` read-only: chmod for a normal user; root ignores modes, so a
    read-only bind mount in a private mount namespace instead."""
    cmd = pdctl_argv(*args, project=run)
    if os.geteuid() != 0:
        run.chmod(0o555)
        try:
            return subprocess.run(cmd, env=pdctl_env(), capture_output=True, text=True, timeout=300)
        finally:
            run.chmod(0o755)
    if not shutil.which("unshare"):
        pytest.skip("root without unshare: cannot make a read-only directory")
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, str(run), *cmd],
        env=pdctl_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "mount:" in proc.stderr or "unshare:" in proc.stderr:
        pytest.skip(f"no private read-only mount here: {proc.stderr.strip()[:200]}")
    return proc


@pytest.mark.slow
def test_13_read_only_run_directory(initialized: Path, tmp_path: Path) -> None:
    run = _copy(initialized, tmp_path)
    before = _snapshot(run)
    line = _one_line(_ro_mount(run, "pretrain"), 2)
    assert str(run) in line and "write" in line, line
    assert _snapshot(run) == before


@pytest.mark.slow
def test_13_jax_platforms_without_that_device(initialized: Path, tmp_path: Path) -> None:
    run = _copy(initialized, tmp_path)
    before = _snapshot(run)
    line = _one_line(_pdctl(run, "pretrain", JAX_PLATFORMS="rocm"), 2)
    assert "JAX_PLATFORMS=rocm" in line, line
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("adir", "is a directory"),
        ("afile/x.npz", "is a file, not a directory"),
        ("d" * 300 + "/x.npz", "cannot write"),
    ],
    ids=["a-directory", "under-a-file", "uncreatable"],
)
def test_13_export_to_a_bad_path(initialized: Path, tmp_path: Path, out: str, expected: str):
    run = _copy(initialized, tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir.npz").mkdir()
    (tmp_path / "afile").write_text("mine")
    target = tmp_path / (out + ".npz" if out == "adir" else out)
    before = _snapshot(tmp_path)
    line = _fails(2, "--project", run, "export", "--stage", "init_weights", "--out", target)
    assert "--out" in line and expected in line, line
    assert _snapshot(tmp_path) == before


def test_13_new_onto_a_dangling_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x").symlink_to(tmp_path / "missing")
    line = _fails(2, "new", "x")
    assert "NAME:" in line and "symlink" in line, line
    assert (tmp_path / "x").is_symlink() and not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--coordinator", "host"], "--coordinator: expected HOST:PORT"),
        (
            ["--coordinator", "host:1234", "--num-processes", "2", "--process-id", "5"],
            "--process-id: must be below the number of processes (2), got 5",
        ),
    ],
    ids=["coordinator-without-port", "process-id-out-of-range"],
)
def test_13_bad_distributed_flags(
    initialized: Path, tmp_path: Path, flags: list[str], expected: str
) -> None:
    run = _copy(initialized, tmp_path)
    before = _snapshot(run)
    assert expected in _fails(2, *flags, "--project", run, "pretrain")
    assert _snapshot(run) == before


def test_13_out_of_memory_fails_the_stage(
    initialized: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """XLA's RESOURCE_EXHAUSTED (a batch too large for the device), raised where a real one
    is: compiling or running the step. Status `failed`, exit 1, one line saying what to lower."""
    from pdctl.engine.loop import Loop

    def oom(self, *a, **k):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00TiB."
        )

    monkeypatch.setattr(Loop, "compile", oom)
    run = _copy(initialized, tmp_path)
    line = _fails(1, "--project", run, "pretrain")
    assert "pretrain: out of memory" in line and "pretrain.batch_size" in line, line
    assert _state(run, "pretrain")["status"] == "failed"


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("status", "5", "state.pretrain.status: must be one of"),
        ("wall_s", '"x"', "state.pretrain.wall_s: must be a number"),
        ("lost_process", '"1"', "state.pretrain.lost_process: must be an integer >= 0"),
    ],
)
def test_13_state_with_wrong_types(
    done: Path, tmp_path: Path, field: str, value: str, expected: str
) -> None:
    run = _copy(done, tmp_path)
    path = run / "pdctl.toml"
    user, state = split_state(path.read_text(encoding="utf-8"))
    lines = state.splitlines()
    i = lines.index("[state.pretrain]") + 1
    lines = [
        *lines[:i],
        f"{field} = {value}",
        *[x for x in lines[i:] if x.split(" = ")[0] != field],
    ]
    path.write_text(user + "\n".join(lines) + "\n", encoding="utf-8")
    for args in (["status"], ["status", "--json"]):
        line = _fails(2, "--project", run, *args)
        assert expected in line and "delete [state.pretrain]" in line, line


def test_13_a_multiline_string_with_a_state_header_line(tmp_path: Path) -> None:
    """A line of the user's that starts with `[state.` inside a multi-line string is theirs."""
    create_run("r", "tms", tmp_path)
    run = tmp_path / "r"
    edit_config(run, ISSUE)
    path = run / "pdctl.toml"
    user = path.read_text(encoding="utf-8").replace(
        "[run]\n", '[run]\ndescription = """\nnotes:\n[state.train] is pdctl\'s\n"""\n', 1
    )
    path.write_text(user, encoding="utf-8")
    assert _report(run)["init_weights"]["status"] == "pending"
    _ok("--project", run, "init-weights")
    assert path.read_text(encoding="utf-8").startswith(user)
    proj = Project.load(path)
    assert proj.config.run.description == "notes:\n[state.train] is pdctl's\n"
    assert proj.stage("init_weights")["status"] == "done"


def test_13_a_mistake_found_after_the_stage_began_writes_nothing(
    initialized: Path, tmp_path: Path
) -> None:
    """init-weights' checkpoint is gone: pretrain finds out once it has begun (status running)
    and puts its state back, so the run directory is as it was."""
    run = _copy(initialized, tmp_path)
    shutil.rmtree(run / "checkpoints" / "init_weights")
    before = _snapshot(run)
    line = _fails(2, "--project", run, "pretrain")
    assert "init_weights has no checkpoint" in line and "pdctl init-weights" in line, line
    assert _snapshot(run) == before


@pytest.mark.slow
def test_13_a_command_named_for_an_unfinished_stage_works(done: Path, tmp_path: Path) -> None:
    run = _copy(done, tmp_path)
    _ok("--project", run, "warmup", "--fresh", "--until", "2")
    line = _fails(2, "--project", run, "train", "--fresh")
    assert "warmup is interrupted" in line and "`pdctl warmup --resume`" in line, line
    _ok("--project", run, "warmup", "--resume")
    _ok("--project", run, "train", "--fresh")


@pytest.mark.slow  # ~6 s: a run and an export on other device counts
def test_export_reads_checkpoints_written_on_another_device_count(
    done: Path, tmp_path: Path
) -> None:
    """Found after that list: a run trained on several devices could not be exported by a
    process with fewer (orbax restored "as saved", i.e. onto the writer's devices, and failed
    with a topology mismatch whose message advised `--fresh`). Export reads host arrays, so the
    same bytes come out on 1 device as on the 4 the run was trained on."""
    assert Project.load(done / "pdctl.toml").stage("train")["devices"] == 4
    here, there = tmp_path / "4.npz", tmp_path / "1.npz"
    _ok("--project", done, "export", "--stage", "train", "--out", here)
    proc = pdctl_process("export", "--stage", "train", "--out", there, project=done, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = np.load(here), np.load(there)
    assert sorted(a.files) == sorted(b.files) and any(k.startswith("components.") for k in a.files)
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k])
