"""`pdctl cluster`: components grouped by how often they fire together, from harvest.db's
co-occurrence, written back into it (`db.amend`).

Method: average-linkage agglomerative clustering (scipy.cluster.hierarchy, UPGMA) on the
Jaccard distance 1 - |A and B| / |A or B| between the firing sets of two components (the
harvest's `cooc.jaccard`: CI above `decomp.ci_threshold` at the same position). The tree is cut
where the average pairwise Jaccard between two groups falls below `min_jaccard`, so every
cluster is a set of components whose firings overlap that much on average.

Why not the anchors' method: goodfire-ai/param-decomp (`param_decomp/clustering`) merges
components greedily by a description-length cost, recomputing each merged group's firing set
from the per-position memberships; harvest.db keeps co-occurrence counts, not memberships, and
average linkage on the same counts is the standard agglomerative method that needs nothing
more. Pairs the harvest did not keep (it keeps each component's `top_pairs` partners by
Jaccard, and with more than `--cooc-max` components counts pairs among the most often firing
only) count as Jaccard 0: they never pull a cluster together.

Which components: those that fired at least `min_count` times, at most `max_components` of them
(the most often firing): the linkage holds n(n-1)/2 distances. More than `MAX_CLUSTERED`
components to cluster is refused (one line naming --max-components and the memory they would
need), before any matrix is allocated.

With the clusters it writes what `browse` shows of each cluster of two or more
(`cluster_summary`, `summarize`): its top input tokens and one representative example, so a
page of clusters reads a row each; `cluster_meta.summary` says the table belongs to these
clusters (clusters written without it, by an earlier pdctl, are summarised by `browse` as it
shows them).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdctl.errors import PdctlError
from pdctl.harvest import db

MIN_JACCARD = 0.5
MAX_COMPONENTS = 8192  # 33.5M distances (268 MB of float64): the harvest's own --cooc-max
# The most components one clustering takes, whatever --max-components says: the similarity and
# distance matrices (n x n float64) and the linkage's condensed copy, 5 GiB at 16384 (60,000
# components would need 67 GiB)
MAX_CLUSTERED = 16384
METHOD = "average-linkage agglomerative clustering on Jaccard distance (scipy, UPGMA)"

SCHEMA = """
DROP TABLE IF EXISTS clusters;
DROP TABLE IF EXISTS cluster_meta;
DROP TABLE IF EXISTS cluster_summary;
CREATE TABLE clusters (cluster INTEGER NOT NULL, site TEXT NOT NULL, component INTEGER NOT NULL,
  PRIMARY KEY (site, component));
CREATE INDEX clusters_by_cluster ON clusters (cluster);
CREATE TABLE cluster_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE cluster_summary (cluster INTEGER PRIMARY KEY, tokens TEXT NOT NULL, site TEXT,
  component INTEGER, kind TEXT, rank INTEGER, members_firing INTEGER);
"""
SUMMARY_VERSION = 1  # cluster_meta.summary: cluster_summary describes these clusters
TOP_TOKENS = 8  # a cluster's input tokens kept in its summary


@dataclass
class Result:
    path: Path
    n_components: int  # clustered
    n_clusters: int  # with two or more members
    n_singletons: int
    largest: int


def check_options(min_jaccard: float, min_count: int, max_components: int) -> None:
    """One line naming the flag for a value no clustering takes."""
    if not (0.0 < min_jaccard <= 1.0):  # also refuses nan
        raise PdctlError(f"--min-jaccard: must be in (0, 1], got {min_jaccard}")
    if min_count < 1:
        raise PdctlError(f"--min-count: must be >= 1, got {min_count}")
    if max_components < 1:
        raise PdctlError(f"--max-components: must be >= 1, got {max_components}")


def similarity(n: int, pairs: list[tuple[int, int, float]]) -> np.ndarray:
    """(n, n) Jaccard similarity from (i, j, jaccard) rows (either order; a pair given twice
    keeps the larger), 1 on the diagonal, 0 for a pair not given."""
    S = np.zeros((n, n), np.float64)
    if pairs:
        i, j, v = (np.asarray(a) for a in zip(*pairs, strict=True))
        v = np.clip(v.astype(np.float64), 0.0, 1.0)
        np.maximum.at(S, (i.astype(np.int64), j.astype(np.int64)), v)
        S = np.maximum(S, S.T)
    np.fill_diagonal(S, 1.0)
    return S


def labels(S: np.ndarray, min_jaccard: float) -> np.ndarray:
    """Cluster of each row of the similarity matrix `S` (average linkage on 1 - S, cut at
    distance 1 - min_jaccard), numbered 0.. by size (largest first), ties by the lowest
    member."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    n = S.shape[0]
    if n == 0:
        return np.zeros(0, np.int64)
    if n == 1:
        return np.zeros(1, np.int64)
    D = 1.0 - S
    np.fill_diagonal(D, 0.0)
    Z = linkage(squareform(D, checks=False), method="average")
    # a merge at average distance exactly 1 - min_jaccard is kept (the cut is inclusive); a
    # tiny slack absorbs the float rounding of an average of equal similarities
    raw = fcluster(Z, t=1.0 - min_jaccard + 1e-12, criterion="distance")
    ids, first, size = np.unique(raw, return_index=True, return_counts=True)
    order = np.lexsort((first, -size))
    renumber = np.empty(ids.max() + 1, np.int64)
    renumber[ids[order]] = np.arange(ids.size)
    return renumber[raw]


def _components(con: sqlite3.Connection, min_count: int, max_components: int):
    """[(site, component, count)] to cluster: fired >= min_count times, the most often firing
    first (ties: site order, component), at most max_components; and whether any was left out."""
    rows = con.execute(
        "SELECT c.site, c.component, c.count FROM components c JOIN sites s ON s.site = c.site "
        "WHERE c.count >= ? ORDER BY c.count DESC, s.idx, c.component",
        (min_count,),
    ).fetchall()
    return rows[:max_components], len(rows) > max_components


def _pairs(con: sqlite3.Connection, index: dict[tuple[str, int], int]) -> list:
    """(i, j, jaccard) for the cooc rows between two components of `index`; a Jaccard that is
    not a number in [0, 1] (NaN, text: a database pdctl did not write) is one line, not a
    traceback from the linkage."""
    pairs = []
    for s, c, os_, oc, jac in con.execute(
        "SELECT site, component, other_site, other_component, jaccard FROM cooc"
    ):
        a, b = index.get((s, c)), index.get((os_, oc))
        if a is None or b is None or a == b:
            continue
        try:
            v = float(jac)
        except (TypeError, ValueError):
            v = float("nan")
        if not 0.0 <= v <= 1.0:  # also nan
            raise PdctlError(
                f"cluster: harvest.db's cooc.jaccard of {s} #{c} and {os_} #{oc} is {jac!r}, "
                "not a number in [0, 1] (a database pdctl did not write): run `pdctl harvest` "
                "again"
            )
        pairs.append((a, b, v))
    return pairs


def check_size(n: int) -> None:
    """One line naming --max-components when clustering `n` components would need more memory
    than `MAX_CLUSTERED` components do (the similarity and distance matrices: n x n float64
    each, and the linkage's condensed copy)."""
    if n > MAX_CLUSTERED:
        need = _matrix_bytes(n) / 2**30
        cap = _matrix_bytes(MAX_CLUSTERED) / 2**30
        raise PdctlError(
            f"--max-components: {n} components to cluster would need {need:.1f} GiB for the "
            f"distance matrices; at most {MAX_CLUSTERED} ({cap:.1f} GiB): lower "
            "--max-components or raise --min-count"
        )


def _matrix_bytes(n: int) -> float:
    return 8.0 * (2 * n * n + n * (n - 1) / 2)


def compute(
    con: sqlite3.Connection, min_jaccard: float, min_count: int, max_components: int
) -> tuple[list[tuple[str, int]], np.ndarray, np.ndarray, bool]:
    """(members [(site, component)], their cluster labels, their similarity matrix, whether
    components were left out by max_components), from an open harvest.db."""
    meta = db.read_pairs(con)
    says = str(meta.get("cooc", ""))
    if says.startswith("skipped"):
        raise PdctlError(
            f"cluster: this harvest has no co-occurrence ({says}): run `pdctl harvest` again "
            "with a larger --cooc-max"
        )
    rows, cut = _components(con, min_count, max_components)
    check_size(len(rows))  # before any n x n matrix
    members = [(str(s), int(c)) for s, c, _ in rows]
    index = {m: i for i, m in enumerate(members)}
    pairs = _pairs(con, index)
    S = similarity(len(members), pairs)
    return members, labels(S, min_jaccard), S, cut


def cluster(
    project: Any,
    min_jaccard: float = MIN_JACCARD,
    min_count: int = 1,
    max_components: int = MAX_COMPONENTS,
) -> Result:
    """Cluster the run's harvest and write the clusters into its harvest.db (holding the run
    directory's lock, as `pdctl harvest` does)."""
    from pdctl.harvest.run import harvest_dir
    from pdctl.project import now

    check_options(min_jaccard, min_count, max_components)
    path = harvest_dir(project) / "harvest.db"
    with project.locked():
        con = db.open_readonly(path)
        try:
            members, lab, _, cut = compute(con, min_jaccard, min_count, max_components)
        finally:
            con.close()
        if not members:
            raise PdctlError(
                f"cluster: no component of this harvest fired {min_count} times or more "
                "(--min-count)"
            )
        sizes = np.bincount(lab)
        meta = {"method": METHOD, "min_jaccard": min_jaccard, "min_count": min_count,
                "max_components": max_components, "components": len(members),
                "left_out": cut, "clusters": int((sizes > 1).sum()), "created": now(),
                "summary": SUMMARY_VERSION}  # fmt: skip

        def write(dst: sqlite3.Connection) -> None:
            dst.executescript(SCHEMA)
            dst.executemany(
                "INSERT INTO clusters VALUES (?, ?, ?)",
                [(int(k), s, c) for (s, c), k in zip(members, lab, strict=True)],
            )
            dst.executemany(
                "INSERT INTO cluster_meta VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in meta.items()],
            )
            got = summarize(dst, [int(k) for k in np.flatnonzero(sizes > 1)])
            dst.executemany(
                "INSERT INTO cluster_summary VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(k, json.dumps(v["tokens"]), *(v["example"] or (None,) * 5))
                 for k, v in got.items()],
            )  # fmt: skip

        db.amend(path, write, "cluster")
    return Result(path, len(members), int((sizes > 1).sum()), int((sizes == 1).sum()),
                  int(sizes.max()))  # fmt: skip


def summarize(con: sqlite3.Connection, ids: list[int]) -> dict[int, dict[str, Any]]:
    """What `browse` shows of clusters `ids` beyond their members, from an open harvest.db
    holding them: {cluster: {"tokens": [[token, count, members]], the `TOP_TOKENS` input tokens
    the members fired on most (their `tokens` counts summed; ties by token id; members: how
    many have it among theirs), "example": [site, component, kind, rank, members_firing] or
    None}}. The example is the firing position (CI above the harvest's threshold: a top
    example of a component that fired fewer times than it keeps may not fire) found among the
    most members' top and sampled examples (ties: the larger CI there, then the earlier
    position), as the member with the largest CI there holds it; members_firing: how many
    members' examples fire there."""
    out: dict[int, dict[str, Any]] = {int(k): {"tokens": [], "example": None} for k in ids}
    ids = list(out)
    threshold = db.read_pairs(con).get("threshold", 0.0)
    if not isinstance(threshold, int | float):
        raise PdctlError(f"harvest.db's meta.threshold is {threshold!r}, not a number")
    for i in range(0, len(ids), 500):  # under SQLite's limit on a statement's parameters
        part = ids[i : i + 500]
        marks = ", ".join("?" * len(part))
        sums: dict[int, dict[int, list[int]]] = {}
        for k, t, n in con.execute(
            "SELECT k.cluster, t.token, t.count FROM clusters k JOIN tokens t ON "
            "t.site = k.site AND t.component = k.component AND t.kind = 'count' "
            f"WHERE k.cluster IN ({marks})", part):  # fmt: skip
            got = sums.setdefault(k, {}).setdefault(t, [0, 0])
            got[0] += n
            got[1] += 1
        for k, by in sums.items():
            best = sorted(by.items(), key=lambda x: (-x[1][0], x[0]))[:TOP_TOKENS]
            out[k]["tokens"] = [[t, n, m] for t, (n, m) in best]
        seen: dict[int, dict[int, list]] = {}  # cluster -> position -> [members, best row]
        for k, s, c, kind, rank, ci, pos in con.execute(
            "SELECT k.cluster, e.site, e.component, e.kind, e.rank, e.ci, e.position FROM "
            "clusters k JOIN examples e ON e.site = k.site AND e.component = k.component "
            f"WHERE k.cluster IN ({marks}) AND e.ci > ?", (*part, threshold)):  # fmt: skip
            at = seen.setdefault(k, {}).setdefault(pos, [set(), None])
            at[0].add((s, c))
            if at[1] is None or ci > at[1][4]:
                at[1] = (s, c, kind, rank, ci)
        for k, by_pos in seen.items():
            _, (who, (s, c, kind, rank, _)) = min(
                by_pos.items(), key=lambda x: (-len(x[1][0]), -x[1][1][4], x[0])
            )
            out[k]["example"] = [s, c, kind, rank, len(who)]
    return out


def read(con: sqlite3.Connection) -> dict[int, list[tuple[str, int]]] | None:
    """{cluster: [(site, component)]} from an open harvest.db (members in site order, then
    component); None when `pdctl cluster` has not run on it."""
    if not db.has_table(con, "clusters"):
        return None
    out: dict[int, list[tuple[str, int]]] = {}
    for k, s, c in con.execute(
        "SELECT k.cluster, k.site, k.component FROM clusters k JOIN sites s ON s.site = k.site "
        "ORDER BY k.cluster, s.idx, k.component"
    ):
        out.setdefault(int(k), []).append((str(s), int(c)))
    return out


def figure_data(path: Path, max_shown: int = 200) -> tuple[np.ndarray, list[str], list[int]] | None:
    """For the report's cluster figure: (Jaccard matrix of the members of the clusters with two
    or more members, largest clusters first, at most `max_shown` components; their labels
    "site #c"; each shown cluster's size), or None when the harvest has no clusters."""
    con = db.open_readonly(path)
    try:
        got = read(con)
        if not got:
            return None
        shown: list[tuple[str, int]] = []
        sizes = []
        for k in sorted(got):
            m = got[k]
            if len(m) < 2 or len(shown) + len(m) > max_shown:
                continue
            shown.extend(m)
            sizes.append(len(m))
        index = {m: i for i, m in enumerate(shown)}
        pairs = _pairs(con, index)
    finally:
        con.close()
    if not shown:
        return None
    return similarity(len(shown), pairs), [f"{s} #{c}" for s, c in shown], sizes
