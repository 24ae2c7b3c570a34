"""`pdctl browse` over a whole model (issue 52 item 3): the overview's grid of sites by layer x
matrix, the clusters page (top tokens, a representative example, labels), a component's
siblings at the other sites of its layer, and a harvest.db written before the summary tables
(`site_summary`, `cluster_summary`) still opening and showing the same.

Over pdctl/testing/harvest.py's run: 3 layers x 7 matrices of 8 components, clustered and
labelled (~10 s, built once for this file)."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from helpers import edit_config
from test_harvest import _get, _serving

from pdctl.harvest import db
from pdctl.harvest.browse import site_grid, site_place
from pdctl.testing.harvest import KINDS, whole_model_run

LAYERS, C = 3, 8


@pytest.fixture(scope="module")
def model_run(tmp_path_factory) -> Path:
    return whole_model_run(tmp_path_factory.mktemp("browse"), LAYERS, C)


def _older(run: Path, parent: Path) -> Path:
    """A copy of `run` whose harvest.db is as one harvested and clustered before the summary
    tables: no site_summary, no cluster_summary, no cluster_meta.summary."""
    old = parent / "old"
    shutil.copytree(run, old)
    con = sqlite3.connect(old / "harvest" / "harvest.db")
    con.execute("DROP TABLE site_summary")
    con.execute("DROP TABLE cluster_summary")
    con.execute("DELETE FROM cluster_meta WHERE key = 'summary'")
    con.commit()
    con.close()
    return old


def _json(base: str, path: str):
    status, body = _get(base + path)
    assert status == 200, (path, status, body[:300])
    return json.loads(body)


def test_site_place_and_grid_by_layer_and_kind():
    hf = "model.layers.12.self_attn.q_proj"
    assert site_place(hf) == ("model.layers", 12, "self_attn.q_proj")
    assert site_place("layers.0.mlp.up") == ("layers", 0, "mlp.up")
    assert site_place("hidden_layers.3") == ("hidden_layers", 3, "hidden_layers")
    assert site_place("linear1") == ("", None, "linear1")
    assert site_place("a.99999999999.b") == ("", None, "a.99999999999.b")  # not a layer
    hf = [f"model.layers.{i}.{k}" for i in range(2) for k in
          ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]  # fmt: skip
    g = site_grid([*hf, "lm_head"])
    assert [c["label"] for c in g["columns"]] == ["q_proj", "o_proj", "gate_proj", "down_proj",
                                                  "lm_head"]  # fmt: skip
    assert [r["label"] for r in g["rows"]] == ["layer 0", "layer 1", "other"]
    assert g["rows"][1]["sites"][2] == "model.layers.1.mlp.gate_proj"
    assert g["rows"][2]["sites"] == [None, None, None, None, "lm_head"]
    # GPT-2: two kinds end in c_proj, so the columns keep their whole names
    kinds = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    gpt = [f"transformer.h.0.{k}" for k in kinds]
    assert [c["label"] for c in site_grid(gpt)["columns"]] == kinds
    # a layer without some kinds: empty cells; layers sorted by number, not by name
    g = site_grid(["layers.2.attn.q", "layers.10.mlp.up", "layers.2.mlp.up"])
    assert [r["layer"] for r in g["rows"]] == [2, 10]
    assert g["rows"][1]["sites"] == [None, "layers.10.mlp.up"]


def test_overview_grid_has_one_cell_per_site(model_run: Path):
    with _serving(model_run) as base:
        o = _json(base, "/api/overview")
    g = o["grid"]
    assert [c["label"] for c in g["columns"]] == [k.split(".")[-1] for k in KINDS]
    assert [r["label"] for r in g["rows"]] == [f"layer {i}" for i in range(LAYERS)]
    cells = [s for r in g["rows"] for s in r["sites"]]
    assert sorted(cells) == sorted(s["site"] for s in o["sites"])  # each site once, no gap
    assert len(cells) == LAYERS * len(KINDS)
    for r in g["rows"]:
        for kind, s in zip(KINDS, r["sites"], strict=True):
            assert s == f"layers.{r['layer']}.{kind}"
    con = db.open_readonly(model_run / "harvest" / "harvest.db")
    for s in o["sites"]:
        freqs = [f for (f,) in con.execute("SELECT frequency FROM components WHERE site = ?",
                                           (s["site"],))]  # fmt: skip
        assert s["frequency_hist"] == db.frequency_hist(freqs) and sum(freqs) > 0, s
        assert sum(s["frequency_hist"]) == C and s["layer"] == int(s["site"].split(".")[1])
    con.close()


def test_clusters_page_shows_top_tokens_an_example_and_labels(model_run: Path):
    with _serving(model_run) as base:
        d = _json(base, "/api/clusters")
        assert d["available"] and d["total"] == len(d["clusters"]) > 3
        threshold = db.read_meta(model_run / "harvest" / "harvest.db")["threshold"]
        for k in d["clusters"]:
            assert k["size"] == len(k["members"]) >= 2
            assert k["tokens"] and all(t["count"] > 0 and t["token"] for t in k["tokens"]), k
            counts = [t["count"] for t in k["tokens"]]
            assert counts == sorted(counts, reverse=True)
            e = k["example"]
            assert e is not None and len(e["tokens"]) == len(e["cis"]) == 17  # window 8
            assert e["cis"][8] > threshold  # the centre fires
            assert 1 <= e["members_firing"] <= k["size"]
            assert (e["site"], e["component"]) in {(m["site"], m["component"])
                                                   for m in k["members"]}  # fmt: skip
        labelled = [m["label"] for k in d["clusters"] for m in k["members"] if m["label"]]
        assert labelled and all(isinstance(x, str) for x in labelled)
        # paging, one cluster, and what is refused
        page = _json(base, "/api/clusters?offset=2&limit=2")
        assert [k["cluster"] for k in page["clusters"]] == [
            k["cluster"] for k in d["clusters"][2:4]]  # fmt: skip
        first = d["clusters"][0]
        assert {**_json(base, f"/api/cluster/{first['cluster']}"), "meta": None} == {
            **first, "meta": None}  # fmt: skip
        assert _get(f"{base}/api/cluster/99999")[0] == 404
        assert _get(f"{base}/api/clusters?offset=-1")[0] == 400
        assert _get(f"{base}/api/clusters?limit=x")[0] == 400


def test_component_page_links_the_same_component_at_the_layers_other_sites(
    model_run: Path, tmp_path: Path
):
    site = "layers.1.mlp.up"
    with _serving(model_run) as base:
        for c in range(C):
            sib = _json(base, f"/api/component/{site}/{c}")["siblings"]
            assert sib["layer"] == 1 and sib["init"] == "nonlinearity_aligned"
            rows = sib["rows"]
            assert [r["site"] for r in rows] == [f"layers.1.{k}" for k in KINDS]
            assert all(r["component"] == c for r in rows)
            assert [r["this"] for r in rows] == [k == "mlp.up" for k in KINDS]
            # C = d_mlp and nonlinearity-aligned init: gate / down c are MLP neuron c too
            assert [r["same_neuron"] for r in rows] == [k in ("mlp.gate", "mlp.down")
                                                        for k in KINDS]  # fmt: skip
            comp = _json(base, f"/api/component/layers.1.mlp.gate/{c}")
            want = {r["site"]: r for r in rows}["layers.1.mlp.gate"]
            assert {k: comp[k] for k in ("count", "frequency", "max_ci")} == {
                k: want[k] for k in ("count", "frequency", "max_ci")}  # fmt: skip
            k = _json(base, f"/api/cluster_of/{site}/{c}")
            assert want.get("cluster") is None or isinstance(want["cluster"], int)
            mine = {r["site"]: r for r in rows}[site]
            assert mine["cluster"] == k["cluster"]
            if k["cluster"] is not None and len(k["members"]) > 1:
                assert k["tokens"], k
    # another init: the same index is not the same neuron
    other = tmp_path / "random"
    shutil.copytree(model_run, other)
    edit_config(other, {"decomp": {"init": "random"}})
    with _serving(other) as base:
        sib = _json(base, f"/api/component/{site}/0")["siblings"]
    assert sib["init"] == "random" and not any(r["same_neuron"] for r in sib["rows"])


def test_an_older_harvest_db_still_opens_and_shows_the_same(model_run: Path, tmp_path: Path):
    from pdctl.harvest import keep

    old = _older(model_run, tmp_path)
    path = old / "harvest" / "harvest.db"
    con = db.open_readonly(path)  # the summary tables are not required
    new = db.open_readonly(model_run / "harvest" / "harvest.db")
    assert not db.has_table(con, "site_summary") and db.has_table(new, "site_summary")
    assert db.site_summary(con) == db.site_summary(new)  # computed = what the harvest wrote
    con.close()
    new.close()
    with _serving(model_run) as base, _serving(old) as old_base:
        for api in ("/api/overview", "/api/clusters", "/api/clusters?offset=1&limit=3",
                    "/api/component/layers.2.mlp.down/3",
                    "/api/cluster_of/layers.0.mlp.up/1"):  # fmt: skip
            a, b = _json(base, api), _json(old_base, api)
            for d in (a, b):
                d.pop("run", None)
                d.get("meta", {}).pop("summary", None)
            assert a == b, api
    # a re-harvest over a database with the summary tables drops the clusters and says so,
    # naming no summary table
    what, commands = keep._rerun(keep.read_old(model_run / "harvest" / "harvest.db"))
    assert what == ["clusters"] and commands[0].startswith("pdctl cluster "), (what, commands)


@pytest.mark.slow  # headless Chromium, as the other browser tests (~3 s)
def test_whole_model_pages_in_headless_chromium(model_run: Path, tmp_path: Path):
    import time

    from test_report import need_chromium

    from pdctl.testing.browser import Browser

    need_chromium()
    browser = Browser(tmp_path / "profile")

    js = browser.js

    def go(route: str) -> None:
        js(f"location.hash = {json.dumps(route)}")
        deadline = time.monotonic() + 20
        while js("document.body.dataset.ready") != route:
            assert time.monotonic() < deadline, (route, js("document.body.innerHTML"))
            time.sleep(0.05)

    try:
        with _serving(model_run) as base:
            errors, _, _ = browser.load(f"{base}/")
            assert errors == [], errors
            go("#/")
            hrefs = js("Array.from(document.querySelectorAll('#grid td.cell a.cell'))"
                       ".map(a => decodeURIComponent(a.getAttribute('href')))")  # fmt: skip
            want = [f"#/site/layers.{i}.{k}" for i in range(LAYERS) for k in KINDS]
            assert hrefs == want  # one cell per site, row by row
            assert js("document.querySelectorAll('#grid svg.hist').length") == len(want)
            assert js("document.querySelectorAll('#grid tr').length") == LAYERS + 1
            assert js("document.querySelectorAll('#sites a.site').length") == len(want)  # table
            js("document.querySelectorAll('#grid a.cell')[5].click()")
            go("#/site/layers.0.mlp.up")
            go("#/clusters")
            rows = js("document.querySelectorAll('#clusters tr.cluster').length")
            assert rows > 3, js("document.getElementById('main').innerHTML")[:2000]
            assert js("Array.from(document.querySelectorAll('#clusters tr.cluster'))"
                      ".every(r => r.querySelector('td.tokens code') && "
                      "r.querySelector('.ex .here'))")  # fmt: skip
            assert js("document.querySelectorAll('#clusters .label').length") > 0
            go("#/c/layers.1.mlp.up/2")
            links = js("Array.from(document.querySelectorAll('#siblings-table a.component'))"
                       ".map(a => a.textContent)")  # fmt: skip
            assert links == [f"layers.1.{k} #2" for k in KINDS if k != "mlp.up"], links
            assert js("document.querySelectorAll('#siblings-table .badge').length") == 2
            # a component whose input tokens include " ": shown as ␣, as the clusters page
            # does, not as an empty box (a real LM's newline and tab tokens were invisible)
            go("#/c/layers.1.mlp.up/7")
            codes = js("Array.from(document.querySelectorAll('#main p code'))"
                       ".map(c => c.textContent)")  # fmt: skip
            assert "␣" in codes and all(c.strip() for c in codes), codes
            page_errors = [m for m in browser.seen if m.get("method") == "Runtime.exceptionThrown"]
            assert page_errors == []
    finally:
        browser.close()


@pytest.mark.slow  # headless Chromium, a page held back 1.5 s: ~6 s
def test_a_page_still_loading_is_not_drawn_over_the_next(model_run: Path, tmp_path: Path):
    """Navigating away from a page still loading: the newer page stays, and `ready` names it.
    The overview's API is held back 1.5 s; the clusters page, asked for meanwhile, is drawn
    first; the overview's answer, when it comes, is dropped (before, it replaced the clusters
    page, and its late `ready` named the route the user was on: a whole-model browser test
    under load saw the overview where it looked for clusters)."""
    import asyncio
    import time

    from test_report import need_chromium

    from pdctl.testing.browser import Browser

    need_chromium()

    def slow_overview(app):
        async def held(scope, receive, send):
            if scope["type"] == "http" and scope["path"] == "/api/overview":
                await asyncio.sleep(1.5)
            await app(scope, receive, send)

        return held

    browser = Browser(tmp_path / "profile")

    js = browser.js

    try:
        with _serving(model_run, wrap=slow_overview) as base:
            browser.load(f"{base}/#/clusters")  # drawn; the overview not asked for
            js("location.hash = '#/'")  # the overview asked for, its answer held back
            time.sleep(0.3)
            js("location.hash = '#/clusters/0'")
            deadline = time.monotonic() + 20
            while js("document.body.dataset.ready") != "#/clusters/0":
                assert time.monotonic() < deadline, js("document.body.innerHTML")[:2000]
                time.sleep(0.05)
            time.sleep(2.5)  # the overview's answer has come (1.5 s) and been dropped
            assert js("document.querySelectorAll('#clusters tr.cluster').length") > 3
            assert js("document.querySelectorAll('#grid').length") == 0
            assert js("document.body.dataset.ready") == "#/clusters/0"
    finally:
        browser.close()
