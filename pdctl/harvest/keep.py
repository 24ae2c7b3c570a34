"""What a new `pdctl harvest` keeps of the harvest.db it replaces.

Later commands add tables to a finished harvest.db (`db.amend`); a harvest writes the file
afresh, so each of them is dealt with here, and one line says what happened to it:
- `labels` (`pdctl interp import` / `score`): the user's work, often paid LLM calls. When the
  old database describes the same decomposition as the new one (`same_decomposition`: the same
  run id, stage and checkpoint step in `meta`), its rows of components the new harvest has are
  written into the new database in the same atomic write (`db.write(labels=...)`). Otherwise
  they describe other components and are not carried: before the old database is replaced they
  are saved beside it, as a JSONL file `pdctl interp import` reads back
  (`labels-<stage>-<step>-<run id>.jsonl`), as they are also when some of them name components
  the new harvest lacks.
- `clusters` / `cluster_meta` (`pdctl cluster`) and `attr_*` (`pdctl attributions`): computed
  from the old harvest's statistics, so stale: not carried; the line names the commands to run
  again, with the options they ran with.
No old database, or one without those tables: nothing kept and nothing said.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdctl.errors import PdctlError
from pdctl.harvest import db

SAME = ("run_id", "stage", "step")  # the meta keys that name the decomposition harvested
Labels = dict[tuple[str, int], dict[str, Any]]


@dataclass
class Old:
    """What a new harvest needs of the database it replaces."""

    meta: dict[str, Any]
    labels: Labels
    tables: set[str]  # tables added after the harvest (not `db.HARVEST_TABLES`, not `labels`)
    cluster_meta: dict[str, Any] = field(default_factory=dict)
    attr_meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Kept:
    labels: Labels  # to write into the new database
    lines: list[str]  # what to tell the user, one line each


def read_old(path: Path) -> Old | None:
    """The database at `path`, read leniently (another schema version too, so its labels are
    not lost); None when there is none or it is not an SQLite database holding them."""
    if not path.is_file():
        return None
    try:
        con = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error:
        return None
    try:
        q = "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        tables = {name for (name,) in con.execute(q)}

        def pairs(table: str) -> dict[str, Any]:
            return db.read_pairs(con, table, lenient=True) if table in tables else {}

        return Old(
            meta=pairs("meta"),
            labels=db.read_labels(con),
            tables=tables - set(db.HARVEST_TABLES) - {"labels"},
            cluster_meta=pairs("cluster_meta"),
            attr_meta=pairs("attr_meta"),
        )
    except sqlite3.DatabaseError:
        return None
    finally:
        con.close()


def same_decomposition(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Both harvests read the same checkpoint of the same run (unknown counts as another)."""
    return all(old.get(k) is not None and old.get(k) == new.get(k) for k in SAME)


def describe(meta: dict[str, Any]) -> str:
    return f"{meta.get('stage')} checkpoint {meta.get('step')} of run {meta.get('run_id')}"


def labels_jsonl(labels: Labels) -> bytes:
    """`labels` as a file `pdctl interp import` reads (`interp.labels`): one object a line
    naming its component by `site`, `component` (and `key`) with every label field."""
    return "".join(
        json.dumps({"key": f"{s}:{c}", "site": s, "component": c,
                    **{k: row.get(k) for k in db.LABEL_FIELDS}}, ensure_ascii=False) + "\n"
        for (s, c), row in labels.items()
    ).encode("utf-8")  # fmt: skip


def save_labels(directory: Path, meta: dict[str, Any], labels: Labels) -> Path:
    """`labels` (of a harvest with `meta`) written into `directory`, atomically, under a name
    no other labels hold: `labels-<stage>-<step>-<run id>.jsonl` (then -2, -3, ...)."""
    from pdctl.files import atomic_write, refuse_links

    data = labels_jsonl(labels)
    # the old database's values, in a file name: nothing but letters, digits, _ and .
    base = "-".join(re.sub(r"[^\w.]", "_", str(meta.get(k)), flags=re.ASCII)
                    for k in ("stage", "step", "run_id"))  # fmt: skip
    n = 1
    while True:
        path = directory / f"labels-{base}{'' if n == 1 else f'-{n}'}.jsonl"
        refuse_links(path)
        if not path.exists():
            break
        if path.is_file() and path.read_bytes() == data:
            return path  # saved before (a harvest that failed after saving them)
        n += 1
    try:
        atomic_write(path, data)
    except OSError as e:
        raise PdctlError(
            f"harvest: cannot save the labels of the harvest.db it would replace to {path} "
            f"({e.strerror or e}); nothing was replaced: make room and run `pdctl harvest` "
            "again with the same options"
        ) from None
    return path


def _option(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def _rerun(old: Old) -> tuple[list[str], list[str]]:
    """(what the added tables hold, the commands that made them), for the derived tables."""
    what, commands = [], []
    if old.tables & {"clusters", "cluster_meta"}:
        what.append("clusters")
        flags = {"--min-jaccard": "min_jaccard", "--min-count": "min_count",
                 "--max-components": "max_components"}  # fmt: skip
        commands.append("pdctl cluster" + "".join(
            f" {f} {_option(old.cluster_meta[k])}" for f, k in flags.items()
            if k in old.cluster_meta))  # fmt: skip
    if any(t.startswith("attr_") for t in old.tables):
        what.append("attributions")
        flags = {"--components": "components", "--top": "top"}
        commands.append("pdctl attributions" + "".join(
            f" {f} {_option(old.attr_meta[k])}" for f, k in flags.items()
            if k in old.attr_meta))  # fmt: skip
    known = {"clusters", "cluster_meta", "cluster_summary"}
    what += [f"table {t}" for t in sorted(old.tables)
             if t not in known and not t.startswith("attr_")]  # fmt: skip
    return what, commands


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def keep(path: Path, meta: dict[str, Any], sites: dict[str, int]) -> Kept:
    """What the harvest with `meta` and sites {site: C} about to be written at `path` keeps of
    the database there (see the module); labels it does not carry are saved first."""
    old = read_old(path)
    if old is None:
        return Kept({}, [])
    lines = []
    carried: Labels = {}
    if old.labels:
        n = len(old.labels)
        if same_decomposition(old.meta, meta):
            carried = {(s, c): row for (s, c), row in old.labels.items()
                       if s in sites and 0 <= c < sites[s]}  # fmt: skip
            line = (f"kept the {n} labels of the harvest.db it replaces (the same "
                    f"decomposition: {describe(meta)})")  # fmt: skip
            if len(carried) < n:
                saved = save_labels(path.parent, old.meta, old.labels)
                line = (f"kept {len(carried)} of the {n} labels of the harvest.db it replaces; "
                        f"{n - len(carried)} name components this harvest does not have: all "
                        f"{n} saved to {saved}")  # fmt: skip
        else:
            saved = save_labels(path.parent, old.meta, old.labels)
            line = (f"did not keep the {n} labels of the harvest.db it replaces: they describe "
                    f"{describe(old.meta)}, this harvest {describe(meta)}; saved to {saved} "
                    "(`pdctl interp import` reads it)")  # fmt: skip
        lines.append(line)
    what, commands = _rerun(old)
    if what:
        again = f": run {_and([f'`{c}`' for c in commands])} again" if commands else ""
        lines.append(f"dropped the {_and(what)} of the harvest.db it replaces (computed from "
                     f"its statistics){again}")  # fmt: skip
    return Kept(carried, lines)
