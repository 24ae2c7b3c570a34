"""`pdctl interp score`: detection and fuzzing scores from a filled trials file.

The trials file is what `pdctl interp export` wrote (`trials.jsonl`) with each trial's
`predictions` filled in: one answer per example, "yes" / "no" (or true / false). A trial whose
predictions are still null is skipped. The scores, as the anchors define them
(goodfire-ai/param-decomp `autointerp/scoring/`, after EleutherAI's sae-auto-interp):

  detection  per trial, balanced accuracy (TPR + TNR) / 2, where TPR = the firing examples
             answered yes / the firing examples and TNR = the non-firing ones answered no / the
             non-firing ones (a rate over no examples counts 0); the component's score is the
             mean over its trials.
  fuzzing    pooled over the component's trials: TPR = correctly marked examples answered yes /
             correctly marked examples, TNR = randomly marked ones answered no / randomly
             marked ones; score (TPR + TNR) / 2, or 0 when either kind is absent.

Both are 0.5 for a label that tells nothing (answers at chance) and 1 for a perfect one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdctl.errors import PdctlError
from pdctl.interp.labels import component_of, decode, loads, read_bytes, read_jsonl

TASKS = ("detection", "fuzzing")
YES = {"yes": True, "no": False, True: True, False: False}


@dataclass
class Trial:
    task: str
    key: tuple[str, int]
    label: str
    fires: list[bool]
    said: list[bool]

    def counts(self) -> tuple[int, int, int, int]:
        """(true positives, positives, true negatives, negatives)."""
        tp = sum(f and s for f, s in zip(self.fires, self.said, strict=True))
        tn = sum(not f and not s for f, s in zip(self.fires, self.said, strict=True))
        pos = sum(self.fires)
        return tp, pos, tn, len(self.fires) - pos


@dataclass
class Scores:
    detection: dict[tuple[str, int], float] = field(default_factory=dict)
    fuzzing: dict[tuple[str, int], float] = field(default_factory=dict)
    trials: dict[tuple[str, str, int], int] = field(default_factory=dict)  # (task, site, c)
    labels: dict[tuple[str, int], str] = field(default_factory=dict)
    skipped: int = 0


def _answer(v: Any) -> bool | None:
    if isinstance(v, str):
        v = v.strip().lower()
    return YES.get(v) if isinstance(v, (str, bool)) else None


def trial_id(obj: dict[str, Any]) -> str:
    """A trial's name in an answers file: task:site:component:trial."""
    return ":".join(str(obj.get(k)) for k in ("task", "site", "component", "trial"))


def answered(path: Path | None) -> dict[str, Any]:
    """{trial id: predictions} from an `--endpoint` answers file (a line cut short by a crash
    is ignored: that trial is asked again)."""
    if path is None:
        return {}
    try:
        text = decode(read_bytes(path, nofollow=True), path)
    except FileNotFoundError:
        return {}
    out = {}
    for line in text.splitlines():
        try:
            obj = loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("predictions") is not None:
            out[str(obj.get("key"))] = obj["predictions"]
    return out


def parse(
    path: Path, known: dict[str, int], answers: Path | None = None
) -> tuple[list[Trial], int]:
    """The filled trials of the file (predictions missing there taken from `answers`), and
    how many were left unfilled; one line naming the file, the line and the key for anything
    else."""
    out, skipped = [], 0
    extra = answered(answers)
    for n, obj in read_jsonl(path):
        where = f"{path} line {n}"
        key = component_of(obj, where, known)
        task = obj.get("task")
        if task not in TASKS:
            raise PdctlError(f"{where}: task: must be detection or fuzzing, got {task!r}")
        label = obj.get("label")
        if not isinstance(label, str) or not label.strip():
            raise PdctlError(f"{where}: label: must be a non-empty string, got {label!r}")
        fires = obj.get("fires")
        if not isinstance(fires, list) or not all(isinstance(f, bool) for f in fires):
            raise PdctlError(f"{where}: fires: must be a list of true / false, as exported")
        preds = obj.get("predictions")
        if preds is None:
            preds = extra.get(trial_id(obj))
        if preds is None:
            skipped += 1
            continue
        if not isinstance(preds, list):
            raise PdctlError(f"{where}: predictions: must be a list of \"yes\" / \"no\", got "
                             f"{type(preds).__name__}")  # fmt: skip
        if len(preds) != len(fires):
            raise PdctlError(f"{where}: predictions: {len(preds)} answers for "
                             f"{len(fires)} examples")  # fmt: skip
        said = [_answer(p) for p in preds]
        bad = next((p for p, s in zip(preds, said, strict=True) if s is None), None)
        if None in said:
            raise PdctlError(f"{where}: predictions: each answer must be \"yes\" or \"no\", "
                             f"got {bad!r}")  # fmt: skip
        out.append(Trial(task, key, label, fires, said))  # type: ignore[arg-type]
    return out, skipped


def compute(trials: list[Trial]) -> Scores:
    """Detection and fuzzing scores per component (the definitions in the module)."""
    res = Scores()
    by: dict[tuple[str, tuple[str, int]], list[Trial]] = {}
    for t in trials:
        prev = res.labels.setdefault(t.key, t.label)
        if prev != t.label:
            raise PdctlError(f"{t.key[0]}:{t.key[1]}: trials of two labels ({prev!r} and "
                             f"{t.label!r}) in one file")  # fmt: skip
        by.setdefault((t.task, t.key), []).append(t)
    for (task, key), ts in by.items():
        res.trials[(task, *key)] = len(ts)
        if task == "detection":
            bal = []
            for t in ts:
                tp, pos, tn, neg = t.counts()
                bal.append(((tp / pos if pos else 0.0) + (tn / neg if neg else 0.0)) / 2)
            res.detection[key] = sum(bal) / len(bal)
        else:
            tp, pos, tn, neg = (sum(x) for x in zip(*(t.counts() for t in ts), strict=True))
            res.fuzzing[key] = (tp / pos + tn / neg) / 2 if pos and neg else 0.0
    return res
