"""Hostile run directories (a review's items 1 and 2; the harvest and browse items, 3-6, 10,
11 and 13, are tested in test_harvest.py next to their fixtures, and inspect-sharding's flag in
test_inspect.py):

1. the compile cache runs only what this user compiled (a signed entry, a marked directory);
2. a sweep member name is a plain name inside `runs/`, and a member directory is no symlink.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import cli_fails, make_run

from pdctl.engine import compile_cache

# ---- 1. the compile cache ----------------------------------------------------------------------


@pytest.fixture
def jax_cache():
    """Restore the session's compile cache (conftest) after a test installs another."""
    from jax._src import compilation_cache as cc

    saved = cc._cache, jax.config.jax_compilation_cache_dir
    yield cc
    cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", saved[1])
    cc._cache, cc._cache_initialized = saved[0], saved[0] is not None


def test_1_a_swapped_renamed_or_foreign_entry_is_never_loaded(tmp_path: Path, jax_cache):
    d = tmp_path / "cache"
    compile_cache.install(d)
    cache = jax_cache._cache
    assert oct((d).stat().st_mode & 0o777) == "0o700"

    def f(x):
        return x + 1

    def g(x):
        return x * 100

    x = jnp.arange(3.0)
    assert jax.jit(f)(x).tolist() == [1, 2, 3] and jax.jit(g)(x).tolist() == [0, 100, 200]
    entry = {n.split("-")[0]: d / n for n in os.listdir(d) if n.endswith("-cache")}
    assert entry["jit_f"].read_bytes().startswith(compile_cache.MAGIC)
    loaded = []
    get = cache.get
    cache.get = lambda k: loaded.append(k) or get(k)

    def f_again() -> list[float]:
        jax.clear_caches()  # the in-memory caches: the next call goes to the persistent one
        return jax.jit(f)(x).tolist()

    assert f_again() == [1, 2, 3]  # an entry this user wrote is loaded
    key_f = entry["jit_f"].name.removesuffix("-cache")
    assert get(key_f) is not None
    # Swapped: g's entry (signed, but for another key) under f's name. JAX's own LRUCache
    # runs g here (the repro); the signed cache compiles f again.
    shutil.copy(entry["jit_g"], entry["jit_f"])
    assert get(key_f) is None
    assert f_again() == [1, 2, 3]
    assert get(key_f) is not None  # replaced by a good one
    # Edited, written under another user's key, a plain JAX entry, a symlink: all misses.
    good = entry["jit_f"].read_bytes()
    entry["jit_f"].write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert get(key_f) is None
    other = compile_cache.make_signed_cache(d, b"k" * 32)
    other.put(key_f, b"payload")
    assert get(key_f) is None and other.get(key_f) == b"payload"
    entry["jit_f"].write_bytes(good[len(compile_cache.MAGIC) + 32 :])
    assert get(key_f) is None
    outside = tmp_path / "outside"
    outside.write_bytes(good)
    entry["jit_f"].unlink()
    entry["jit_f"].symlink_to(outside)
    assert get(key_f) is None
    assert f_again() == [1, 2, 3]
    assert outside.read_bytes() == good and not entry["jit_f"].is_symlink()  # not written through


def test_1_a_cache_directory_that_came_with_the_run_is_refused(tmp_path: Path, jax_cache):
    run = make_run(tmp_path, "tms", "r", compile={"cache_dir": "xla"})
    shipped = run / "xla"
    shipped.mkdir(mode=0o700)
    (shipped / "jit_init-0123-cache").write_bytes(b"an executable from someone else")
    (shipped / compile_cache.MARKER).write_text("0" * 64)  # a forged marker
    before = sorted((p.name, p.read_bytes()) for p in shipped.iterdir())
    line = cli_fails(2, "--project", run, "init-weights")
    assert line.startswith(f"error: compile.cache_dir: {shipped} holds files pdctl did not"), line
    assert sorted((p.name, p.read_bytes()) for p in shipped.iterdir()) == before
    assert not (run / "checkpoints").exists()
    # Emptied, it is marked as this user's and used.
    shutil.rmtree(shipped)
    path, _ = compile_cache.prepare(shipped)
    assert path == shipped and os.listdir(shipped) == [compile_cache.MARKER]
    assert compile_cache.prepare(shipped)[0] == shipped  # marked: accepted again


# ---- 2. sweep member names ---------------------------------------------------------------------


def _tree(root: Path) -> dict[str, object]:
    """Every path under `root` (links not followed) and its bytes or link target."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        else:
            out[rel] = p.read_bytes() if p.is_file() else None
    return out


@pytest.mark.parametrize("name", ["../../victim", "/abs", "a/b", "..", "", "x\ny"], ids=repr)
def test_2_a_member_name_outside_runs_is_refused(tmp_path: Path, monkeypatch, name: str):
    import tomllib

    import tomli_w

    (tmp_path / "w").mkdir()  # runs/../../victim is w/victim: inside tmp_path
    monkeypatch.chdir(tmp_path / "w")
    from helpers import cli_ok

    cli_ok("sweep", "new", "sw", "--seeds", "2", "--set", "pretrain.steps=2")
    path = tmp_path / "w" / "sw" / "sweep.toml"
    raw = tomllib.loads(path.read_text())
    raw["members"][1]["name"] = name
    path.write_text(tomli_w.dumps(raw))
    before = _tree(tmp_path)
    for cmd in ("run", "status"):
        line = cli_fails(2, "sweep", cmd, "sw")
        assert f"sw/sweep.toml: member name {name!r} is not a plain directory name" in line, line
    assert _tree(tmp_path) == before


def test_2_a_symlinked_member_directory_is_refused(tmp_path: Path, monkeypatch):
    from helpers import cli_ok

    monkeypatch.chdir(tmp_path)
    cli_ok("sweep", "new", "sw", "--seeds", "1", "--set", "pretrain.steps=2")
    (member,) = (tmp_path / "sw" / "runs").iterdir()
    elsewhere = tmp_path / "elsewhere"
    member.rename(elsewhere)
    member.symlink_to(elsewhere, target_is_directory=True)
    before = _tree(tmp_path)
    line = cli_fails(2, "sweep", "run", "sw")
    assert "sw/runs/seed0: is a symlink" in line, line
    assert _tree(tmp_path) == before
