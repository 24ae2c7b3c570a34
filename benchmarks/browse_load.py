"""`pdctl browse` page load time for a large run: a synthetic harvest of 1,500 components (15
sites x 100, random CI with a heavy-tailed firing rate, an LM vocabulary of 512), served by
uvicorn, loaded in headless Chromium (the tests' DevTools-pipe driver): the overview, one
site's component table (all its rows), the whole-run component table (1,500 rows through the
API), and a component page; milliseconds from navigation to the page's `data-ready` mark, best
of 5.

    python benchmarks/browse_load.py [--sites 15] [--per-site 100]
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def build(run: Path, n_sites: int, per_site: int) -> None:
    import numpy as np

    from pdctl.harvest import db
    from pdctl.harvest.accumulate import Harvest

    rng = np.random.default_rng(0)
    sites = {f"model.layers.{i}.mlp.down_proj": per_site for i in range(n_sites)}
    h = Harvest(sites, 0.1, top_k=20, n_samples=20, window=8, vocab=512, cooc_max=8192)
    rate = rng.pareto(2.0, size=(n_sites, per_site)) * 0.01
    for b in range(8):
        tokens = rng.integers(0, 512, size=(16, 64))
        ci = {s: (rng.random((16, 64, per_site)) < rate[i]).astype(np.float32)
              * rng.random((16, 64, per_site)).astype(np.float32)
              for i, s in enumerate(sites)}  # fmt: skip
        h.add(ci, tokens, start=b * 16 * 64)
    (run / "harvest").mkdir(parents=True)
    db.write(
        run / "harvest" / "harvest.db",
        h,
        {"stage": "train", "kind": "synthetic", "split": "eval", "step": 1, "vocab": 512},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=15)
    ap.add_argument("--per-site", type=int, default=100)
    args = ap.parse_args()
    import uvicorn
    from helpers import make_run
    from test_report import _Browser

    from pdctl.harvest.browse import make_app
    from pdctl.project import Project

    tmp = Path(tempfile.mkdtemp(prefix="pdctl-browse-"))
    run = make_run(tmp, "tms", "r")
    t0 = time.perf_counter()
    build(run, args.sites, args.per_site)
    build_s = time.perf_counter() - t0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = make_app(Project.load(run / "pdctl.toml"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    browser = _Browser(tmp / "profile")

    def js(expr: str):
        out = browser.call("Runtime.evaluate", {"expression": expr, "returnByValue": True},
                           browser.session)  # fmt: skip
        return out["result"].get("value")

    def timed(url: str, ready: str) -> float:
        best = float("inf")
        for _ in range(5):
            browser.call("Page.navigate", {"url": "about:blank"}, browser.session)
            t = time.perf_counter()
            browser.call("Page.navigate", {"url": url}, browser.session)
            while js("document.body && document.body.dataset.ready") != ready:
                time.sleep(0.005)
            best = min(best, time.perf_counter() - t)
        return best * 1e3

    site = "model.layers.0.mlp.down_proj"
    rows = [
        ("overview", timed(f"{base}/#/", "#/")),
        (f"site table ({args.per_site} rows)", timed(f"{base}/#/site/{site}", f"#/site/{site}")),
        ("component page", timed(f"{base}/#/c/{site}/0", f"#/c/{site}/0")),
    ]
    t = time.perf_counter()
    js(
        "fetch('/api/components?limit=5000').then(r => r.json())"
        ".then(d => window._n = d.rows.length)"
    )
    while js("window._n") is None:
        time.sleep(0.005)
    rows.append((f"API: all {js('window._n')} components", (time.perf_counter() - t) * 1e3))
    browser.close()
    server.should_exit = True
    n = args.sites * args.per_site
    print(f"{n} components in {args.sites} sites; database built in {build_s:.1f} s, "
          f"{(run / 'harvest' / 'harvest.db').stat().st_size / 2**20:.1f} MiB")  # fmt: skip
    print("| page | ms (best of 5) |")
    print("|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.0f} |")


if __name__ == "__main__":
    main()
