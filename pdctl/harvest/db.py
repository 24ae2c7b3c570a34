"""harvest.db: the SQLite file a harvest writes and `browse` reads.

Written whole into `harvest.db.tmp` next to it and renamed over `harvest.db` when complete, so
a reader sees the previous harvest or the new one, never a part; the file is never changed in
place after that, so readers open it immutable (`open_readonly`: no lock, no `-wal` / `-shm` /
journal file written beside it, which also works in a directory the reader cannot write).
`meta.schema_version` says which layout this is; a reader refuses another version, or a file
without pdctl's tables, with one line.

Tables (component = index within its site; "global" = index over all sites in site order):
  meta(key, value)                        schema_version, run_id, stage, step, n_positions, ...
  sites(site, idx, C, offset, l0, alive)  one row per decomposed site, in the run's order
  components(site, component, count, frequency, mean_ci, max_ci, hist, v_norm, u_norm)
                                          hist: JSON list; norms of V[:, c] and U[c, :]
  examples(site, component, kind, rank, ci, position, tokens, cis)       kind: top | sample
  cooc(site, component, other_site, other_component, count, precision, recall, jaccard, pmi)
  tokens(site, component, kind, token, count, pmi)                       kind: count | pmi
  toy_features(site, component, feature, ci)                             toys only
  effects(site, component, kind, rank, token, nats)   LMs: kind raised | lowered (`effect`)
  site_summary(site, frequency_hist)      what `browse`'s overview draws per site: its components
                                          by firing frequency (`FREQUENCY_EDGES`), a JSON list;
                                          optional (not in `TABLES`): a harvest.db written
                                          before it has none, and `site_summary` computes the
                                          same from `components` (one pass, read-only)

Added afterwards by other commands (`amend`: a whole new file renamed over the old one, as the
harvest writes it), absent until they run (readers treat a missing table as empty):
  labels(site, component, label, reasoning, confidence, detection, fuzzing, source)
                                                          `pdctl interp import` / `score`
  clusters(cluster, site, component), cluster_meta(key, value)         `pdctl cluster`
  attr_inputs(site, component, offset, attr)                           `pdctl attributions`
  attr_sources(site, component, kind, rank, source_site, source_component, attr)
  attr_examples(site, component, rank, position, attrs), attr_meta(key, value)

What a new harvest keeps of the database it replaces (`keep`, one line said for each table not
kept): the labels, written in the same atomic write (`write(labels=...)`), when the old database
describes the same decomposition (the same run, stage and checkpoint step in `meta`), else saved
beside it in a file `pdctl interp import` reads; never the clusters or attributions, which were
computed from the old harvest's statistics (the line names the commands to run again).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

# (the constants from the numpy reference: reading a harvest.db imports no JAX)
from pdctl.harvest.reference import BINS, SUM_SCALE

if TYPE_CHECKING:
    from pdctl.harvest.accumulate import Harvest

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE sites (site TEXT PRIMARY KEY, idx INTEGER NOT NULL, C INTEGER NOT NULL,
  offset INTEGER NOT NULL, l0 REAL NOT NULL, alive INTEGER NOT NULL);
CREATE TABLE components (site TEXT NOT NULL, component INTEGER NOT NULL, count INTEGER NOT NULL,
  frequency REAL NOT NULL, mean_ci REAL NOT NULL, max_ci REAL NOT NULL, hist TEXT NOT NULL,
  v_norm REAL, u_norm REAL, PRIMARY KEY (site, component));
CREATE TABLE examples (site TEXT NOT NULL, component INTEGER NOT NULL, kind TEXT NOT NULL,
  rank INTEGER NOT NULL, ci REAL NOT NULL, position INTEGER NOT NULL, tokens TEXT NOT NULL,
  cis TEXT NOT NULL, PRIMARY KEY (site, component, kind, rank));
CREATE TABLE cooc (site TEXT NOT NULL, component INTEGER NOT NULL, other_site TEXT NOT NULL,
  other_component INTEGER NOT NULL, count INTEGER NOT NULL, precision REAL NOT NULL,
  recall REAL NOT NULL, jaccard REAL NOT NULL, pmi REAL NOT NULL);
CREATE INDEX cooc_by_component ON cooc (site, component);
CREATE TABLE tokens (site TEXT NOT NULL, component INTEGER NOT NULL, kind TEXT NOT NULL,
  token INTEGER NOT NULL, count INTEGER NOT NULL, pmi REAL NOT NULL);
CREATE INDEX tokens_by_component ON tokens (site, component);
CREATE INDEX tokens_by_token ON tokens (token);
CREATE TABLE toy_features (site TEXT NOT NULL, component INTEGER NOT NULL,
  feature INTEGER NOT NULL, ci REAL NOT NULL);
CREATE TABLE effects (site TEXT NOT NULL, component INTEGER NOT NULL, kind TEXT NOT NULL,
  rank INTEGER NOT NULL, token INTEGER NOT NULL, nats REAL NOT NULL);
CREATE INDEX effects_by_component ON effects (site, component);
"""

TABLES = re.findall(r"CREATE TABLE (\w+)", SCHEMA)  # what a harvest.db must hold

# Written by every harvest since the whole-model browser, but not required: an older
# harvest.db without them still opens (`site_summary` computes what they hold).
SUMMARY_SCHEMA = """
CREATE TABLE site_summary (site TEXT PRIMARY KEY, frequency_hist TEXT NOT NULL);
"""
HARVEST_TABLES = (*TABLES, *re.findall(r"CREATE TABLE (\w+)", SUMMARY_SCHEMA))  # all it writes

# A site's components by firing frequency, in decades: frequency 0 (dead), then (0, 1e-4],
# (1e-4, 1e-3], ..., (0.1, 1]
FREQUENCY_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
FREQUENCY_LABELS = ("0", "≤1e-4", "≤1e-3", "≤1e-2", "≤0.1", "≤1")


def _cooc_says(h: Harvest) -> str:
    index = getattr(h, "cooc_index", None)
    if h.cooc is None:
        return f"skipped: {h.c_total} components > cooc_max {h.cooc_max}"
    if index is None:
        return "dense"
    return (f"among the {len(index)} most often firing of {h.c_total} components (a second "
            f"pass: {h.c_total} > cooc_max {h.cooc_max})")  # fmt: skip


def _r(x: float) -> float:
    """A float as SQLite stores it, rounded to float32's precision (stable text in JSON)."""
    return float(np.float32(x))


def _join(values: list) -> str:
    """`json.dumps` of a flat list of ints, or of finite floats (the same text: json's
    separator and each number's `repr`), without json's per-call overhead."""
    return "[" + ", ".join(map(repr, values)) + "]"


def _r32(a: np.ndarray) -> list:
    """`_r` of every element, as nested lists."""
    return np.asarray(a, np.float32).astype(np.float64).tolist()


def write(
    path: Path,
    h: Harvest,
    meta: dict[str, Any],
    toy_features: dict[str, np.ndarray] | None = None,
    norms: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    effects: dict[tuple[str, int], dict[str, list[tuple[int, float]]]] | None = None,
    top_pairs: int = 20,
    top_tokens: int = 20,
    labels: dict[tuple[str, int], dict[str, Any]] | None = None,
) -> None:
    """The whole database for accumulator `h`, atomically at `path`; `norms` {site: (|V[:, c]|,
    |U[c, :]|)} per component when known; `labels` (`read_labels`' form) in a labels table when
    given (those of the database it replaces: `keep`)."""
    from pdctl.errors import PdctlError

    check_side_files(path)  # the new file would inherit another program's -wal / -journal
    tmp = path.with_name(path.name + ".tmp")
    # SQLite's files beside the temporary one: removed (a link planted there goes, what it
    # points to is untouched), so SQLite creates each anew
    side = [tmp, *(Path(f"{tmp}{s}") for s in ("-journal", "-wal", "-shm"))]
    for p in side:
        p.unlink(missing_ok=True)
    try:
        _write(tmp, h, meta, toy_features, norms, effects, top_pairs, top_tokens, labels)
        os.replace(tmp, path)
    except (sqlite3.Error, OSError) as e:
        for p in side:
            p.unlink(missing_ok=True)
        raise PdctlError(
            f"harvest: cannot write {path} ({e}); the saved partial harvest is kept: make room "
            "and run `pdctl harvest` again with the same options"
        ) from None


def _write(tmp, h, meta, toy_features, norms, effects, top_pairs, top_tokens, labels) -> None:
    con = sqlite3.connect(tmp)
    try:
        con.executescript(SCHEMA)
        rows = {"schema_version": SCHEMA_VERSION, "bins": BINS, "threshold": h.threshold,
                "n_positions": h.n_positions, "cooc": _cooc_says(h), **meta}  # fmt: skip
        con.executemany(
            "INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in rows.items()]
        )
        con.executescript(SUMMARY_SCHEMA)
        offsets = h.offsets()
        where = {}  # global component -> (site, component)
        N = max(h.n_positions, 1)
        for idx, (s, C) in enumerate(h.sites.items()):
            st = h.stats[s]
            for c in range(C):
                where[offsets[s] + c] = (s, c)
            l0 = float(st.count.sum()) / N
            con.execute(
                "INSERT INTO sites VALUES (?, ?, ?, ?, ?, ?)",
                (s, idx, C, offsets[s], _r(l0), int((st.count > 0).sum())),
            )
            vn, un = (norms or {}).get(s, (None, None))
            hist = st.hist.tolist()
            freq = [_r(st.count[c] / N) for c in range(C)]
            con.executemany(
                "INSERT INTO components VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (s, c, int(st.count[c]), freq[c], _r(st.ci_sum[c] / SUM_SCALE / N),
                     _r(st.ci_max[c]), _join(hist[c]),
                     None if vn is None else _r(vn[c]), None if un is None else _r(un[c]))
                    for c in range(C)
                ],
            )  # fmt: skip
            # from the values stored (float32-rounded), as `site_summary` counts them
            con.execute("INSERT INTO site_summary VALUES (?, ?)", (s, _join(frequency_hist(freq))))
            for kind, top in (("top", st.top), ("sample", st.sample)):
                # whole arrays to Python at once (floats rounded to float32 as `_r` does)
                pos, ci = top.pos.tolist(), _r32(top.ci)
                win_tok, win_ci = np.asarray(top.win_tok).tolist(), _r32(top.win_ci)
                dump_ci = _join if np.isfinite(top.win_ci).all() else json.dumps
                ex = [(s, c, kind, rank, ci[rank][c], pos[rank][c],
                       _join(win_tok[rank][c]), dump_ci(win_ci[rank][c]))
                      for rank in range(len(pos)) for c in range(C)
                      if pos[rank][c] >= 0]  # fmt: skip
                con.executemany("INSERT INTO examples VALUES (?, ?, ?, ?, ?, ?, ?, ?)", ex)
        con.executemany(
            "INSERT INTO cooc VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(*where[a], *where[b], n, _r(p), _r(r), _r(j), _r(pmi))
             for a, b, n, p, r, j, pmi in h.cooc_rows(top_pairs)],
        )  # fmt: skip
        con.executemany(
            "INSERT INTO tokens VALUES (?, ?, ?, ?, ?, ?)",
            [(*where[c], kind, t, n, _r(pmi)) for c, t, n, pmi, kind in h.token_rows(top_tokens)],
        )
        for s, m in (toy_features or {}).items():  # (n_features, C) CI of one-hot inputs
            con.executemany(
                "INSERT INTO toy_features VALUES (?, ?, ?, ?)",
                [(s, c, f, _r(m[f, c])) for f in range(m.shape[0]) for c in range(m.shape[1])],
            )
        con.executemany(
            "INSERT INTO effects VALUES (?, ?, ?, ?, ?, ?)",
            [(s, c, kind, rank, tok, _r(nats))
             for (s, c), changes in (effects or {}).items()
             for kind, rows in changes.items()
             for rank, (tok, nats) in enumerate(rows)],
        )  # fmt: skip
        if labels:
            _insert_labels(con, labels)
        con.commit()
    finally:
        con.close()


def check_side_files(path: Path) -> None:
    """Refuse (one line) a harvest.db with a non-empty `-wal` or `-journal` beside it.

    pdctl never leaves either (it writes a whole new file and renames it over), so one there
    comes from another program that had the database open (a file handed over from another
    machine): a `-wal` holds committed changes not yet in the file, a `-journal` the undo of an
    unfinished one. An immutable reader ignores both, so it would read stale or torn pages, and
    a file renamed over `path` would inherit them: the next SQLite reader applies the old
    `-wal` / `-journal` to the new file and finds it malformed. Deleting them could lose the
    other program's changes, so pdctl refuses and says how to fold them in (SQLite's own
    recovery, with write access); an empty `-wal` or a `-shm` alone holds nothing and is left."""
    from pdctl.errors import PdctlError

    for suffix in ("-wal", "-journal"):
        side = Path(f"{path}{suffix}")
        try:
            size = side.lstat().st_size
        except FileNotFoundError:
            continue
        except OSError:
            size = 1
        if size or side.is_symlink():
            raise PdctlError(
                f"{path}: {side.name} lies beside it (left by a program that had the database "
                "open; pdctl would read around it and a new harvest.db would inherit it): fold "
                f"it in first with `sqlite3 {path} 'PRAGMA journal_mode=DELETE'`, then run this "
                "again"
            )


def open_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection; a database of another schema version, or with another
    program's `-wal` / `-journal` beside it (`check_side_files`), is refused."""
    from pdctl.errors import PdctlError

    if not path.is_file():
        raise PdctlError(f"{path}: no harvest here (run `pdctl harvest` first)")
    check_side_files(path)
    # immutable: SQLite reads the file and writes nothing (see the module)
    con = sqlite3.connect(f"{Path(path).absolute().as_uri()}?mode=ro&immutable=1", uri=True)
    try:
        (v,) = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except (sqlite3.DatabaseError, TypeError):
        con.close()
        raise PdctlError(f"{path}: not a pdctl harvest database") from None
    try:
        version = json.loads(v)
    except (ValueError, TypeError):
        version = v
    if version != SCHEMA_VERSION:
        con.close()
        raise PdctlError(
            f"{path}: harvest schema version {v}, this pdctl reads {SCHEMA_VERSION}: run "
            "`pdctl harvest` again"
        )
    missing = sorted(set(TABLES) - tables)
    if missing:
        con.close()
        raise PdctlError(
            f"{path}: not a pdctl harvest database (no table {', '.join(missing)}): run "
            "`pdctl harvest` again"
        )
    return con


# ---- the per-site summary (`browse`'s overview) ----------------------------------------------


def frequency_hist(freqs: list[float]) -> list[int]:
    """How many of `freqs` fall in each bin of `FREQUENCY_EDGES`: == 0, then (lo, hi] (a value
    outside [0, 1], or not a number, in none)."""
    out = [0] * len(FREQUENCY_EDGES)
    for f in freqs:
        if not isinstance(f, int | float):
            continue
        if f == 0:
            out[0] += 1
            continue
        for i in range(1, len(FREQUENCY_EDGES)):
            if FREQUENCY_EDGES[i - 1] < f <= FREQUENCY_EDGES[i]:
                out[i] += 1
                break
    return out


def site_summary(con: sqlite3.Connection) -> dict[str, list[int]]:
    """{site: components by firing frequency (`frequency_hist`)} of every site: from the
    `site_summary` table a harvest writes, or, for a harvest.db written before that table (or
    with it removed), computed from `components` in one grouped pass (what `browse` does once
    per file and keeps). A site without components is left out."""
    if has_table(con, "site_summary"):
        q = "SELECT site, frequency_hist FROM site_summary"
        return {str(s): [int(n) for n in json.loads(h)] for s, h in con.execute(q)}
    bins = ["sum(frequency = 0)"] + [
        f"sum(frequency > {lo!r} AND frequency <= {hi!r})"
        for lo, hi in itertools.pairwise(FREQUENCY_EDGES)
    ]
    q = f"SELECT site, {', '.join(bins)} FROM components GROUP BY site"
    return {str(r[0]): [int(n or 0) for n in r[1:]] for r in con.execute(q)}


# ---- labels (`pdctl interp import` / `score`) ------------------------------------------------
# An optional table, added to a finished harvest.db by `pdctl interp`: not in `TABLES` (a
# database without it is a harvest with no labels yet). The file is still never changed in
# place: `replace_labels` writes a copy holding the new table and renames it over the old one.

LABELS_SCHEMA = """
CREATE TABLE labels (site TEXT NOT NULL, component INTEGER NOT NULL, label TEXT NOT NULL,
  reasoning TEXT, confidence REAL, detection REAL, fuzzing REAL, source TEXT,
  PRIMARY KEY (site, component));
"""
LABEL_FIELDS = ("label", "reasoning", "confidence", "detection", "fuzzing", "source")


def read_labels(con: sqlite3.Connection) -> dict[tuple[str, int], dict[str, Any]]:
    """{(site, component): {label, reasoning, confidence, detection, fuzzing, source}}; empty
    when the database has no labels table."""
    if not has_table(con, "labels"):
        return {}
    cols = ", ".join(LABEL_FIELDS)
    return {
        (r[0], r[1]): dict(zip(LABEL_FIELDS, r[2:], strict=True))
        for r in con.execute(f"SELECT site, component, {cols} FROM labels ORDER BY rowid")
    }


def replace_labels(path: Path, labels: dict[tuple[str, int], dict[str, Any]]) -> None:
    """harvest.db at `path` with its labels table replaced by `labels` (every other table as
    it was), through `amend`: a reader sees the old file or the new one."""
    from pdctl.files import refuse_links

    refuse_links(path)

    def change(dst: sqlite3.Connection) -> None:
        dst.execute("DROP TABLE IF EXISTS labels")
        _insert_labels(dst, labels)

    amend(path, change, "the labels")


def _insert_labels(con: sqlite3.Connection, labels: dict[tuple[str, int], dict[str, Any]]) -> None:
    """A new labels table holding `labels`, in their order."""
    con.executescript(LABELS_SCHEMA)
    cols = ", ".join(LABEL_FIELDS)
    con.executemany(
        f"INSERT INTO labels (site, component, {cols}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [(s, c, *(row.get(k) for k in LABEL_FIELDS)) for (s, c), row in labels.items()],
    )


def read_meta(path: Path) -> dict[str, Any]:
    """harvest.db's `meta` table, opened read-only and closed again (`read_pairs`)."""
    con = open_readonly(path)
    try:
        return read_pairs(con)
    finally:
        con.close()


def read_pairs(
    con: sqlite3.Connection, table: str = "meta", lenient: bool = False
) -> dict[str, Any]:
    """A key/value table (`meta`, `cluster_meta`, `attr_meta`) as {key: value}, each value
    JSON-decoded; a value that is not JSON raises ValueError, or with `lenient` is kept as
    stored (a database of another version, read only to save what it holds)."""
    out = {}
    for k, v in con.execute(f"SELECT key, value FROM {table}"):
        try:
            out[k] = json.loads(v)
        except (TypeError, ValueError):
            if not lenient:
                raise
            out[k] = v
    return out


def has_table(con: sqlite3.Connection, name: str) -> bool:
    """Whether the database holds table `name` (one that a later command adds, `amend`)."""
    q = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
    return con.execute(q, (name,)).fetchone() is not None


def amend(path: Path, change: Callable[[sqlite3.Connection], None], what: str) -> None:
    """Add to a finished harvest.db: a copy of it (SQLite's online backup) changed by
    `change(con)` in one transaction, renamed over `path` whole (`files.atomic_output`), so a
    reader sees the old database or the new one, never a part, and a file it has open is never
    changed under it. A PdctlError from `change`, or a failed write, leaves `path` as it was;
    `what` names the command in the error line."""
    from pdctl.errors import PdctlError
    from pdctl.files import atomic_output

    src = open_readonly(path)
    tmp = None
    try:
        with atomic_output(path) as tmp:
            dst = sqlite3.connect(tmp)
            try:
                src.backup(dst)
                change(dst)
                dst.commit()
            finally:
                dst.close()
    except (sqlite3.Error, OSError) as e:
        raise PdctlError(f"{what}: cannot write {path} ({e}); it is left as it was") from None
    finally:
        src.close()
        if tmp is not None:
            Path(f"{tmp}-journal").unlink(missing_ok=True)
