"""Where metrics go: one `Tracker` interface (levanter's shape: `log`, `finish`) with a jsonl
implementation (`metrics/<stage>.jsonl`, always), a wandb one (when enabled), a no-op one, and
a composite that fans out to several. The loop logs to one tracker and never branches on which
are on; only process 0 gets real ones.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from pdctl.files import atomic_write, open_nofollow, refuse_links

# `[tracking] wandb`
WandbMode = Literal["disabled", "offline", "online"]


class Tracker(Protocol):
    run_id: str | None

    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def finish(self) -> None: ...


class NoopTracker:
    run_id: str | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class JsonlTracker:
    """One JSON object per logged step, appended to `path` (metrics/<stage>.jsonl).

    Neither `path` nor its directory may be a symlink (a run directory from someone else must
    not send pdctl's writes elsewhere): `UnsafePath`, one line naming it. The file is opened
    without following a link at every write."""

    run_id: str | None = None

    def __init__(self, path: Path):
        self.path = path
        refuse_links(path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        refuse_links(path)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        line = json.dumps({"step": step, **{k: _clean(v) for k, v in metrics.items()}}) + "\n"
        fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        with os.fdopen(fd, "a") as f:
            f.write(line)

    def finish(self) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after `step` (a resumed stage re-logs them identically)."""
        try:
            fd = open_nofollow(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            text = f.read()
        keep = []
        for line in text.splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except (json.JSONDecodeError, AttributeError):
                continue  # a line cut short by a crash
        atomic_write(self.path, "".join(line + "\n" for line in keep).encode())


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training log lines, evaluation lines) of a metrics/<stage>.jsonl that `JsonlTracker`
    wrote. A torn last line (a stage writing right now) is skipped, not an error."""
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or "step" not in row:
            continue
        (evals if any(k.startswith("eval/") for k in row) else train).append(row)
    return train, evals


class WandbTracker:
    """Weights & Biases; metric names get the stage as a prefix (`train/loss`)."""

    def __init__(
        self,
        *,
        mode: WandbMode,
        project: str,
        entity: str,
        name: str,
        prefix: str,
        directory: Path,
        run_id: str | None,
        config: dict[str, Any],
    ):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            mode=mode,
            project=project,
            entity=entity or None,
            name=name,
            dir=str(directory),
            id=run_id,
            resume="allow",
            config=config,
        )
        self.run_id: str | None = self._run.id
        self._prefix = prefix

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log({f"{self._prefix}/{k}": v for k, v in metrics.items()}, step=step)

    def finish(self) -> None:
        self._run.finish()


class CompositeTracker:
    """Every call goes to each tracker in turn; the run id is the first one that has one."""

    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers = list(trackers)
        self.run_id = next((t.run_id for t in self.trackers if t.run_id), None)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step)

    def finish(self) -> None:
        for t in self.trackers:
            t.finish()


def make_tracker(
    *,
    jsonl: Path,
    mode: WandbMode,
    project: str,
    entity: str,
    name: str,
    prefix: str,
    directory: Path,
    run_id: str | None,
    config: dict[str, Any],
    is_writer: bool,
) -> Tracker:
    """The stage's tracker: jsonl always (and wandb when enabled) on process 0, none elsewhere."""
    if not is_writer:
        return NoopTracker()
    trackers: list[Tracker] = [JsonlTracker(jsonl)]
    if mode != "disabled":
        trackers.append(
            WandbTracker(
                mode=mode,
                project=project,
                entity=entity,
                name=name,
                prefix=prefix,
                directory=directory,
                run_id=run_id,
                config=config,
            )
        )
    return CompositeTracker(trackers)
