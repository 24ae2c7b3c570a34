"""The short texts `pdctl status` shows about a run's evaluation and report."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.registry import STAGES

DEFAULT_DIR = "report"  # <run>/report/ unless --out says otherwise
MANIFEST = "report.json"  # what a report wrote, and the stage state it was written from
INDEX = "index.html"


def _fmt(v: Any, spec: str) -> str:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return "?"
    return "nan" if not math.isfinite(v) else format(v, spec)


def _table(ev: Mapping[str, Any], key: str, stage: str) -> Mapping[str, Any]:
    """`eval.<key>`, a table of per-site numbers as pdctl writes it (absent: empty). A value
    that is not a table is a hand edit: an error naming it, as `project.check_state` does for
    the fields it checks. Numbers inside that are not numbers show as `?`."""
    value = ev.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise PdctlError(
            f"state.{stage}.eval.{key}: must be a table, got {shown} ([state.*] is written by "
            f"pdctl: restore it, or delete [state.{stage}] and rerun the stage)"
        )
    return value


def _numbers(table: Mapping[str, Any]) -> list[float]:
    return [v for v in table.values() if isinstance(v, int | float) and not isinstance(v, bool)]


def eval_summary(stage_state: Mapping[str, Any], stage: str = "train") -> str:
    """The final evaluation in a few words: toys `CI errors 0, min MMCS 0.999, L0 1.00/1.02`;
    LMs `CE 2.31 (target 2.25), KL ci 0.041 stoch 0.12 pgd 0.35, L0 mean 41.2` (pgd: the
    fresh-PGD KL, the robustness figure). Empty when there is none. `stage`
    names the `[state.<stage>]` table in the error a hand-edited one that is not a table of
    per-site numbers raises."""
    ev = stage_state.get("eval") or {}
    if not isinstance(ev, Mapping) or not ev:
        return ""
    if "ci_errors" in ev:
        errs = _table(ev, "ci_errors", stage)
        total = errs.get("total", sum(_numbers(errs)))
        parts = [f"CI errors {_fmt(total, '.0f')}"]
        mmcs = _numbers(_table(ev, "mmcs", stage))
        if mmcs:
            parts.append(f"min MMCS {_fmt(min(mmcs), '.3f')}")
        l0 = _numbers(_table(ev, "l0", stage))
        if l0:
            shown = (
                "/".join(_fmt(v, ".2f") for v in l0)
                if len(l0) <= 3
                else (f"mean {_fmt(sum(l0) / len(l0), '.2f')}")
            )
            parts.append(f"L0 {shown}")
        return ", ".join(parts)
    parts = []
    if "ce_ci_masked" in ev:
        target = f" (target {_fmt(ev['ce_target'], '.3f')})" if "ce_target" in ev else ""
        parts.append(f"CE {_fmt(ev['ce_ci_masked'], '.3f')}{target}")
    kls = [
        f"{name} {_fmt(ev[f'kl_{key}'], '.3g')}"
        for name, key in (("ci", "ci_masked"), ("stoch", "stoch_masked"), ("pgd", "pgd"))
        if f"kl_{key}" in ev
    ]
    if kls:
        parts.append("KL " + " ".join(kls))
    l0 = _numbers(_table(ev, "l0", stage))
    if l0:
        parts.append(f"L0 mean {_fmt(sum(l0) / len(l0), '.1f')}")
    return ", ".join(parts)


def report_line(project: Project) -> str | None:
    """`report: <path>/index.html (train checkpoint 20, 2026-...)` when the default report
    directory holds one; says when the stage has moved on since it was written."""
    out = project.root / DEFAULT_DIR
    index = out / INDEX
    try:
        man = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not index.is_file() or not isinstance(man, dict):
        return None
    stage = man.get("stage", "train")
    try:
        shown = index.relative_to(Path.cwd())
    except ValueError:
        shown = index
    at = f" checkpoint {man['checkpoint']}" if man.get("checkpoint") is not None else ""
    line = f"report: {shown} ({stage}{at}, {man.get('written_at', '?')})"
    st = project.stage(stage) if stage in STAGES else {}
    if (st.get("status", "pending"), st.get("step")) != (
        man.get("stage_status"),
        man.get("stage_step"),
    ):
        line += f"; out of date ({stage} has changed): rerun `pdctl report`"
    return line
