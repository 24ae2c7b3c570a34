"""Where metrics go: `metrics/<stage>.jsonl` always, wandb when enabled.

A `Tracker` has wandb's shape (log, log_hparams, finish), and a no-op one stands in when wandb is
disabled or this is not process 0, so calling code never branches on "is wandb on".
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    run_id: str | None

    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def log_hparams(self, hparams: dict[str, Any]) -> None: ...
    def finish(self) -> None: ...


class NoopTracker:
    run_id: str | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker:
    def __init__(
        self,
        *,
        mode: str,
        project: str,
        entity: str,
        name: str,
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
        self.run_id = self._run.id

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        self._run.config.update(hparams, allow_val_change=True)

    def finish(self) -> None:
        self._run.finish()


def make_tracker(
    *,
    mode: str,
    project: str,
    entity: str,
    name: str,
    directory: Path,
    run_id: str | None,
    config: dict[str, Any],
    is_writer: bool,
) -> Tracker:
    if mode == "disabled" or not is_writer:
        return NoopTracker()
    return WandbTracker(
        mode=mode,
        project=project,
        entity=entity,
        name=name,
        directory=directory,
        run_id=run_id,
        config=config,
    )


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class JsonlWriter:
    """Appends one JSON object per logged step to metrics/<stage>.jsonl (process 0 only)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = path
        self.enabled = enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after `step` (a resumed stage re-logs them identically)."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
        # Temp file + rename: a crash mid-rewrite leaves the old file or the new one, never a
        # truncated history.
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)
