"""`pdctl interp import`: a JSONL file of labels into harvest.db's `labels` table.

One JSON object a line (blank lines are skipped), naming its component by `site` and
`component` (or `key`, "site:component", as exported), with:
  label       a non-empty string (a line whose label is null is an unlabelled record: skipped)
  reasoning   optional string
  confidence  optional number in [0, 1]
  detection   optional number in [0, 1] (a score, as `pdctl interp score` computes)
  fuzzing     optional number in [0, 1]
  source      optional string (who labelled it: a model's name, a person)
Every other key is ignored, so an exported components.jsonl with its `label` fields filled in
is a labels file. A component named twice, an unknown site or component, or a value of the
wrong type is refused with one line naming the file, the line and the key; nothing is written.
Labels already in the database for other components are kept; a component's new label replaces
its old one (and its old scores, unless the line gives scores or the label is unchanged).
"""

from __future__ import annotations

import errno
import json
import math
import os
import sqlite3
import stat
from pathlib import Path
from typing import Any

from pdctl.errors import PdctlError
from pdctl.harvest import db

MAX_FILE_BYTES = 1 << 30  # 1 GiB: the most pdctl reads of a labels, trials or answers file
SCORES = ("confidence", "detection", "fuzzing")
TEXTS = ("reasoning", "source")


def read_bytes(path: Path, nofollow: bool = False) -> bytes:
    """A regular file's bytes, checked before anything is read: a FIFO, a device or a socket
    (which could block or never end) and a file over MAX_FILE_BYTES are refused in one line;
    with `nofollow`, so is a symlink. FileNotFoundError when there is none."""
    from pdctl.files import symlink_error

    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP and nofollow:
            raise symlink_error(Path(path)) from None
        raise PdctlError(f"{path}: cannot read it ({e.strerror})") from None
    cap = f"{MAX_FILE_BYTES >> 30} GiB"
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise PdctlError(f"{path}: is a directory, not a JSONL file")
        if not stat.S_ISREG(st.st_mode):
            raise PdctlError(f"{path}: is not a regular file (a FIFO, device or socket); pdctl "
                             "reads JSONL only from regular files")  # fmt: skip
        if st.st_size > MAX_FILE_BYTES:
            raise PdctlError(f"{path}: {st.st_size} bytes, over the {cap} pdctl reads of a "
                             "JSONL file (split it)")  # fmt: skip
        os.set_blocking(fd, True)
        chunks, n = [], 0
        while chunk := os.read(fd, 1 << 20):
            n += len(chunk)
            if n > MAX_FILE_BYTES:
                raise PdctlError(f"{path}: over the {cap} pdctl reads of a JSONL file (split it)")
            chunks.append(chunk)
    except OSError as e:
        raise PdctlError(f"{path}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PdctlError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def loads(line: str | bytes) -> Any:
    """json.loads, with nesting too deep for Python's stack a ValueError like any bad JSON."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; one line naming the first bad one."""
    try:
        text = decode(read_bytes(path), path)
    except FileNotFoundError:
        raise PdctlError(f"{path}: no such file") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = loads(line)
        except json.JSONDecodeError as e:
            raise PdctlError(f"{path} line {n}: not JSON ({e.msg} at column {e.colno})") from None
        except ValueError as e:
            raise PdctlError(f"{path} line {n}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise PdctlError(f"{path} line {n}: expected a JSON object, got {type(obj).__name__}")
        out.append((n, obj))
    return out


def _unicode(v: str, key: str, where: str) -> str:
    """`v`, refused in one line when it holds a lone surrogate (not Unicode text: no UTF-8 file
    or database can hold it)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PdctlError(f"{where}: {key}: not valid Unicode (a lone surrogate at character "
                         f"{e.start})") from None  # fmt: skip
    return v


def component_of(obj: dict[str, Any], where: str, known: dict[str, int]) -> tuple[str, int]:
    """(site, component) a line names, checked against the harvest's sites {site: C}."""
    if "site" in obj or "component" in obj:
        site, c = obj.get("site"), obj.get("component")
    elif isinstance(obj.get("key"), str) and ":" in obj["key"]:
        site, _, c = obj["key"].rpartition(":")
        c = int(c) if c.isdigit() else c
    else:
        raise PdctlError(f'{where}: site and component: missing (or key: "site:component")')
    if not isinstance(site, str):
        raise PdctlError(f"{where}: site: must be a string, got {site!r}")
    if site not in known:
        raise PdctlError(f"{where}: site: no site {site!r} in the harvest")
    if isinstance(c, bool) or not isinstance(c, int):
        raise PdctlError(f"{where}: component: must be an integer, got {c!r}")
    if not 0 <= c < known[site]:
        raise PdctlError(f"{where}: component: {c} is not in [0, {known[site]}) of {site!r}")
    return site, c


def _unit(v: Any, key: str, where: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise PdctlError(f"{where}: {key}: must be a number in [0, 1], got {v!r}")
    if not 0 <= v <= 1:
        raise PdctlError(f"{where}: {key}: must be in [0, 1], got {v!r}")
    return float(v)


def parse(path: Path, known: dict[str, int]) -> dict[tuple[str, int], dict[str, Any]]:
    """{(site, component): label fields} from the file (see the module)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for n, obj in read_jsonl(path):
        where = f"{path} line {n}"
        key = component_of(obj, where, known)
        label = obj.get("label")
        if label is None:
            continue
        if not isinstance(label, str) or not label.strip():
            raise PdctlError(f"{where}: label: must be a non-empty string, got {label!r}")
        if key in out:
            raise PdctlError(f"{where}: {key[0]}:{key[1]} is labelled twice in the file")
        row: dict[str, Any] = {"label": _unicode(label, "label", where)}
        for k in TEXTS:
            v = obj.get(k)
            if v is not None and not isinstance(v, str):
                raise PdctlError(f"{where}: {k}: must be a string, got {v!r}")
            row[k] = v if v is None else _unicode(v, k, where)
        for k in SCORES:
            row[k] = _unit(obj.get(k), k, where)
        out[key] = row
    if not out:
        raise PdctlError(f'{path}: no labels in it (each line needs a non-empty "label")')
    return out


def sites(con: sqlite3.Connection) -> dict[str, int]:
    return {s: C for s, C in con.execute("SELECT site, C FROM sites ORDER BY idx")}


def merge(
    old: dict[tuple[str, int], dict[str, Any]], new: dict[tuple[str, int], dict[str, Any]]
) -> dict[tuple[str, int], dict[str, Any]]:
    """`old` with `new`'s components replaced: a changed label drops the old scores the new
    line does not give; an unchanged label keeps them."""
    out = dict(old)
    for key, row in new.items():
        prev = old.get(key)
        row = dict(row)
        if prev is not None and prev["label"] == row["label"]:
            for k in ("detection", "fuzzing"):
                if row.get(k) is None:
                    row[k] = prev.get(k)
        out[key] = row
    return out


def import_labels(path: Path, file: Path) -> tuple[int, int]:
    """Read `file` into harvest.db at `path`: (labels read, labels now in the database)."""
    con = db.open_readonly(path)
    try:
        new = parse(file, sites(con))
        old = db.read_labels(con)
    finally:
        con.close()
    merged = merge(old, new)
    db.replace_labels(path, merged)
    return len(new), len(merged)
