"""`pdctl browse`: a local web app over a run's harvest.db (Starlette, served by uvicorn).

One page of plain HTML + JS (`static/`, no build step, no network assets) over a small JSON API,
read-only: the database is opened `mode=ro` per request, and the only files served are the
app's own and, under /files/, files inside the run directory (a path that resolves outside it,
through `..` or a symlink, is refused with 403).

API: /api/overview (the run and its sites, each with its layer and matrix kind, its components
by firing frequency, and the grid of sites by layer x kind the overview draws),
/api/components?site=&sort=&desc=&min_frequency=&limit=&offset= (the component table),
/api/component/{site}/{c} (one component: statistics, top and sampled examples with tokens
decoded, token lists, co-firing components, V/U norms, and component c at the other sites of
its layer), /api/search?q= (components firing on a token, given as its text or #id),
/api/like/{site}/{c} (components whose top tokens overlap this one's most),
/api/labels?site=&component= (labels and their scores, from `pdctl interp import` / `score`;
none before that); after `pdctl cluster` / `pdctl attributions` (empty before):
/api/clusters?offset=&limit= (a page of the clusters of two or more, each with its members,
top input tokens, one representative example and its members' labels), /api/cluster/{k} (one
cluster so), /api/cluster_of/{site}/{c} (the component's cluster), /api/attributions/{site}/{c}
(its input offsets, upstream components and top examples with their per-token attributions).

A whole model has 90-210 sites (30 layers x q/k/v/o/gate/up/down): the overview reads one
summary row per site (`db.site_summary`: the harvest's `site_summary` table, or for a
harvest.db written before it, computed once per file and kept in memory), and every other page
reads only the rows of the components it shows, through the tables' indexes.
"""

from __future__ import annotations

import json
import socket
import sqlite3
from collections.abc import Callable
from contextlib import closing, suppress
from pathlib import Path
from typing import Any

from pdctl.errors import PdctlError
from pdctl.harvest import cluster as cluster_mod
from pdctl.harvest import db
from pdctl.project import Project

STATIC = Path(__file__).with_name("static")
SORTS = ("component", "frequency", "count", "mean_ci", "max_ci", "v_norm", "u_norm")
MAX_OFFSET = 10**12  # rows; SQLite's integers end at 2**63
MAX_VOCAB = 1 << 20  # token ids a text search decodes (the largest LM vocabularies are ~262k)
# The page runs only its own script (no inline script or handler, whatever a value holds);
# a file under /files/ runs in a sandbox, never at the app's origin.
APP_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'"
)
FILES_CSP = "sandbox"
CLUSTER_PAGE = 50  # clusters a page of /api/clusters shows unless asked (at most 500)


def site_place(site: str) -> tuple[str, int | None, str]:
    """(the path of its list of blocks, its layer, its matrix kind) of a site path, from the
    path alone: its first all-digit part is the layer. `model.layers.3.self_attn.q_proj` ->
    ("model.layers", 3, "self_attn.q_proj"); `hidden_layers.0` -> ("hidden_layers", 0,
    "hidden_layers"); a path without one (`linear1`, `lm_head`) -> ("", None, the path)."""
    parts = site.split(".")
    for i, p in enumerate(parts):
        if p.isascii() and p.isdigit() and len(p) < 10:
            prefix = ".".join(parts[:i])
            return prefix, int(p), ".".join(parts[i + 1 :]) or prefix or site
    return "", None, site


def site_grid(sites: list[str]) -> dict[str, Any]:
    """The overview's picture: sites (in forward order) as a grid of layers (rows, by layer,
    sites without a layer last) x matrix kinds (columns, in the order they first appear), each
    cell the site there or None. A column's label is the kind's last part when those are all
    different (`q_proj`), else the whole kind (`attn.c_proj`, `mlp.c_proj`)."""
    places = {s: site_place(s) for s in sites}
    kinds = list(dict.fromkeys(k for _, _, k in places.values()))
    prefixes = list(dict.fromkeys(p for p, layer, _ in places.values() if layer is not None))
    keys: list[tuple[str, int | None]]
    keys = sorted({(p, layer) for p, layer, _ in places.values() if layer is not None},
                  key=lambda k: (prefixes.index(k[0]), k[1]))  # fmt: skip
    if any(layer is None for _, layer, _ in places.values()):
        keys.append(("", None))
    col = {k: i for i, k in enumerate(kinds)}
    cells: dict[tuple[str, int | None], list[str | None]]
    cells = {key: [None] * len(kinds) for key in keys}
    for s, (p, layer, k) in places.items():
        cells[(p, layer)][col[k]] = s
    short = [k.rsplit(".", 1)[-1] for k in kinds]
    labels = short if len(set(short)) == len(short) else kinds

    def row_label(p: str, layer: int | None) -> str:
        if layer is None:
            return "other"
        return f"{p}.{layer}" if len(prefixes) > 1 else f"layer {layer}"

    return {
        "columns": [{"kind": k, "label": lab} for k, lab in zip(kinds, labels, strict=True)],
        "rows": [{"label": row_label(*key), "layer": key[1], "sites": cells[key]}
                 for key in keys],
    }  # fmt: skip


def _ids(ids: list[int]) -> str:
    return "".join(f"⟨{int(t)}⟩" for t in ids)


def decoder(project: Project) -> Callable[[list[int]], str]:
    """The run's token decoder (ids shown as ⟨id⟩ when its model cannot be read)."""
    return _model(project)[0]


def _model(project: Project) -> tuple[Callable[[list[int]], str], dict[str, int]]:
    """(the token decoder, {site: its MLP's neurons} of the MLP projections that `decomp.init
    = "nonlinearity_aligned"` starts as one neuron per component: none under another init),
    from the run's target; a run whose model directory moved shows ids and no neurons."""
    try:
        from pdctl.stages.decomposition import token_decoder
        from pdctl.stages.inputs import target_from_config

        target = target_from_config(project.config, project.root, need_weights=False)
    except Exception:
        return _ids, {}
    try:
        decode = token_decoder(project, target)[0]
    except Exception:
        decode = _ids
    neurons = {}
    try:
        if project.config.decomp.init == "nonlinearity_aligned":
            shapes = target.site_shapes()
            neurons = {s: shapes[s][0 if side == "in" else 1]
                       for s, side in target.mlp_neuron_sides().items()}  # fmt: skip
    except Exception:
        neurons = {}
    return decode, neurons


def _host_name(value: str) -> str | None:
    """The host of a `Host:` header value (`name`, `name:port`, `[v6]:port`), lower case; None
    for a value that is none."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, port = value[1:end], value[end + 1 :]
        if end < 0 or (port and not port.startswith(":")):
            return None
        port = port[1:]
    else:
        name, _, port = value.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".") or None


def host_allowed(name: str | None, own: frozenset[str]) -> bool:
    """Whether a request naming host `name` can only have come from a page of this machine's
    own address (the DNS-rebinding check): an IP address (a browser sends one only when it
    was given that address), localhost or a name under .localhost (loopback in browsers), or
    one of `own` (this machine's host names)."""
    import ipaddress

    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name == "localhost" or name.endswith(".localhost") or name in own


def own_names() -> frozenset[str]:
    """This machine's host names (lower case): what a `--host 0.0.0.0` browse is reached by."""
    names = set()
    for get in (socket.gethostname, socket.getfqdn):
        with suppress(OSError):
            names.add(get().lower().rstrip("."))
    return frozenset(n for n in names if n)


class HostCheck:
    """ASGI middleware: 403 for a request whose `Host:` (or `Origin:`, when sent) does not name
    this machine (`host_allowed`). A page on another name that a DNS-rebinding server points
    at 127.0.0.1 is then refused: its requests carry its own name. Ports are not compared, so
    a tunnel (`ssh -L 9000:localhost:8765`) still works."""

    def __init__(self, app: Any, names: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.own = own_names() | names

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            ok = host_allowed(_host_name(headers.get(b"host", "")), self.own)
            origin = headers.get(b"origin")
            if ok and origin is not None:
                scheme, sep, rest = origin.partition("://")
                ok = (
                    bool(sep)
                    and scheme in ("http", "https")
                    and host_allowed(_host_name(rest), self.own)
                )
            if not ok:
                body = b'{"detail": "Host or Origin does not name this machine"}'
                await send({"type": "http.response.start", "status": 403, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def make_app(project: Project, names: frozenset[str] = frozenset()):
    """The browse app; a request is served only when its Host (and Origin) names this machine
    (`HostCheck`; `names`: more names to accept, such as the --host given)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse
    from starlette.routing import Route

    root = project.root.resolve()
    path = root / "harvest" / "harvest.db"
    db.open_readonly(path).close()  # refuse a missing or foreign database up front
    decode, neurons = _model(project)
    try:
        init = str(project.config.decomp.init)
    except Exception:
        init = None
    cache: dict[int, str] = {}
    summary: dict[str, Any] = {}  # {"key": the file's identity, "value": db.site_summary}
    clustered: dict[str, Any] = {}  # {"key": ..., "value": {cluster: cluster.summarize's}}

    def tok(t: int) -> str:
        if t < 0:
            return ""
        if t not in cache:
            cache[t] = decode([t])
        return cache[t]

    def connect() -> sqlite3.Connection:
        con = db.open_readonly(path)
        con.row_factory = sqlite3.Row
        return con

    index_of: dict[str, Any] = {}  # {"vocab": n, "ids": {text: [ids]}}, built on first search

    def ids_of(text: str, vocab: int) -> list[int]:
        if index_of.get("vocab") != vocab:
            by: dict[str, list[int]] = {}
            for t in range(vocab):
                by.setdefault(tok(t).strip(), []).append(t)
            index_of.update(vocab=vocab, ids=by)
        return index_of["ids"].get(text, [])

    def meta(con) -> dict[str, Any]:
        return db.read_pairs(con)

    def site_exists(con, site: str) -> None:
        if con.execute("SELECT 1 FROM sites WHERE site = ?", (site,)).fetchone() is None:
            raise HTTPException(404, f"no site {site!r}")

    def identity() -> tuple[int, int, int]:
        """The file now at `path` (taken before it is opened: a file renamed over it after
        that has another identity, and is summarised again on the next request); none for a
        file that is not there (opening it then says so)."""
        try:
            st = path.stat()
        except OSError:
            return 0, 0, 0
        return st.st_ino, st.st_size, st.st_mtime_ns

    def frequency_hists(con, key: tuple[int, int, int]) -> dict[str, list[int]]:
        if summary.get("key") != key:
            summary.update(key=key, value=db.site_summary(con))
        return summary["value"]

    async def index(request):
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": APP_CSP})

    async def static(request):
        name = request.path_params["name"]
        if name not in ("app.js", "style.css"):
            raise HTTPException(404)
        return FileResponse(STATIC / name)

    async def files(request):
        target = (root / request.path_params["path"]).resolve()
        if not target.is_relative_to(root):
            raise HTTPException(403, "outside the run directory")
        if not target.is_file():
            raise HTTPException(404)
        return FileResponse(target, headers={"Content-Security-Policy": FILES_CSP})

    async def overview(request):
        key = identity()
        with closing(connect()) as con:
            hists = frequency_hists(con, key)
            sites = []
            for s in con.execute("SELECT * FROM sites ORDER BY idx"):
                name = str(s["site"])
                _, layer, kind = site_place(name)
                hist = hists.get(name, [0] * len(db.FREQUENCY_EDGES))
                sites.append({**dict(s), "layer": layer, "kind": kind, "frequency_hist": hist})
            grid = site_grid([str(s["site"]) for s in sites])
            return JSONResponse({"run": str(root), "meta": meta(con), "sites": sites, "grid": grid,
                                 "frequency_edges": list(db.FREQUENCY_LABELS)})  # fmt: skip

    async def components(request):
        q = request.query_params
        site = q.get("site", "")
        sort = q.get("sort", "frequency")
        if sort not in SORTS:
            raise HTTPException(400, f"sort must be one of {', '.join(SORTS)}")
        desc = q.get("desc", "1") != "0"
        try:
            limit = max(1, min(int(q.get("limit", 200)), 5000))
            offset = int(q.get("offset", 0))
            min_f = float(q.get("min_frequency", 0))
        except ValueError:
            raise HTTPException(400, "limit, offset and min_frequency are numbers") from None
        if not 0 <= offset <= MAX_OFFSET:
            raise HTTPException(400, f"offset: must be in [0, {MAX_OFFSET}], got {offset}")
        with closing(connect()) as con:
            where, args = "frequency >= ?", [min_f]
            if site:
                site_exists(con, site)
                where += " AND site = ?"
                args.append(site)
            order = f"{sort} {'DESC' if desc else 'ASC'}, site, component"
            rows = con.execute(
                "SELECT site, component, count, frequency, mean_ci, max_ci, v_norm, u_norm "
                f"FROM components WHERE {where} ORDER BY {order} LIMIT ? OFFSET ?",
                [*args, limit, offset],
            ).fetchall()
            count_sql = f"SELECT count(*) FROM components WHERE {where}"
            (total,) = con.execute(count_sql, args).fetchone()
            return JSONResponse({"total": total, "rows": [dict(r) for r in rows]})

    def _example(r) -> dict[str, Any]:
        toks = json.loads(r["tokens"])
        return {
            "rank": r["rank"],
            "ci": r["ci"],
            "position": r["position"],
            "tokens": [tok(t) for t in toks],
            "ids": toks,
            "cis": json.loads(r["cis"]),
        }

    async def component(request):
        site, c = request.path_params["site"], request.path_params["c"]
        with closing(connect()) as con:
            site_exists(con, site)
            row = con.execute(
                "SELECT * FROM components WHERE site = ? AND component = ?", (site, c)
            ).fetchone()
            if row is None:
                raise HTTPException(404, f"no component {c} in {site}")
            out = dict(row)
            out["hist"] = json.loads(out["hist"])
            for kind in ("top", "sample"):
                out[kind] = [_example(r) for r in con.execute(
                    "SELECT * FROM examples WHERE site = ? AND component = ? AND kind = ? "
                    "ORDER BY rank", (site, c, kind))]  # fmt: skip
            for kind in ("count", "pmi"):
                out[f"tokens_{kind}"] = [
                    {"token": tok(r["token"]), "id": r["token"], "count": r["count"],
                     "pmi": r["pmi"]}
                    for r in con.execute(
                        "SELECT * FROM tokens WHERE site = ? AND component = ? AND kind = ? "
                        "ORDER BY rowid", (site, c, kind))
                ]  # fmt: skip
            out["cooc"] = [
                dict(r)
                for r in con.execute(
                    "SELECT other_site, other_component, count, precision, recall, jaccard, pmi "
                    "FROM cooc WHERE site = ? AND component = ? ORDER BY rowid",
                    (site, c),
                )
            ]
            out["effects"] = {kind: [
                {"token": tok(r["token"]), "id": r["token"], "nats": r["nats"]}
                for r in con.execute(
                    "SELECT token, nats FROM effects WHERE site = ? AND component = ? AND "
                    "kind = ? ORDER BY rank", (site, c, kind))
            ] for kind in ("raised", "lowered")}  # fmt: skip
            out["features"] = [dict(r) for r in con.execute(
                "SELECT feature, ci FROM toy_features WHERE site = ? AND component = ? "
                "ORDER BY feature", (site, c))]  # fmt: skip
            out["siblings"] = siblings(con, site, c)
            return JSONResponse(out)

    def siblings(con, site: str, c: int) -> dict[str, Any]:
        """Component c at every site of `site`'s layer (this one included, `this`): its
        firing statistics, cluster and label; `same_neuron` where both sites are MLP
        projections that `nonlinearity_aligned` started as one MLP neuron per component (C =
        the MLP's neurons at both), so that c is the same neuron there."""
        prefix, layer, _ = site_place(site)
        out: dict[str, Any] = {"layer": layer, "init": init, "rows": []}
        if layer is None:
            return out
        C = {str(r[0]): r[1] for r in con.execute("SELECT site, C FROM sites ORDER BY idx")}
        here = [s for s in C if site_place(s)[:2] == (prefix, layer)]
        marks = ", ".join("?" * len(here))
        stats = {r["site"]: dict(r) for r in con.execute(
            "SELECT site, component, count, frequency, mean_ci, max_ci FROM components "
            f"WHERE component = ? AND site IN ({marks})", (c, *here))}  # fmt: skip
        extra: dict[str, dict[str, Any]] = {}
        for table, col in (("clusters", "cluster"), ("labels", "label")):
            if db.has_table(con, table):
                for s, v in con.execute(f"SELECT site, {col} FROM {table} WHERE component = ? "
                                        f"AND site IN ({marks})", (c, *here)):  # fmt: skip
                    extra.setdefault(s, {})[col] = v

        def aligned(s: str) -> bool:
            return s in neurons and C.get(s) == neurons[s]

        for s in here:
            if s not in stats:  # c is beyond this site's C
                continue
            out["rows"].append({**stats[s], "kind": site_place(s)[2], "this": s == site,
                                "same_neuron": s != site and aligned(s) and aligned(site),
                                "cluster": None, "label": None, **extra.get(s, {})})  # fmt: skip
        return out

    async def search(request):
        q = request.query_params.get("q", "").strip()
        if not q:
            raise HTTPException(400, "q: give a token's text or #id")
        with closing(connect()) as con:
            vocab = meta(con).get("vocab") or 0
            if q.startswith("#") and q[1:].isdigit() and len(q) < 20:
                ids = [int(q[1:])]
            else:
                if not isinstance(vocab, int) or not 0 <= vocab <= MAX_VOCAB:
                    raise HTTPException(
                        422, f"harvest.db: meta.vocab must be an integer in [0, {MAX_VOCAB}], "
                        f"got {vocab!r}: search by #id"
                    )  # fmt: skip
                ids = ids_of(q, vocab)
            rows = []
            for t in ids:
                rows += [
                    dict(r) | {"token": tok(t), "id": t}
                    for r in con.execute(
                        "SELECT site, component, count, pmi FROM tokens WHERE token = ? AND "
                        "kind = 'count' ORDER BY count DESC, site, component LIMIT 100",
                        (t,),
                    )
                ]
            rows.sort(key=lambda r: (-r["count"], r["site"], r["component"]))
            return JSONResponse({"q": q, "ids": ids, "rows": rows[:100]})

    async def like(request):
        site, c = request.path_params["site"], request.path_params["c"]
        with closing(connect()) as con:
            site_exists(con, site)
            rows = con.execute(
                "SELECT b.site AS site, b.component AS component, count(*) AS shared FROM tokens a "
                "JOIN tokens b ON a.token = b.token AND b.kind = 'count' WHERE a.site = ? AND "
                "a.component = ? AND a.kind = 'count' AND NOT (b.site = a.site AND "
                "b.component = a.component) GROUP BY b.site, b.component "
                "ORDER BY shared DESC, b.site, b.component LIMIT 20",
                (site, c),
            ).fetchall()
            return JSONResponse({"rows": [dict(r) for r in rows]})

    async def labels(request):
        q = request.query_params
        site, c = q.get("site"), q.get("component")
        try:
            c = None if c is None else int(c)
        except ValueError:
            raise HTTPException(400, "component: must be an integer") from None
        with closing(connect()) as con:
            rows = [{"site": s, "component": k, **v} for (s, k), v in db.read_labels(con).items()
                    if (site is None or s == site) and (c is None or k == c)]  # fmt: skip
            return JSONResponse({"rows": rows})

    def cluster_summaries(con, key: tuple[int, int, int], ids: list[int]) -> dict[int, Any]:
        """`cluster.summarize` of clusters `ids`: from the `cluster_summary` table `pdctl
        cluster` writes with them, or for clusters written without it (`cluster_meta.summary`
        absent), computed here as they are shown and kept for this file."""
        if db.read_pairs(con, "cluster_meta").get("summary") == cluster_mod.SUMMARY_VERSION:
            marks = ", ".join("?" * len(ids))
            return {int(r[0]): {"tokens": json.loads(r[1]),
                                "example": None if r[2] is None else list(r[2:])}
                    for r in con.execute(
                        "SELECT cluster, tokens, site, component, kind, rank, members_firing "
                        f"FROM cluster_summary WHERE cluster IN ({marks})", ids)}  # fmt: skip
        if clustered.get("key") != key:
            clustered.clear()
            clustered.update(key=key, value={})
        have = clustered["value"]
        have.update(cluster_mod.summarize(con, [k for k in ids if k not in have]))
        return {k: have[k] for k in ids}

    def cards(con, key: tuple[int, int, int], ids: list[int]) -> list[dict[str, Any]]:
        """Clusters `ids`, in that order: each one's members (in site order, with their firing
        statistics and labels), its top input tokens and one representative example
        (`cluster.summarize`: the position most members fire at)."""
        if not ids:
            return []
        marks = ", ".join("?" * len(ids))
        out: dict[int, dict[str, Any]] = {
            k: {"cluster": k, "members": [], "tokens": [], "example": None} for k in ids
        }
        for r in con.execute(
            "SELECT k.cluster AS cluster, k.site AS site, k.component AS component, "
            "c.count AS count, c.frequency AS frequency FROM clusters k "
            "JOIN sites s ON s.site = k.site LEFT JOIN components c ON c.site = k.site AND "
            f"c.component = k.component WHERE k.cluster IN ({marks}) "
            "ORDER BY k.cluster, s.idx, k.component", ids):  # fmt: skip
            _, layer, kind = site_place(str(r["site"]))
            m = {k: r[k] for k in ("site", "component", "count", "frequency")}
            out[r["cluster"]]["members"].append({**m, "layer": layer, "kind": kind, "label": None})
        if db.has_table(con, "labels"):
            said = {(r[0], r[1]): r[2] for r in con.execute(
                "SELECT l.site, l.component, l.label FROM clusters k JOIN labels l ON "
                f"l.site = k.site AND l.component = k.component WHERE k.cluster IN ({marks})",
                ids)}  # fmt: skip
            for k in ids:
                for m in out[k]["members"]:
                    m["label"] = said.get((m["site"], m["component"]))
        for k, got in cluster_summaries(con, key, ids).items():
            out[k]["tokens"] = [{"token": tok(t), "id": t, "count": n, "members": m}
                                for t, n, m in got["tokens"]]  # fmt: skip
            if got["example"] is not None:
                site, c, kind, rank, firing = got["example"]
                row = con.execute(
                    "SELECT * FROM examples WHERE site = ? AND component = ? AND kind = ? AND "
                    "rank = ?", (site, c, kind, rank),
                ).fetchone()  # fmt: skip
                if row is not None:
                    out[k]["example"] = {**_example(row), "site": site, "component": c,
                                         "members_firing": firing}  # fmt: skip
        for card in out.values():
            card["size"] = len(card["members"])
            card["sites"] = sorted({m["site"] for m in card["members"]})
        return [out[k] for k in ids]

    def cluster_sizes(con) -> list[tuple[int, int]]:
        """(cluster, size) of every cluster, by number (`pdctl cluster` numbers them by size,
        largest first)."""
        q = "SELECT cluster, count(*) FROM clusters GROUP BY cluster ORDER BY cluster"
        return [(int(k), int(n)) for k, n in con.execute(q)]

    async def clusters(request):
        q = request.query_params
        try:
            limit = max(1, min(int(q.get("limit", CLUSTER_PAGE)), 500))
            offset = int(q.get("offset", 0))
        except ValueError:
            raise HTTPException(400, "limit and offset are numbers") from None
        if not 0 <= offset <= MAX_OFFSET:
            raise HTTPException(400, f"offset: must be in [0, {MAX_OFFSET}], got {offset}")
        key = identity()
        with closing(connect()) as con:
            if not db.has_table(con, "clusters"):
                return JSONResponse({"available": False, "clusters": [], "singletons": 0,
                                     "total": 0})  # fmt: skip
            info = db.read_pairs(con, "cluster_meta")
            sizes = cluster_sizes(con)
            many = [k for k, n in sizes if n > 1]
            page = cards(con, key, many[offset : offset + limit])
            return JSONResponse({"available": True, "meta": info, "clusters": page,
                                 "total": len(many), "offset": offset, "limit": limit,
                                 "singletons": sum(1 for _, n in sizes if n == 1)})  # fmt: skip

    async def one_cluster(request):
        k = request.path_params["k"]
        key = identity()
        with closing(connect()) as con:
            if not db.has_table(con, "clusters"):
                raise HTTPException(404, "no clusters yet (`pdctl cluster`)")
            if con.execute("SELECT 1 FROM clusters WHERE cluster = ?", (k,)).fetchone() is None:
                raise HTTPException(404, f"no cluster {k}")
            info = db.read_pairs(con, "cluster_meta")
            return JSONResponse({"meta": info, **cards(con, key, [k])[0]})

    async def cluster_of(request):
        site, c = request.path_params["site"], request.path_params["c"]
        key = identity()
        with closing(connect()) as con:
            site_exists(con, site)
            if not db.has_table(con, "clusters"):
                return JSONResponse({"available": False, "cluster": None, "members": []})
            row = con.execute(
                "SELECT cluster FROM clusters WHERE site = ? AND component = ?", (site, c)
            ).fetchone()
            members, tokens = [], []
            if row is not None:
                members = [
                    {"site": s, "component": k, **dict(zip(("layer", "kind"),
                                                         site_place(str(s))[1:], strict=True))}
                    for s, k in con.execute(
                        "SELECT k.site, k.component FROM clusters k JOIN sites s ON "
                        "s.site = k.site WHERE k.cluster = ? ORDER BY s.idx, k.component",
                        (row["cluster"],))
                ]  # fmt: skip
                if len(members) > 1:
                    got = cluster_summaries(con, key, [row["cluster"]]).get(row["cluster"], {})
                    tokens = [{"token": tok(t), "id": t, "count": n, "members": m}
                              for t, n, m in got.get("tokens", [])]  # fmt: skip
            return JSONResponse({"available": True, "members": members, "tokens": tokens,
                                 "cluster": None if row is None else row["cluster"]})  # fmt: skip

    async def attributions(request: Request) -> JSONResponse:
        site, c = request.path_params["site"], request.path_params["c"]
        with closing(connect()) as con:
            site_exists(con, site)
            if not db.has_table(con, "attr_inputs"):
                return JSONResponse({"available": False})
            out: dict[str, Any] = {"available": True}
            out["inputs"] = [dict(r) for r in con.execute(
                "SELECT offset, attr FROM attr_inputs WHERE site = ? AND component = ? "
                "ORDER BY offset", (site, c))]  # fmt: skip
            for kind in ("raises", "lowers"):
                out[kind] = [dict(r) for r in con.execute(
                    "SELECT source_site, source_component, attr FROM attr_sources WHERE site = ? "
                    "AND component = ? AND kind = ? ORDER BY rank", (site, c, kind))]  # fmt: skip
            out["examples"] = [
                {"rank": r["rank"], "position": r["position"], "attrs": json.loads(r["attrs"]),
                 "tokens": [tok(t) for t in json.loads(r["tokens"] or "[]")]}
                for r in con.execute(
                    "SELECT a.rank AS rank, a.position AS position, a.attrs AS attrs, e.tokens AS "
                    "tokens FROM attr_examples a LEFT JOIN examples e ON e.site = a.site AND "
                    "e.component = a.component AND e.kind = 'top' AND e.rank = a.rank "
                    "WHERE a.site = ? AND a.component = ? ORDER BY a.rank", (site, c))
            ]  # fmt: skip
            return JSONResponse(out)

    def bad_database(request, exc):
        """A value in harvest.db that is not what pdctl writes (a hostile or foreign file):
        a 4xx that says so, never a 500."""
        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return JSONResponse(
            {"detail": f"harvest.db does not hold what pdctl writes ({what})"}, status_code=422
        )

    def bad_number(request, exc):
        return JSONResponse({"detail": f"a number out of range ({exc})"}, status_code=400)

    def http_error(request, exc):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    from starlette.middleware import Middleware

    return Starlette(
        middleware=[Middleware(HostCheck, names=frozenset(n.lower() for n in names))],
        exception_handlers={
            HTTPException: http_error,
            OverflowError: bad_number,
            sqlite3.Error: bad_database,
            PdctlError: bad_database,
            ValueError: bad_database,
            TypeError: bad_database,
            KeyError: bad_database,
            AttributeError: bad_database,
        },
        routes=[
            Route("/", index),
            Route("/static/{name}", static),
            Route("/files/{path:path}", files),
            Route("/api/overview", overview),
            Route("/api/components", components),
            Route("/api/component/{site}/{c:int}", component),
            Route("/api/search", search),
            Route("/api/like/{site}/{c:int}", like),
            Route("/api/labels", labels),
            Route("/api/clusters", clusters),
            Route("/api/cluster/{k:int}", one_cluster),
            Route("/api/cluster_of/{site}/{c:int}", cluster_of),
            Route("/api/attributions/{site}/{c:int}", attributions),
        ],
    )


def check_port(host: str, port: int) -> None:
    """One line, exit 2, naming the flag: `--host` for a name that does not resolve or an
    address not on this machine, `--port` for a port that cannot be bound (in use,
    privileged)."""
    import errno

    if not 0 < port < 65536:
        raise PdctlError(f"--port: must be in [1, 65535], got {port}")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise PdctlError(f"--host: {host!r} is not an address to listen on ({why})") from None
    with socket.socket(family, kind, proto) as s:
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise PdctlError(
                    f"--host: {host!r} is not an address of this machine ({e.strerror})"
                ) from None
            raise PdctlError(f"--port: cannot listen on {host}:{port} ({e.strerror})") from None


def serve(project: Project, host: str, port: int) -> None:
    import uvicorn

    app = make_app(project, frozenset({host}))
    check_port(host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning")
