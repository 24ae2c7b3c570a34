"""The run directory: byte-preserving state writes, atomic writes, the lock, staleness."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from helpers import edit_config

import pdctl.files as files_mod
from pdctl.errors import PdctlError
from pdctl.project import STATE_MARKER, Project, split_state
from pdctl.registry import STAGES
from pdctl.templates import create_run

USER_TOML = (
    "# my TMS run: these comments must survive every state write\n"
    "schema   =   1      # odd spacing\n"
    "\n"
    "\n"
    "[run]\n"
    "  seed=7     # indented key, no spaces around '='\n"
    '  description = "not a header: [state.train]"\n'
    "\n"
    "# a comment between tables\n"
    "[ target ]\n"
    'kind = "tms"\n'
    "n_features=5\n"
    "\t\n"
    "[decomp]\n"
    "sites = [\n"
    '    {pattern="linear1",   C=4},   # inline tables, odd spacing\n'
    "    { pattern = 'linear2', C = 4 },\n"
    "]\n"
    "[train.loss]\n"
    "importance_minimality = 3e-3\n"
    "\n"
    "# the last line has no newline"
)

VARIANTS = {
    "no-trailing-newline": USER_TOML,
    "trailing-blank-lines": USER_TOML + "\n\n\n",
    "crlf": USER_TOML.replace("\n", "\r\n"),
}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pdctl.toml"
    path.write_bytes(text.encode("utf-8"))
    return path


def _listing(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_state_writes_keep_the_user_part_byte_for_byte(tmp_path: Path, variant: str) -> None:
    original = VARIANTS[variant].encode("utf-8")
    path = _write(tmp_path, VARIANTS[variant])
    proj = Project.load(path)
    above_first: bytes | None = None

    def check() -> None:
        nonlocal above_first
        data = path.read_bytes()
        i = data.index(STATE_MARKER.encode())
        above = data[:i]
        # Every user byte is kept; pdctl only adds line breaks before its marker.
        assert above.startswith(original)
        assert set(above[len(original) :]) <= set(b"\n")
        if above_first is None:
            above_first = above
        assert above == above_first  # and never touches them again
        reloaded = Project.load(path)
        assert reloaded.state == proj.state
        assert reloaded.config == proj.config
        assert reloaded.config.run.seed == 7

    metrics = {
        "loss": 0.25,
        "total": 1.5,
        "l0": {"linear1": 2.0, "linear2": 3.5},
        "per_site": {"linear1": {"recon": 1e-3, "alive": 4}, "linear2": {"recon": 2e-3}},
    }
    proj.update_stage("init_weights", status="done", step=0, fingerprint="abc")
    check()
    proj.update_stage("pretrain", status="running", step=10, metrics=metrics, compile_s={"s": 1.0})
    check()
    proj.update_stage("pretrain", step=20, metrics={**metrics, "loss": 0.125}, wall_s=3.25)
    check()
    # A fresh load of the written file (marker present) keeps the same bytes too.
    proj = Project.load(path)
    proj.update_stage(
        "pretrain", status="done", devices={"count": 4, "kind": "cpu"}, mesh={"data": 4}
    )
    check()
    proj.reset_stage("train", status="failed", step=3, metrics={"nested": {"deeper": {"x": 1}}})
    check()
    assert Project.load(path).stage("train")["metrics"] == {"nested": {"deeper": {"x": 1}}}
    assert Project.load(path).stage("pretrain")["metrics"]["per_site"]["linear1"]["alive"] == 4


def test_interrupted_write_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, USER_TOML)
    proj = Project.load(path)
    proj.update_stage("pretrain", status="running", step=10)
    before = path.read_bytes()
    listing = _listing(tmp_path)
    seen: list[Path] = []

    def crash(tmp: Path) -> None:
        # The new content is fully written to a temp file beside pdctl.toml, which is untouched.
        assert tmp.parent == path.parent and tmp != path
        assert b"step = 11" in tmp.read_bytes()
        assert path.read_bytes() == before
        seen.append(tmp)
        raise RuntimeError("simulated crash before rename")

    monkeypatch.setattr(files_mod, "_before_rename", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        proj.update_stage("pretrain", step=11)
    assert seen, "the write did not go through atomic_write's temp file"
    assert path.read_bytes() == before
    assert Project.load(path).stage("pretrain")["step"] == 10
    assert _listing(tmp_path) == listing  # no temp file left behind
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]

    monkeypatch.setattr(files_mod, "_before_rename", None)
    proj.update_stage("pretrain", step=12)
    assert Project.load(path).stage("pretrain")["step"] == 12


_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from pdctl.errors import PdctlError
    from pdctl.project import Project

    try:
        Project.load(Path(sys.argv[1])).update_stage("train", status="running", step=1)
    except PdctlError as e:  # as the CLI does: one line, the error's exit code
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    """
)


def _second_writer(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WRITER, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=path.parent,
    )


def test_second_process_is_refused_while_the_lock_is_held(tmp_path: Path) -> None:
    path = _write(tmp_path, USER_TOML)
    proj = Project.load(path)
    proj.update_stage("pretrain", status="running", step=5)
    before = path.read_bytes()
    proj.acquire_lock()
    try:
        assert not proj.lock_is_free()
        r = _second_writer(path)
    finally:
        proj.release_lock()
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert f"pid {os.getpid()}" in lines[0]
    assert "Traceback" not in r.stderr
    assert path.read_bytes() == before

    # Once released, the same writer succeeds: it was the lock that stopped it.
    assert proj.lock_is_free()
    r = _second_writer(path)
    assert r.returncode == 0, r.stderr
    assert Project.load(path).stage("train")["status"] == "running"


def test_lock_is_reentrant_within_a_process(tmp_path: Path) -> None:
    proj = Project.load(_write(tmp_path, USER_TOML))
    with proj.locked():
        proj.update_stage("warmup", status="running")  # save_state re-takes the held lock
        with pytest.raises(PdctlError, match=rf"pid {os.getpid()}"):
            Project.load(proj.path).acquire_lock()  # another holder in this process: refused
    assert proj.lock_is_free()


def _user_config(path: Path) -> dict:
    return tomllib.loads(split_state(path.read_text(encoding="utf-8"))[0])


@pytest.mark.parametrize(
    ("table", "key", "value", "stale"),
    [
        ("pretrain", "steps", 4001, {"pretrain", "warmup", "train"}),
        ("run", "seed", 1, set(STAGES)),
        ("decomp", "n_mask_samples", 2, set(STAGES)),
        ("warmup", "lr", 0.02, {"warmup", "train"}),
        ("train", "batch_size", 128, {"train"}),
        ("mesh", "data", 1, set()),
        ("tracking", "wandb", "offline", set()),
        ("checkpoint", "every", 7, set()),
    ],
)
def test_editing_config_makes_dependent_stages_stale(
    tmp_path: Path, table: str, key: str, value: object, stale: set[str]
) -> None:
    run = create_run("run1", "tms", tmp_path)
    proj = Project.load(run / "pdctl.toml")
    for stage in STAGES:
        proj.update_stage(stage, status="done", fingerprint=proj.fingerprint(stage))
    assert not any(s["stale"] for s in Project.load(proj.path).status_report().values())

    assert _user_config(proj.path)[table][key] != value
    edit_config(run, {table: {key: value}})
    assert _user_config(proj.path)[table][key] == value

    report = Project.load(proj.path).status_report()
    assert {s for s, st in report.items() if st["stale"]} == stale
    assert all(st["status"] == "done" for st in report.values())
