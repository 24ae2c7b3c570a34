"""`pdctl cluster`: average-linkage clustering on the harvest's Jaccard co-occurrence, written
into harvest.db; on a trained TMS 5-2 run each feature's components at both sites form one
cluster."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, cli_fails, make_run

from pdctl.harvest import cluster as cl
from pdctl.harvest import db
from pdctl.harvest.accumulate import Harvest


def test_labels_cut_inclusively_and_number_clusters_by_size():
    # 0-1-2 pairwise 0.6 (one cluster), 3-4 at exactly 0.5 (joined: the cut is inclusive),
    # 5 alone; 2-3 at 0.3: their groups average below 0.5
    pairs = [(0, 1, 0.6), (1, 2, 0.6), (0, 2, 0.6), (3, 4, 0.5), (2, 3, 0.3)]
    S = cl.similarity(6, pairs)
    assert S[1, 0] == S[0, 1] == 0.6 and S[5, 5] == 1.0 and S[0, 5] == 0.0
    assert cl.labels(S, 0.5).tolist() == [0, 0, 0, 1, 1, 2]
    assert cl.labels(S, 0.55).tolist() == [0, 0, 0, 1, 2, 3]  # 3-4 no longer join
    # average linkage: {0,1,2} and {3,4} join at the mean of their six pairs, 0.3 / 6 = 0.05
    assert cl.labels(S, 0.05).tolist() == [0, 0, 0, 0, 0, 1]
    assert cl.labels(S, 0.051).tolist() == [0, 0, 0, 1, 1, 2]
    assert cl.labels(cl.similarity(1, []), 0.5).tolist() == [0]


def _synthetic_run(tmp_path: Path) -> Path:
    """A tms run directory whose harvest.db holds toy CI with known co-firing: three features,
    each switching on component i at site a and at site b (i = 0, 1, 2); a3 fires on its own,
    b3 never."""
    rng = np.random.default_rng(0)
    n = 4096
    on = rng.random((n, 4)) < 0.1
    a = on.astype(np.float32)
    b = np.concatenate([on[:, :3], np.zeros((n, 1), bool)], axis=1).astype(np.float32)
    h = Harvest({"a": 4, "b": 4}, 0.5, top_k=2, n_samples=2, window=0)
    h.add({"a": a, "b": b}, None, start=0)
    run = make_run(tmp_path, "tms", "r")
    (run / "harvest").mkdir()
    db.write(run / "harvest" / "harvest.db", h, {"stage": "train", "kind": "tms", "step": 1})
    return run


def _clusters(path: Path) -> list[list[str]]:
    con = db.open_readonly(path)
    try:
        got = cl.read(con)
    finally:
        con.close()
    return [[f"{s}{c}" for s, c in m] for _, m in sorted(got.items())]


def test_cluster_command_writes_the_clusters_into_harvest_db(tmp_path: Path):
    run = _synthetic_run(tmp_path)
    path = run / "harvest" / "harvest.db"
    r = cli("--project", run, "cluster")
    assert r.exit_code == 0, r.output
    assert "clustered 7 components: 3 clusters of two or more (largest 2), 1 alone" in r.output
    got = _clusters(path)  # numbered by size, ties by the most often firing member
    assert sorted(got[:3]) == [["a0", "b0"], ["a1", "b1"], ["a2", "b2"]] and got[3] == ["a3"]
    con = db.open_readonly(path)  # still a whole harvest database, its tables untouched
    meta = dict(con.execute("SELECT key, value FROM cluster_meta"))
    assert con.execute("SELECT count(*) FROM components").fetchone()[0] == 8
    con.close()
    assert meta["min_jaccard"] == "0.5" and meta["clusters"] == "3" and "average" in meta["method"]
    # run again with other options: the tables are replaced, not appended to
    assert cli("--project", run, "cluster", "--max-components", "3").exit_code == 0
    assert sum(len(k) for k in _clusters(path)) == 3
    assert not list((run / "harvest").glob(".*tmp*"))  # no temporary file left behind


@pytest.mark.parametrize(
    "args, says",
    [
        (("--min-jaccard", "0"), "--min-jaccard: must be in (0, 1], got 0.0"),
        (("--min-jaccard", "x"), "--min-jaccard: must be a number, got 'x'"),
        (("--min-jaccard", "nan"), "--min-jaccard: must be a number, got 'nan'"),
        (("--min-count", "0"), "--min-count: must be >= 1, got 0"),
        (("--max-components", "1.5"), "--max-components: must be an integer, got '1.5'"),
        (("--min-count", "99999"), "cluster: no component of this harvest fired 99999 times"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, args, says):
    run = _synthetic_run(tmp_path)
    path = run / "harvest" / "harvest.db"
    before = path.read_bytes()
    line = cli_fails(2, "--project", run, "cluster", *args)
    assert says in line, line
    assert path.read_bytes() == before
    assert not list((run / "harvest").glob(".*tmp*"))


def test_no_harvest_or_no_cooccurrence_is_one_line(tmp_path: Path):
    fresh = make_run(tmp_path, "tms", "fresh")
    assert "no harvest here (run `pdctl harvest` first)" in cli_fails(
        2, "--project", fresh, "cluster"
    )
    run = _synthetic_run(tmp_path / "x")
    path = run / "harvest" / "harvest.db"
    con = sqlite3.connect(path)
    con.execute("UPDATE meta SET value = ? WHERE key = 'cooc'", ('"skipped: 9 > cooc_max 1"',))
    con.commit()
    con.close()
    line = cli_fails(2, "--project", run, "cluster")
    assert "this harvest has no co-occurrence" in line and "--cooc-max" in line, line


@pytest.mark.slow  # trains TMS 5-2 far enough to recover its features: ~25 s
def test_tms_5_2_each_feature_s_components_at_both_sites_form_one_cluster(tmp_path: Path):
    """A shortened TMS 5-2 (2000 pretrain and 2000 SPD steps at batch 1024; the template's
    10,000 at 4096 take minutes) recovers every feature: one component per feature at each site
    (CI > 0.9 on the feature's one-hot input). Each feature's two components, one per site,
    must land in one cluster, and no cluster may hold two features' components."""
    run = make_run(tmp_path, "tms", "t", tiny=False,
                   pretrain={"steps": 2000, "batch_size": 1024, "log_every": 500},
                   train={"steps": 2000, "batch_size": 1024, "log_every": 500,
                          "eval_every": 2000})  # fmt: skip
    assert cli("--project", run, "run").exit_code == 0
    r = cli("--project", run, "harvest", "--tokens", "4096", "--batch-size", "1024")
    assert r.exit_code == 0, r.output
    r = cli("--project", run, "cluster")
    assert r.exit_code == 0, r.output
    path = run / "harvest" / "harvest.db"
    con = db.open_readonly(path)
    try:
        toy = con.execute("SELECT site, component, feature, ci FROM toy_features").fetchall()
        got = cl.read(con)
    finally:
        con.close()
    of = {(s, c): k for k, members in got.items() for s, c in members}
    owners = {}  # feature -> its recovered component per site
    for s, c, f, ci in toy:
        if ci > 0.9:
            owners.setdefault(f, {}).setdefault(s, []).append(c)
    assert sorted(owners) == [0, 1, 2, 3, 4], owners  # every feature recovered ...
    for sites in owners.values():  # ... by one component at each site
        assert sorted(sites) == ["linear1", "linear2"] and all(len(v) == 1 for v in sites.values())
    clusters = {f: {of[(s, v[0])] for s, v in sites.items()} for f, sites in owners.items()}
    assert all(len(k) == 1 for k in clusters.values()), clusters  # both sites: one cluster
    assert len({next(iter(k)) for k in clusters.values()}) == 5, clusters  # one per feature


def _with_attributions(run: Path) -> None:
    """Attribution rows for a0 written as `pdctl attributions` writes them (the toy harvest
    has no LM to attribute: the browser only reads the tables)."""
    import json

    from pdctl.harvest import attributions as at

    def write(con: sqlite3.Connection) -> None:
        con.executescript(at.SCHEMA)
        con.executemany("INSERT INTO attr_inputs VALUES (?, ?, ?, ?)",
                        [("a", 0, -1, 0.25), ("a", 0, 0, 1.5)])  # fmt: skip
        con.execute("INSERT INTO attr_sources VALUES ('a', 0, 'raises', 0, 'b', 1, 0.75)")
        con.execute("INSERT INTO attr_sources VALUES ('a', 0, 'lowers', 0, 'b', 2, -0.5)")
        con.execute("INSERT INTO attr_examples VALUES ('a', 0, 0, 7, ?)", (json.dumps([1.0]),))

    db.amend(run / "harvest" / "harvest.db", write, "test")


def test_browse_api_serves_clusters_and_attributions(tmp_path: Path):
    import json

    from test_harvest import _get, _serving

    run = _synthetic_run(tmp_path)
    with _serving(run) as base:  # before `pdctl cluster`: empty answers, not errors
        assert json.loads(_get(f"{base}/api/clusters")[1])["available"] is False
        assert json.loads(_get(f"{base}/api/attributions/a/0")[1]) == {"available": False}
    assert cli("--project", run, "cluster").exit_code == 0
    _with_attributions(run)
    with _serving(run) as base:
        d = json.loads(_get(f"{base}/api/clusters")[1])
        assert d["singletons"] == 1 and len(d["clusters"]) == 3
        assert all(k["sites"] == ["a", "b"] and k["size"] == 2 for k in d["clusters"])
        k = json.loads(_get(f"{base}/api/cluster_of/b/1")[1])
        assert [(m["site"], m["component"]) for m in k["members"]] == [("a", 1), ("b", 1)]
        assert json.loads(_get(f"{base}/api/cluster_of/b/3")[1])["cluster"] is None  # dead
        a = json.loads(_get(f"{base}/api/attributions/a/0")[1])
        assert a["inputs"] == [{"offset": -1, "attr": 0.25}, {"offset": 0, "attr": 1.5}]
        assert a["raises"] == [{"source_site": "b", "source_component": 1, "attr": 0.75}]
        assert a["examples"][0]["attrs"] == [1.0]
        assert _get(f"{base}/api/cluster_of/nosite/0")[0] == 404


@pytest.mark.slow  # headless Chromium: ~6 s
def test_browse_shows_clusters_and_attributions_in_headless_chromium(tmp_path: Path):
    import time

    from test_harvest import _serving
    from test_report import need_chromium

    from pdctl.testing.browser import Browser

    need_chromium()
    run = _synthetic_run(tmp_path)
    assert cli("--project", run, "cluster").exit_code == 0
    _with_attributions(run)
    browser = Browser(tmp_path / "profile")

    def js(expr: str):
        return browser.js(expr, await_promise=True)

    def wait_ready(route: str) -> None:
        deadline = time.monotonic() + 20
        while js("document.body.dataset.ready") != route:
            assert time.monotonic() < deadline, (route, js("document.body.innerHTML"))
            time.sleep(0.1)

    try:
        with _serving(run) as base:
            errors, _, _ = browser.load(f"{base}/")
            wait_ready("#/")
            assert errors == [], errors
            js("document.getElementById('clusters-link').click()")
            wait_ready("#/clusters")
            rows = js("Array.from(document.querySelectorAll('#clusters tr')).slice(1)"
                      ".map(r => Array.from(r.querySelectorAll('a.component'))"
                      ".map(a => a.textContent).join(' '))")  # fmt: skip
            assert sorted(rows) == ["a #0 b #0", "a #1 b #1", "a #2 b #2"], rows
            js("document.querySelector('#clusters a.component').click()")
            route = js("location.hash")
            wait_ready(route)
            site, c = route.split("/")[2:4]
            other = "b" if site == "a" else "a"
            cluster_text = js("document.getElementById('cluster').nextElementSibling.textContent")
            assert f"{other} #{c}" in cluster_text, cluster_text
            js("location.hash = '#/c/a/0'")
            wait_ready("#/c/a/0")
            text = js("document.getElementById('attributions').parentElement.textContent")
            assert "-1: 0.25" in text and "b #1 0.75" in text and "b #2 -0.5" in text, text
            assert js("document.querySelectorAll('.ex.attr').length") == 1
            page_errors = [m for m in browser.seen if m.get("method") == "Runtime.exceptionThrown"]
            assert page_errors == []
    finally:
        browser.close()


def test_report_draws_the_clusters(tmp_path: Path):
    from PIL import Image

    from pdctl.project import Project
    from pdctl.report import build_report
    from pdctl.report import figures as F

    run = _synthetic_run(tmp_path)
    project = Project.load(run / "pdctl.toml")
    res = build_report(project, "train")  # a harvest without clusters: no section, no error
    assert not (res.out / "clusters.png").exists()
    assert cli("--project", run, "cluster").exit_code == 0
    res = build_report(project, "train")
    png = res.out / "clusters.png"
    assert png in res.files
    with Image.open(png) as im:
        assert im.size == F.size_of("clusters")
    html = res.index.read_text()
    assert "Component clusters (pdctl cluster)" in html and 'src="clusters.png"' in html
    S, names, sizes = cl.figure_data(run / "harvest" / "harvest.db")
    assert sizes == [2, 2, 2] and len(names) == 6 and np.all(np.diag(S) == 1.0)
    assert all(S[i, i + 1] == 1.0 for i in (0, 2, 4))  # b copies a: Jaccard 1 in each block
