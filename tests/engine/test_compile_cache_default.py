"""The compile cache is on by default, in the run directory (issue 51): a rerun or resume of a
run reads its programs instead of compiling them again; `[compile] cache_dir = ""` turns it
off; a default cache pdctl cannot use (one that came with someone else's run directory) is
left alone with a warning instead of refusing the run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import cli_ok, edit_config, make_run, state

from pdctl.engine import compile_cache

SHORT = {
    "warmup": {"steps": 2, "log_every": 2},
    "train": {"steps": 4, "batch_size": 64, "log_every": 2, "eval_every": 4},
}


@pytest.fixture
def default_cache(monkeypatch):
    """This test's runs without the test session's shared cache (conftest), as a user's are;
    the session's cache is put back afterwards."""
    session = os.environ.get(compile_cache.ENV)
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    yield
    if session:
        compile_cache.install(session)


def _entries(d: Path) -> set[str]:
    return {p.name for p in d.iterdir() if p.name.endswith(compile_cache.SUFFIX)}


@pytest.mark.slow  # ~21 s: a whole `pdctl run` in a fresh process
def test_a_run_caches_its_programs_in_its_directory(tmp_path: Path, default_cache) -> None:
    """`pdctl run` writes its compiled programs to <run>/cache/compile (private, marked); the
    train stage run again compiles nothing new: every program is read from there."""
    run = make_run(tmp_path, "tms", **SHORT)
    cli_ok("--project", run, "run")
    cache = run / compile_cache.DEFAULT
    assert (cache / compile_cache.MARKER).is_file()
    assert cache.stat().st_mode & 0o077 == 0
    first = _entries(cache)
    assert first, "no program was cached"
    cli_ok("--project", run, "train", "--fresh")
    assert state(run, "train")["status"] == "done"
    assert _entries(cache) == first  # every program of the rerun was a cache hit


def test_an_empty_cache_dir_turns_it_off(tmp_path: Path, default_cache) -> None:
    run = make_run(tmp_path, "tms", compile={"cache_dir": ""}, **SHORT)
    cli_ok("--project", run, "init-weights")
    assert not (run / "cache" / "compile").exists()


def test_a_foreign_default_cache_is_left_alone(tmp_path: Path, default_cache) -> None:
    """A cache directory pdctl did not make for this user (files, no valid mark) where the
    default cache goes: the run goes on without a cache, says so, and touches nothing there.
    (A cache_dir the config names is refused instead: tests/faults/test_trust.py.)"""
    run = make_run(tmp_path, "tms", **SHORT)
    cache = run / compile_cache.DEFAULT
    cache.mkdir(parents=True, mode=0o700)
    planted = cache / "jit_step-0123-cache"
    planted.write_bytes(b"someone else's executable")
    result = cli_ok("--project", run, "init-weights")
    assert "running without a compile cache" in result.stderr, result.stderr
    assert sorted(p.name for p in cache.iterdir()) == [planted.name]
    assert planted.read_bytes() == b"someone else's executable"


def test_a_configured_cache_dir_is_used_as_before(tmp_path: Path, default_cache) -> None:
    run = make_run(tmp_path, "tms", **SHORT)
    edit_config(run, {"compile": {"cache_dir": "elsewhere"}})
    cli_ok("--project", run, "init-weights")
    assert (run / "elsewhere" / compile_cache.MARKER).is_file()
    assert not (run / "cache" / "compile").exists()
