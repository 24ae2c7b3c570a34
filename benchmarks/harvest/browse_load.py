"""`pdctl browse` page load time on a whole model's harvest: a synthetic harvest.db of
`--layers` layers x 7 matrices (attention q / k / v / o, GLU MLP gate / up / down; `--per-site`
components each: 30 x 7 x 48 = 10,080 components, ~95 MB with the default 20 top and 20
sampled examples of 17 tokens per component that fired; pdctl/testing/harvest.py makes the
CI up over the built-in synthetic corpus, 8,192 positions), clustered by `pdctl cluster`'s code
and a third of the components that fired labelled, served by uvicorn in this process.

Per page: the API requests it makes, timed one by one over HTTP (server side: best of 5 each,
summed over the page's requests), and the page loaded in headless Chromium (the tests'
DevTools-pipe driver): milliseconds from navigation to the page's `data-ready` mark, best of
5 (with a baseline: a page whose one API call fails at once, what navigation and the page's
own script cost). Pages: the overview (the grid of sites, then the table), the first page of
clusters (50, each with its top tokens, a representative example and its labels), a component
page (a mid-layer MLP up component, the most often firing: its siblings at the layer's other
sites, its cluster), one site's component table, and the whole run's component table through
the API (5,000 rows). Then the overview and the clusters over the same database without its
`site_summary` and `cluster_summary` tables (a harvest.db harvested and clustered before
them): the first request, which computes the summary (of the whole run; of the page's
clusters), and the best of 5 after.

    python -m benchmarks.harvest.browse_load [--layers 30] [--per-site 48] [--top-k 20]
        [--batches 8] [--screenshots docs/] [--keep]
    python -m benchmarks.harvest.browse_load --run RUN [--component SITE:N]
        [--screenshots docs/ --prefix whole_model_browse_]

`--run RUN`: the same pages over a run's own harvest (harvested and clustered: one brought back
from a device, say) instead of the synthetic one; the older-database rows are left out. The
component page is `--component` (a site and a component index), else the middle harvested
site's most often firing component among those that do not fire at every position.

`--screenshots DIR`: also save the overview, the clusters page and the component page as PNGs in
DIR (`--prefix` + overview.png, clusters.png, component.png; prefix `browse_`; 256-colour, to
keep them small). `--keep`: leave
the run directory (~190 MB, under the system's temporary directory) to browse afterwards.
(Until 2026-12-06 this script measured 15 sites x 100 components, one site kind: see
docs/performance.md.)
"""

from __future__ import annotations

import argparse
import base64
import shutil
import socket
import sqlite3
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def serve(run: Path):
    """(uvicorn server, base url) of the browse app over `run`, started in a thread."""
    import uvicorn

    from pdctl.harvest.browse import make_app
    from pdctl.project import Project

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = make_app(Project.load(run / "pdctl.toml"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def get_ms(url: str) -> float:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        r.read()
        assert r.status == 200, (url, r.status)
    return (time.perf_counter() - t) * 1e3


def server_ms(base: str, paths: list[str]) -> float:
    """The page's API requests, each the best of 5, summed (the page makes them in turn)."""
    return sum(min(get_ms(base + p) for _ in range(5)) for p in paths)


def _pages(site: str, comp: int, C: int) -> list[tuple[str, str, list[str]]]:
    """(name, route, the API requests it makes) of the pages timed: the overview, the first
    clusters, `site`'s component `comp` and `site`'s table of `C` rows."""
    s, c = urllib.parse.quote(site, safe=""), comp
    return [
        ("overview", "#/", ["/api/overview"]),
        ("clusters (first 50)", "#/clusters", ["/api/clusters?offset=0&limit=50"]),
        (f"component ({site} #{comp})", f"#/c/{s}/{c}",
         [f"/api/component/{s}/{c}", f"/api/like/{s}/{c}", f"/api/cluster_of/{s}/{c}",
          f"/api/attributions/{s}/{c}", f"/api/labels?site={s}&component={c}"]),
        (f"site table ({C} rows)", f"#/site/{s}",
         [f"/api/components?site={s}&sort=frequency&desc=1&min_frequency=0&limit=5000",
          f"/api/labels?site={s}"]),
    ]  # fmt: skip


def _timed(pages, base: str, load) -> list[tuple[str, int, float | None, float | None]]:
    """Each page's row: its API requests' server ms (`server_ms`) and Chromium's best of 5."""
    return [(name, len(paths), server_ms(base, paths),
             min(load(f"{base}/{route}", route) for _ in range(5)))
            for name, route, paths in pages]  # fmt: skip


def _drivers(browser):
    """(js, load): a JS expression's value in the page (`Browser.js`); a route loaded, ms to
    its ready mark."""
    js = browser.js

    def load(url: str, ready: str) -> float:
        browser.call("Page.navigate", {"url": "about:blank"}, browser.session)
        t = time.perf_counter()
        browser.call("Page.navigate", {"url": url}, browser.session)
        deadline = t + 60
        while js("document.body && document.body.dataset.ready") != ready:
            assert time.perf_counter() < deadline, (url, js("document.body.innerHTML"))
            time.sleep(0.005)
        return (time.perf_counter() - t) * 1e3

    return js, load


def _table(rows) -> None:
    print("| page | API requests | server ms (best of 5 each, summed) | Chromium ms (best of 5) |")
    print("|---|---|---|---|")
    for name, n, ms, chrome in rows:
        server = "" if ms is None else f"{ms:.0f}"
        print(f"| {name} | {n} | {server} | {'' if chrome is None else f'{chrome:.0f}'} |")


def main() -> None:
    from benchmarks._harness import machine_line

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--per-site", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=20, help="top and sampled examples each")
    ap.add_argument("--batches", type=int, default=8, help="of 16 x 64 tokens")
    ap.add_argument("--screenshots", type=Path, default=None)
    ap.add_argument("--prefix", default="browse_", help="of the screenshots' file names")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (its path)")
    ap.add_argument("--run", type=Path, help="a harvested and clustered run instead")
    ap.add_argument("--component", metavar="SITE:N", help="the component page's component")
    args = ap.parse_args()
    print(machine_line())
    if args.run is not None:
        return real(args)

    from pdctl.harvest import cluster as cl
    from pdctl.project import Project
    from pdctl.testing import harvest as sh
    from pdctl.testing.browser import Browser
    from pdctl.testing.runs import make_run

    tmp = Path(tempfile.mkdtemp(prefix="pdctl-browse-"))
    L, C = args.layers, args.per_site
    run = make_run(
        tmp,
        "llama-mlp",
        "whole-model-synthetic",
        target={"n_layers": L, "d_model": 32, "n_heads": 4, "d_mlp": C, "glu": True},
        decomp={"init": "nonlinearity_aligned",
                "sites": [{"pattern": "layers.*.attn.*", "C": C},
                          {"pattern": "layers.*.mlp.*", "C": C}]},
    )  # fmt: skip
    t0 = time.perf_counter()
    sh.build(run, L, C, batches=args.batches, batch=16, top_k=args.top_k, window=8)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = cl.cluster(Project.load(run / "pdctl.toml"))
    cluster_s = time.perf_counter() - t0
    n_labels = sh.label(run)
    path = run / "harvest" / "harvest.db"
    size = path.stat().st_size / 2**20

    # the same database as one harvested and clustered before the summary tables existed
    old = make_run(tmp, "llama-mlp", "old")
    shutil.copy(run / "pdctl.toml", old / "pdctl.toml")
    (old / "harvest").mkdir()
    shutil.copy(path, old / "harvest" / "harvest.db")
    con = sqlite3.connect(old / "harvest" / "harvest.db")
    con.execute("DROP TABLE site_summary")
    con.execute("DROP TABLE cluster_summary")
    con.execute("DELETE FROM cluster_meta WHERE key = 'summary'")
    con.commit()
    con.close()

    con = sqlite3.connect(path)
    mid = L // 2
    site = f"layers.{mid}.mlp.up"
    (comp,) = con.execute(
        "SELECT component FROM components WHERE site = ? ORDER BY count DESC, component LIMIT 1",
        (site,),
    ).fetchone()
    con.close()
    server, base = serve(run)
    old_server, old_base = serve(old)
    browser = Browser(tmp / "profile")

    js, load = _drivers(browser)
    rows = _timed(_pages(site, comp, C), base, load)
    # what any page costs: navigation, the page and its script, one API call (a 404)
    chrome = min(load(f"{base}/#/cluster/999999", "#/cluster/999999") for _ in range(5))
    rows.append(("baseline: a page whose one API call fails (#/cluster/999999)", 1, None, chrome))
    ms = server_ms(base, ["/api/components?limit=5000"])
    rows.append(("API: 5,000 of all components", 1, ms, None))
    older = [
        ("overview", "#/", "/api/overview"),
        ("clusters", "#/clusters", "/api/clusters?offset=0&limit=50"),
    ]
    for name, route, api in older:
        first = get_ms(old_base + api)
        after = server_ms(old_base, [api])
        chrome = min(load(f"{old_base}/{route}", route) for _ in range(5))
        rows.append((f"{name}, older db: first request (computes the summary)", 1, first, None))
        rows.append((f"{name}, older db: after it", 1, after, chrome))

    if args.screenshots is not None:
        shots(browser, js, load, base, args.screenshots, args.prefix)
    browser.close()
    server.should_exit = old_server.should_exit = True

    print(f"{L} layers x 7 matrices = {L * 7} sites x {C} components = {L * 7 * C:,} components; "
          f"{args.top_k} top + {args.top_k} sampled examples each; harvest.db {size:.1f} MiB "
          f"(built in {build_s:.0f} s; clustered in {cluster_s:.0f} s: {got.n_clusters} clusters "
          f"of two or more, {got.n_singletons} alone; {n_labels:,} labels)")  # fmt: skip
    _table(rows)
    if args.keep:
        print(f"kept {run} (`pdctl --project {run} browse`)")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def real(args: argparse.Namespace) -> None:
    """The pages of `args.run`'s own harvest, timed as main() times the synthetic one's."""
    from pdctl.testing.browser import Browser

    path = args.run / "harvest" / "harvest.db"
    if not path.is_file():
        raise SystemExit(f"browse_load: no {path} (pdctl harvest, then pdctl cluster, first)")
    con = sqlite3.connect(path)
    sites = [r[0] for r in con.execute("SELECT site FROM sites ORDER BY idx")]
    (n_comp,) = con.execute("SELECT count(*) FROM components").fetchone()
    if args.component:
        site, _, c = args.component.rpartition(":")
        comp = int(c)
    else:
        site = sites[len(sites) // 2]
        (comp,) = con.execute(
            "SELECT component FROM components WHERE site = ? AND frequency < 1 "
            "ORDER BY count DESC, component LIMIT 1",
            (site,),
        ).fetchone()
    (C,) = con.execute("SELECT C FROM sites WHERE site = ?", (site,)).fetchone()
    con.close()
    pages = _pages(site, comp, C)
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-browse-"))
    server, base = serve(args.run)
    browser = Browser(tmp / "profile")
    js, load = _drivers(browser)
    rows = _timed(pages, base, load)
    if args.screenshots is not None:
        shots(browser, js, load, base, args.screenshots, args.prefix, pages[2][1])
    browser.close()
    server.should_exit = True
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.run}: {len(sites)} sites, {n_comp:,} components; harvest.db "
          f"{path.stat().st_size / 2**20:.1f} MiB")  # fmt: skip
    _table(rows)


def shots(browser, js, load, base: str, out: Path, prefix: str = "browse_",
          component: str | None = None) -> None:  # fmt: skip
    """The overview's grid, the first clusters and (a route given) a component page as PNGs in
    `out` (256 colours)."""
    import io

    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    browser.call("Emulation.setDeviceMetricsOverride",
                 {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False},
                 browser.session)  # fmt: skip
    top = "({}).getBoundingClientRect().top + window.scrollY"
    pages = [  # (file, route, how far down the shot goes: a JS expression, pixels)
        (f"{prefix}overview.png", "#/", top.format("document.getElementById('sites')")),
        (f"{prefix}clusters.png", "#/clusters",
         top.format("document.querySelectorAll('tr.cluster')[9]")),
    ]  # fmt: skip
    if component is not None:  # the page's first 1,600 pixels at most
        main = "document.getElementById('main').getBoundingClientRect().bottom + window.scrollY"
        pages.append((f"{prefix}component.png", component, f"Math.min({main}, 1600)"))
    for name, route, until in pages:
        load(f"{base}/{route}", route)
        bottom = js(until)
        width = js("document.documentElement.scrollWidth")
        png = browser.call("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": min(width, 1280), "height": bottom, "scale": 1}},
            browser.session)["data"]  # fmt: skip
        img = Image.open(io.BytesIO(base64.b64decode(png))).convert("RGB")
        img = img.quantize(colors=256, method=Image.Quantize.MEDIANCUT)
        img.save(out / name, optimize=True)
        print(
            f"saved {out / name}: {img.width} x {img.height}, "
            f"{(out / name).stat().st_size / 1024:.0f} KiB"
        )


if __name__ == "__main__":
    main()
