"""Faults, round 4 (issue 53): hostile harvest databases, unbounded allocations from input,
the browser's Host header, the compile cache's foreign entries, `inspect-sharding --devices`
bounds and what `pdctl harvest` of an interrupted stage says."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pdctl.errors import PdctlError

ROOT = Path(__file__).resolve().parents[2]


# ---- 6: [train.ppgd] pool_size is bounded by validation, not by XLA --------------------------


def test_pool_size_far_past_any_use_is_one_line_naming_the_key():
    from pdctl.config import MAX_POOL_SIZE, parse_config

    raw = tomllib.loads((ROOT / "pdctl.toml.example").read_text())
    raw.setdefault("train", {}).setdefault("ppgd", {}).update(scope="pooled", pool_size=10**15)
    with pytest.raises(PdctlError, match=r"^train\.ppgd\.pool_size: .*4096"):
        parse_config(raw)
    raw["train"]["ppgd"]["pool_size"] = MAX_POOL_SIZE
    assert parse_config(raw).train.ppgd.pool_size == MAX_POOL_SIZE


# ---- harvest.db fixtures ----------------------------------------------------------------------


def _harvest_run(tmp_path: Path) -> Path:
    """A tms run directory with a small harvest.db: two sites, components co-firing."""
    import numpy as np
    from helpers import make_run

    from pdctl.harvest import db
    from pdctl.harvest.accumulate import Harvest

    on = np.random.default_rng(0).random((512, 3)) < 0.2
    h = Harvest({"a": 3, "b": 3}, 0.5, top_k=2, n_samples=2, window=0)
    h.add({"a": on.astype(np.float32), "b": on.astype(np.float32)}, None, start=0)
    run = make_run(tmp_path, "tms", "r")
    (run / "harvest").mkdir()
    db.write(run / "harvest" / "harvest.db", h, {"stage": "train", "kind": "tms", "step": 1})
    return run


def _edit(path: Path, sql: str) -> None:
    import sqlite3

    con = sqlite3.connect(path)
    con.execute(sql)
    con.commit()
    con.close()


# ---- 5: a NaN cooc.jaccard in a hostile harvest.db ---------------------------------------------


def test_cluster_of_a_nan_jaccard_is_one_line(tmp_path: Path):
    from helpers import cli_fails

    run = _harvest_run(tmp_path)
    _edit(run / "harvest" / "harvest.db", "UPDATE cooc SET jaccard = 'NaN'")
    out = cli_fails(2, "--project", run, "cluster")
    assert "cooc.jaccard" in out and "Traceback" not in out


# ---- 6: the distance matrix of `pdctl cluster` is bounded -------------------------------------


def test_cluster_of_more_components_than_memory_allows_names_the_flag(tmp_path, monkeypatch):
    from pdctl.harvest import cluster as cl
    from pdctl.harvest import db

    run = _harvest_run(tmp_path)
    monkeypatch.setattr(cl, "MAX_CLUSTERED", 3, raising=False)  # 6 fired components: over the bound
    con = db.open_readonly(run / "harvest" / "harvest.db")
    try:
        with pytest.raises(PdctlError, match=r"^--max-components: 6 components .* GiB"):
            cl.compute(con, 0.5, 1, 100000)
        assert len(cl.compute(con, 0.5, 1, 3)[0]) == 3  # within it: clustered
    finally:
        con.close()


# ---- 2: another program's -wal beside harvest.db -----------------------------------------------


def _hand_over_with_wal(run: Path, tmp_path: Path) -> Path:
    """harvest.db as copied off a machine where another program had it open in WAL mode: a
    committed change still in harvest.db-wal."""
    import shutil
    import sqlite3

    path = run / "harvest" / "harvest.db"
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(path, other / "harvest.db")
    con = sqlite3.connect(other / "harvest.db")
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("INSERT INTO meta VALUES ('note', '\"from the other machine\"')")
    con.commit()
    for name in ("harvest.db", "harvest.db-wal"):  # copied while it is open
        shutil.copy(other / name, path.parent / name)
    con.close()
    assert (path.parent / "harvest.db-wal").stat().st_size > 0
    return path


def test_a_stale_wal_beside_harvest_db_is_refused_not_inherited(tmp_path: Path):
    import sqlite3

    from helpers import cli_fails, cli_ok

    run = _harvest_run(tmp_path)
    path = _hand_over_with_wal(run, tmp_path)
    before = path.read_bytes()
    line = cli_fails(2, "--project", run, "cluster")
    assert "harvest.db-wal" in line and "PRAGMA journal_mode=DELETE" in line
    assert path.read_bytes() == before  # nothing written
    con = sqlite3.connect(path)  # the database is still whole for every other reader
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    con.close()
    # the command the line gives folds the -wal in; then pdctl reads it, with the change
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=DELETE")
    con.close()
    assert not (path.parent / "harvest.db-wal").exists()
    cli_ok("--project", run, "cluster")
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert con.execute("SELECT value FROM meta WHERE key = 'note'").fetchone() is not None
    con.close()


# ---- pdctl harvest of a stage that did not finish says which checkpoint it reads ---------------


def test_harvest_of_an_interrupted_stage_names_the_step_it_harvests():
    from pdctl.harvest import run as hv

    st = {"status": "interrupted", "step": 7, "steps": 20, "checkpoint": 5}
    line = hv.stage_line(st, "train", 5)
    assert line == (
        "harvest: train did not finish (interrupted at step 7 of 20): harvesting its latest "
        "checkpoint, step 5"
    )
    assert hv.stage_line({"status": "done", "step": 20}, "train", 20) is None


# ---- a cache directory of entries signed under another key: compiled again, as the README says --


def test_a_cache_of_entries_signed_under_another_key_is_compiled_again(tmp_path, monkeypatch):
    import os

    from pdctl.engine import compile_cache as cc

    d = tmp_path / "cache"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "old-key"))
    path, old = cc.prepare(d)
    cc.make_signed_cache(path, old).put("jit_f-0123", b"old program")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "new-key"))  # the key made again
    path, new = cc.prepare(d)  # not refused: every file there is a signed entry
    assert new != old
    mine = cc.make_signed_cache(path, new)
    assert mine.get("jit_f-0123") is None  # another key's entry: a miss, never loaded
    mine.put("jit_f-0123", b"new program")
    assert mine.get("jit_f-0123") == b"new program"
    assert cc.prepare(d)[0] == path  # marked as this key's now
    # a file that is no signed entry is still refused, whole
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "third-key"))
    (d / "jit_g-4567-cache").write_bytes(b"a plain JAX entry")
    with pytest.raises(PdctlError, match="jit_g-4567-cache"):
        cc.prepare(d)
    assert sorted(os.listdir(d)) == ["jit_f-0123-cache", "jit_g-4567-cache", cc.MARKER]


# ---- inspect-sharding --devices is bounded ------------------------------------------------------


def test_inspect_sharding_refuses_more_simulated_devices_than_it_can_start():
    import jax

    from pdctl.config import parse_config
    from pdctl.inspect import child

    cfg = parse_config(tomllib.loads((ROOT / "pdctl.toml.example").read_text()))
    with pytest.raises(PdctlError, match=r"^--devices: at most 4096 simulated .* got 100000"):
        child.needs_child(100000, cfg, None)  # before any child process starts
    assert child.needs_child(jax.device_count(), cfg, None) is False


# ---- browse answers only requests that name this machine (DNS rebinding) ----------------------


def test_browse_refuses_a_host_or_origin_that_is_not_this_machine(tmp_path: Path):
    from starlette.testclient import TestClient

    from pdctl.harvest.browse import make_app
    from pdctl.project import Project

    run = _harvest_run(tmp_path)
    (run / "note.txt").write_text("private")
    app = make_app(Project.load(run / "pdctl.toml"))
    with TestClient(app, base_url="http://127.0.0.1:8765") as client:
        assert client.get("/api/overview").status_code == 200
        assert client.get("/files/note.txt").text == "private"
        for host in ("localhost:9000", "[::1]:8765", "10.1.2.3"):  # a tunnel, addresses
            assert client.get("/api/overview", headers={"host": host}).status_code == 200
        for headers in ({"host": "rebind.example:8765"}, {"host": "localhost.evil.example"},
                        {"origin": "http://rebind.example:8765"}, {"origin": "null"}):  # fmt: skip
            r = client.get("/files/note.txt", headers=headers)
            assert r.status_code == 403 and "private" not in r.text, headers
        ok = client.get("/api/overview", headers={"origin": "http://127.0.0.1:8765"})
        assert ok.status_code == 200
