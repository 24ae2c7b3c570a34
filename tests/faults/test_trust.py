"""Trust boundaries (docs/commands.md, "The run directory"): a run directory may come from
someone else. Items 3, 10, 11, 12 and 13 of a review's list, one or more tests each:

3. `inspect-sharding --devices N`'s child imports nothing from the current directory;
10. pdctl never writes outside the run directory through a symlink planted in it;
11. a checkpoint whose meta contradicts its directory name, its arrays or the stage's config is
    not trusted (treated as unreadable: the resume falls back to an older one);
12. a relative `[compile] cache_dir` is relative to the run directory, and a cache directory
    someone else can write is refused;
13. the lock holds while `.pdctl.lock` is deleted or replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cli_fails, cli_ok, edit_config, make_run, pdctl_env

import pdctl
from pdctl import inspect as insp
from pdctl.engine import runtime
from pdctl.engine.checkpoint import Checkpointer, CheckpointMismatch, CheckpointUnreadable
from pdctl.engine.loop import loop_counters
from pdctl.engine.tracking import JsonlTracker
from pdctl.errors import PdctlError
from pdctl.files import UnsafePath, atomic_write
from pdctl.project import LOCK_FILE, Project

PDCTL_ROOT = Path(pdctl.__file__).resolve().parent.parent  # the pdctl under test


# ---- helpers ---------------------------------------------------------------------------------


_fails, _ok = cli_fails, cli_ok


def _snapshot(root: Path) -> dict[str, Any]:
    """Every path under `root` (links not followed) and its bytes or link target."""
    out: dict[str, Any] = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = ("link", os.readlink(p))
        elif p.is_file():
            out[str(p.relative_to(root))] = p.read_bytes()
        else:
            out[str(p.relative_to(root))] = None
    return out


@pytest.fixture(scope="module")
def initialized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny TMS run with init-weights done (pretrain: 20 steps, checkpoints every 5)."""
    run = make_run(tmp_path_factory.mktemp("trust"), "tms", checkpoint={"every": 5})
    _ok("--project", run, "init-weights")
    return run


@pytest.fixture
def run(initialized: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(initialized, dst, symlinks=True)
    return dst


# ---- 3. inspect-sharding's child imports nothing from the current directory --------------------


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_3_inspect_child_does_not_import_from_the_run_directory(tmp_path: Path) -> None:
    """The issue's reproduction: `cd run1; echo 'open("../PWNED","w")' > typer.py; pdctl
    inspect-sharding --devices 4`. The parent here is itself started with `-P` (as the `pdctl`
    console script is safe), so only the child could import that file."""
    run = make_run(tmp_path, "tms", "run1")
    (run / "typer.py").write_text('open("../PWNED","w")\n')
    # As installed (pip install -e .: a .pth file) when this checkout is what -P imports;
    # else (another checkout of pdctl under test) through PYTHONPATH.
    probe = subprocess.run(
        [sys.executable, "-P", "-c", "import pdctl; print(pdctl.__file__)"],
        cwd="/",
        env=pdctl_env(1),
        capture_output=True,
        text=True,
    )
    installed = Path(probe.stdout.strip() or "/nonexistent").resolve().parent.parent == PDCTL_ROOT
    extra = {} if installed else {"PYTHONPATH": str(PDCTL_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "pdctl", "inspect-sharding", "--devices", "4", "--json"],
        cwd=run,
        env=pdctl_env(1, **extra),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not (tmp_path / "PWNED").exists(), "the child imported typer.py from the run dir"
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    assert json.loads(proc.stdout)["devices"] == 4


def test_3_child_imports_the_same_pdctl_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child starts with `-P` outside the run directory, and gets this pdctl's directory on
    PYTHONPATH when it is importable only from where this process started."""
    run = make_run(tmp_path, "tms", "run1")
    monkeypatch.chdir(run)
    argv = insp.child_argv(None)
    assert argv[:4] == [sys.executable, "-P", "-m", "pdctl"]
    assert argv[4:] == ["--project", str(run / "pdctl.toml")]
    assert insp.CHILD_CWD == "/"
    # pdctl importable only through the entry Python puts first (a source checkout as cwd).
    rest = [p for p in sys.path if p and os.path.realpath(p) != str(PDCTL_ROOT)]
    monkeypatch.setattr(sys, "path", [str(PDCTL_ROOT), *rest])
    monkeypatch.setenv("PYTHONPATH", ":/elsewhere")
    env = insp.child_env(4)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(PDCTL_ROOT), "/elsewhere"]


# ---- 10. no writes through a symlink planted in the run directory -------------------------------


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    return victim


def test_10_a_symlinked_lock_file_is_refused(run: Path, tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    (run / LOCK_FILE).unlink(missing_ok=True)
    (run / LOCK_FILE).symlink_to(victim)
    before = _snapshot(run)
    line = _fails(2, "--project", run, "pretrain")
    assert LOCK_FILE in line and "symlink" in line, line
    assert victim.read_text() == "mine\n"
    assert _snapshot(run) == before


def test_10_a_symlinked_metrics_file_is_refused(run: Path, tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    (run / "metrics").mkdir(exist_ok=True)
    (run / "metrics" / "pretrain.jsonl").symlink_to(victim)
    before = _snapshot(run)
    line = _fails(2, "--project", run, "pretrain")
    assert "metrics/pretrain.jsonl" in line and "symlink" in line, line
    assert victim.read_text() == "mine\n"
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    "name", ["checkpoints", "checkpoints/pretrain", "metrics", "report", "cache", "profiles"]
)
def test_10_a_symlinked_directory_is_refused(run: Path, tmp_path: Path, name: str) -> None:
    """The directory's contents (init-weights' checkpoint, for `checkpoints`) moved elsewhere
    and a link left in their place."""
    elsewhere = tmp_path / "elsewhere"
    link = run / name
    if link.exists():
        shutil.move(link, elsewhere)
    else:
        elsewhere.mkdir()
        link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere, target_is_directory=True)
    before, there = _snapshot(run), _snapshot(elsewhere)
    line = _fails(2, "--project", run, "pretrain")
    assert f"{run / name}: is a symlink" in line, line
    assert _snapshot(elsewhere) == there
    assert _snapshot(run) == before


def test_10_a_symlinked_compile_cache_in_the_run_directory_is_refused(
    run: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    edit_config(run, {"compile": {"cache_dir": "xla"}})
    (run / "xla").symlink_to(elsewhere, target_is_directory=True)
    before = _snapshot(run)
    line = _fails(2, "--project", run, "pretrain")
    assert f"{run / 'xla'}: is a symlink" in line, line
    assert not any(elsewhere.iterdir())
    assert _snapshot(run) == before


def test_10_the_report_directory_is_checked(run: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proj = Project.load(run / "pdctl.toml")
    assert proj.report_dir == run / "report"
    (run / "report").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePath, match="report: is a symlink"):
        proj.report_dir  # noqa: B018


def test_10_a_planted_temp_file_link_is_not_written_through(tmp_path: Path) -> None:
    """pdctl.toml is rewritten through `.pdctl.toml.tmp-<pid>`: a symlink planted under that
    name is replaced, never followed (before: the victim got the new pdctl.toml and pdctl.toml
    became the link)."""
    run = make_run(tmp_path, "tms", "r")
    victim = _victim(tmp_path)
    tmp = run / f".pdctl.toml.tmp-{os.getpid()}"
    tmp.symlink_to(victim)
    proj = Project.load(run / "pdctl.toml")
    proj.update_stage("pretrain", status="pending", step=0)
    assert victim.read_text() == "mine\n"
    assert not (run / "pdctl.toml").is_symlink()
    assert Project.load(run / "pdctl.toml").stage("pretrain")["step"] == 0
    assert not tmp.exists() and not tmp.is_symlink()
    # The same for any atomic write.
    out = tmp_path / "out.bin"
    (tmp_path / f".out.bin.tmp-{os.getpid()}").symlink_to(victim)
    atomic_write(out, b"new")
    assert out.read_bytes() == b"new" and victim.read_text() == "mine\n"


def test_10_the_jsonl_tracker_never_writes_through_a_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    metrics = tmp_path / "metrics"
    tracker = JsonlTracker(metrics / "s.jsonl")
    tracker.log({"loss": 1.0}, step=1)
    (metrics / "s.jsonl").unlink()
    (metrics / "s.jsonl").symlink_to(victim)  # planted after the tracker opened
    with pytest.raises(UnsafePath, match=r"s\.jsonl: is a symlink"):
        tracker.log({"loss": 2.0}, step=2)
    with pytest.raises(UnsafePath, match=r"s\.jsonl: is a symlink"):
        tracker.truncate_after(0)
    with pytest.raises(UnsafePath, match=r"s\.jsonl: is a symlink"):
        JsonlTracker(metrics / "s.jsonl")
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePath, match="linked: is a symlink"):
        JsonlTracker(linked / "s.jsonl")
    assert victim.read_text() == "mine\n" and not (tmp_path / "elsewhere").exists()


def test_10_a_checkpointer_refuses_linked_directories(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "a").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePath, match="a: is a symlink"):
        Checkpointer(tmp_path / "a", keep=2)
    (tmp_path / "b").mkdir()
    (tmp_path / "b.previous").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePath, match=r"b\.previous: is a symlink"):
        Checkpointer(tmp_path / "b", keep=2)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "5").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePath, match="5: is a symlink"):
        Checkpointer(tmp_path / "c", keep=2)
    assert not any(elsewhere.iterdir())


# ---- 11. checkpoint meta is checked against what can be checked ----------------------------------


def _forge(directory: Path, which: int, **fields: Any) -> None:
    """Edit the meta JSON of checkpoint `which`."""
    path = directory / str(which) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps(meta))


def _tiny_checkpoints(directory: Path, steps: dict[int, int]) -> None:
    """Checkpoints `{dir step: loop.step counter}` of a tiny state."""
    ckpt = Checkpointer(directory, keep=10, async_save=False)
    for step, counter in steps.items():
        loop = loop_counters(jax.random.key_data(jax.random.key(0)))
        loop["step"] = jnp.int32(counter)
        ckpt.save(
            step,
            {"params": {"w": jnp.full((3,), float(step))}, "loop": loop},
            {
                "step": step,
                "run_id": "r1",
            },
        )
    ckpt.close()


def _abstract() -> dict[str, Any]:
    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    key = jax.random.key_data(jax.random.key(0))
    return {
        "params": {"w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=sh)},
        "loop": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), loop_counters(key)
        ),
    }


@pytest.mark.parametrize(
    ("counters", "forge", "kw", "match"),
    [
        ({5: 5, 10: 10}, {"step": 10**12}, {}, "meta says step 1000000000000"),
        ({5: 5, 10: 10}, {"step": 10.0}, {}, "meta says step 10.0"),
        ({5: 5, 10: 7}, {}, {}, "arrays are at step 7, not 10"),
        ({5: 5, 10: 10}, {}, {"max_step": 8}, "past the stage's 8 steps"),
        ({5: 5, 10: 10}, {"run_id": "other"}, {"run_id": "r1"}, "names run 'other'"),
    ],
    ids=["meta-step", "float-step", "arrays-step", "past-steps", "run-id"],
)
def test_11_a_contradicted_checkpoint_is_not_restored(
    tmp_path: Path, counters: dict[int, int], forge: dict, kw: dict, match: str
) -> None:
    directory = tmp_path / "ckpt"
    _tiny_checkpoints(directory, counters)
    if forge:
        _forge(directory, 10, **forge)
    ckpt = Checkpointer(directory, keep=10, **kw)
    try:
        with pytest.raises(CheckpointMismatch, match=match):
            ckpt.restore(10, _abstract())
        warned: list[str] = []
        got, (items, meta) = ckpt.restore_newest(
            [5, 10], lambda s: ckpt.restore(s, _abstract()), quarantine=True, warn=warned.append
        )
    finally:
        ckpt.close()
    assert got == 5 and meta["step"] == 5
    np.testing.assert_array_equal(np.asarray(items["params"]["w"]), np.full((3,), 5.0))
    assert len(warned) == 1 and "10" in warned[0] and match.split()[0] in warned[0], warned
    assert (tmp_path / "ckpt.corrupt" / "10").is_dir() and not (directory / "10").exists()


def test_11_no_checkpoint_left_is_unreadable(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _tiny_checkpoints(directory, {5: 5})
    _forge(directory, 5, step=10**12)
    ckpt = Checkpointer(directory, keep=10)
    try:
        with pytest.raises(CheckpointUnreadable, match="meta says step"):
            ckpt.restore_newest([5], lambda s: ckpt.restore(s, _abstract()))
    finally:
        ckpt.close()


def test_11_a_forged_step_does_not_end_the_stage(run: Path) -> None:
    """The issue's reproduction on pretrain (the same restore as train's): checkpoint 10's meta
    edited to step 10^12 made `pdctl resume` end `done at step 1000000000000`. Now that
    checkpoint is treated as unreadable: the resume falls back to checkpoint 5 and runs to the
    stage's 20 steps."""
    _ok("--project", run, "pretrain", "--until", "10")
    _forge(run / "checkpoints" / "pretrain", 10, step=10**12)
    result = _ok("--project", run, "resume")
    assert "1000000000000" not in result.stdout
    assert "checkpoint pretrain/10 does not restore" in result.stderr, result.stderr
    assert "meta says step 1000000000000" in result.stderr, result.stderr
    st = Project.load(run / "pdctl.toml").stage("pretrain")
    assert st["status"] == "done" and st["step"] == 20, st
    assert (run / "checkpoints" / "pretrain.corrupt" / "10").is_dir()


# ---- 12. the compile cache ---------------------------------------------------------------------


def test_12_a_relative_cache_dir_is_relative_to_the_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run(tmp_path, "tms", "r", compile={"cache_dir": "xla"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    proj = Project.find(explicit=run)
    assert proj.config.compile.cache_dir == str(run / "xla")
    updates: dict[str, Any] = {}
    monkeypatch.setattr(jax.config, "update", lambda k, v: updates.__setitem__(k, v))
    from jax._src import compilation_cache as cc  # the session's cache, back after the test

    monkeypatch.setattr(cc, "_cache", cc._cache)
    monkeypatch.setattr(cc, "_cache_initialized", cc._cache_initialized)
    runtime.initialize(proj.config)
    assert updates["jax_compilation_cache_dir"] == str(run / "xla")
    assert stat.S_IMODE((run / "xla").stat().st_mode) == 0o700  # created private
    assert not (elsewhere / "xla").exists()
    # An absolute one (and ~) stays as written; the fingerprints do not see the key.
    edit_config(run, {"compile": {"cache_dir": str(tmp_path / "abs")}})
    assert Project.find(explicit=run).config.compile.cache_dir == str(tmp_path / "abs")
    assert Project.find(explicit=run).fingerprint("train") == proj.fingerprint("train")


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "other-owner"])
def test_12_a_cache_dir_others_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    run = make_run(tmp_path, "tms", "r", compile={"cache_dir": "xla"})
    cache = run / "xla"
    cache.mkdir()
    if how == "world-writable":
        cache.chmod(0o777)
    elif how == "group-writable":
        cache.chmod(0o770)
        # A group that is not this user's private group.
        monkeypatch.setattr("pdctl.files._own_private_group", lambda gid: False)
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(cache, 12345, 12345)
        cache.chmod(0o755)
    before = _snapshot(run)
    line = _fails(2, "--project", run, "init-weights")
    assert line.startswith(f"error: compile.cache_dir: {cache} "), line
    assert "only you can write" in line, line
    assert _snapshot(run) == before


# ---- 13. the lock holds while its file is deleted or replaced ----------------------------------


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_13_the_lock_holds_when_its_file_goes(tmp_path: Path, how: str) -> None:
    run = make_run(tmp_path, "tms", "r")
    holder = Project.load(run / "pdctl.toml")
    holder.acquire_lock()
    try:
        lock = run / LOCK_FILE
        if how == "deleted":
            lock.unlink()
        else:
            (run / "other").write_text("")
            os.replace(run / "other", lock)
        other = Project.load(run / "pdctl.toml")
        assert not other.lock_is_free()
        with pytest.raises(PdctlError, match="in use by another pdctl process"):
            other.acquire_lock()
        before = _snapshot(run)
        line = _fails(2, "--project", run, "init-weights")
        assert "in use by another pdctl process" in line, line
        assert _snapshot(run) == before
    finally:
        holder.release_lock()
    assert Project.load(run / "pdctl.toml").lock_is_free()
    other = Project.load(run / "pdctl.toml")
    other.acquire_lock()  # free again once released
    other.release_lock()
