"""`pdctl sweep status` and `pdctl sweep report`: the members' results, read from their own
`[state.train]`, one row per member and one per grid point (with its spread over seeds)."""

from __future__ import annotations

import statistics
from typing import Any

from pdctl.errors import PdctlError
from pdctl.registry import STAGES
from pdctl.sweep.spec import Member, Sweep, _fmt, short_keys


def member_row(sweep: Sweep, m: Member) -> dict[str, Any]:
    try:
        p = sweep.project(m)
    except PdctlError as e:
        return {"member": m.name, "point": m.point, "seed": m.seed, "status": f"unreadable: {e}"}
    status, stage = "done", None
    for s in STAGES:
        got = p.stage(s).get("status", "pending")
        if got not in ("done", "imported"):
            status, stage = got, s
            break
    ev = p.stage("train").get("eval") or {}
    errors = ev.get("ci_errors") or {}
    mmcs = ev.get("mmcs") or {}
    row: dict[str, Any] = {
        "member": m.name,
        "point": m.point,
        "seed": m.seed,
        "status": status if stage is None else f"{stage} {status}",
        "ci_errors": errors.get("total"),
        "min_mmcs": min(mmcs.values()) if mmcs else None,
        "l0": ev.get("l0") or {},
        "alive": ev.get("alive") or {},
        "error": p.stage(stage).get("error") if stage else None,
    }
    done = stage is None and "total" in errors
    row["success"] = (errors["total"] == 0) if done else None
    return row


def rows(sweep: Sweep) -> list[dict[str, Any]]:
    return [member_row(sweep, m) for m in sweep.members]


def by_point(sweep: Sweep, table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per grid point: its members' success fraction and metric spread."""
    out: dict[str, dict[str, Any]] = {}
    for m, r in zip(sweep.members, table, strict=True):
        label = sweep.point_label(m)
        g = out.setdefault(label, {"point": label, "members": 0, "finished": 0, "rows": []})
        g["members"] += 1
        if r.get("success") is not None:
            g["finished"] += 1
            g["rows"].append(r)
    for g in out.values():
        done = g.pop("rows")
        g["success"] = sum(bool(r["success"]) for r in done)
        for key, values in (
            ("ci_errors", [r["ci_errors"] for r in done]),
            ("min_mmcs", [r["min_mmcs"] for r in done if r["min_mmcs"] is not None]),
            ("l0", [sum(r["l0"].values()) for r in done if r["l0"]]),
        ):
            g[key] = _spread(values)
    return list(out.values())


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "min": min(values),
        "max": max(values),
    }


def _num(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) and not float(v).is_integer() else f"{v:g}"


def status_lines(sweep: Sweep, table: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    short = short_keys(list(sweep.grid))
    for r in table:
        point = ", ".join(f"{short.get(k, k)}={_fmt(v)}" for k, v in r["point"].items())
        l0 = " / ".join(f"{v:.3g}" for v in r.get("l0", {}).values()) or "-"
        alive = " / ".join(f"{v:g}" for v in r.get("alive", {}).values()) or "-"
        ok = {True: "yes", False: "no", None: "-"}[r.get("success")]
        out.append(
            [r["member"], point or "-", str(r["seed"]), r["status"], _num(r.get("ci_errors")),
             _num(r.get("min_mmcs")), l0, alive, ok]
        )  # fmt: skip
    return out


STATUS_HEADER = ["member", "grid point", "seed", "status", "CI errors", "min MMCS", "L0",
                 "alive", "success"]  # fmt: skip


def _pm(s: dict[str, float] | None, digits: int) -> str:
    if s is None:
        return "-"
    return (
        f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} "
        f"[{s['min']:.{digits}f}, {s['max']:.{digits}f}]"
    )


def report_markdown(sweep: Sweep, points: list[dict[str, Any]]) -> str:
    lines = [
        f"# Sweep {sweep.name}",
        "",
        f"Template `{sweep.template}`, seeds {sweep.seeds[0]}..{sweep.seeds[-1]}"
        + (f", grid over {', '.join(sweep.grid)}" if sweep.grid else "")
        + ". Success = 0 CI errors in total at the end of train; spreads are over the seeds "
        "that finished (mean ± std [min, max]).",
        "",
        "| grid point | finished | success | CI errors | min MMCS | L0 (sum over sites) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for g in points:
        frac = f"{g['success']}/{g['finished']}" if g["finished"] else "-"
        lines.append(
            f"| {g['point']} | {g['finished']}/{g['members']} | {frac} | "
            f"{_pm(g['ci_errors'], 1)} | {_pm(g['min_mmcs'], 4)} | {_pm(g['l0'], 3)} |"
        )
    return "\n".join(lines) + "\n"
