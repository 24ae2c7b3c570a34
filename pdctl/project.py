"""The run directory: pdctl.toml (the user's config + pdctl's `[state.*]`), its lock and its paths.

Commands never parse pdctl.toml themselves; they load a `Project`. The file is two parts:
everything the user wrote, kept byte for byte, and after a marker line the `[state.<stage>]`
tables that pdctl owns and re-renders with tomli-w. Writes are atomic (temp file in the same
directory, fsync, rename) and only happen while holding the run directory's lock.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tomli_w

from pdctl.config import STAGES, Config, fingerprint, parse_config
from pdctl.errors import PdctlError

PROJECT_FILE = "pdctl.toml"
LOCK_FILE = ".pdctl.lock"
STATE_MARKER = "# ---- pdctl state: written by pdctl, do not edit below this line ----"
_STATE_HEADER = re.compile(r"^[ \t]*\[\[?[ \t]*state[ \t]*[.\]]", re.MULTILINE)


def _now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()


def split_state(text: str) -> tuple[str, str]:
    """(user part, state part). The state part starts at the marker or the first [state.*]."""
    idx = text.find(STATE_MARKER)
    if idx < 0:
        m = _STATE_HEADER.search(text)
        idx = m.start() if m else len(text)
    else:
        idx = text.rfind("\n", 0, idx) + 1  # start of the marker's line
    return text[:idx], text[idx:]


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_drop_none(v) for v in value]
    return value


def render_state(state: dict[str, dict[str, Any]]) -> str:
    state = {k: v for k, v in state.items() if v}
    if not state:
        return ""
    return STATE_MARKER + "\n" + tomli_w.dumps({"state": _drop_none(state)})


# Test hook: called between writing the temp file and renaming it over pdctl.toml.
_before_rename = None


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash at any point leaves the old or the new file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if _before_rename is not None:
            _before_rename(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def find_project_file(start: Path | None = None, explicit: Path | None = None) -> Path:
    """`--project PATH` (a run directory or its pdctl.toml), else cwd and then its parents."""
    if explicit is not None:
        p = explicit.expanduser()
        if p.is_dir():
            p = p / PROJECT_FILE
        if not p.is_file():
            raise PdctlError(
                f"--project: no {PROJECT_FILE} at {p}; create one with `pdctl new NAME`"
            )
        return p.resolve()
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / PROJECT_FILE).is_file():
            return d / PROJECT_FILE
    raise PdctlError(
        f"no {PROJECT_FILE} in {here} or its parents; run `pdctl new NAME` and `cd NAME`, "
        "or pass --project PATH"
    )


class Project:
    """One run directory: its validated config, its state, its lock and its paths."""

    def __init__(self, path: Path, text: str, config: Config, state: dict[str, dict[str, Any]]):
        self.path = path
        self.root = path.parent
        self.config = config
        self.state = state
        self._user_text, _ = split_state(text)
        self._lock_fd: int | None = None
        self._lock_depth = 0
        # Only process 0 of a multi-process run writes files; the others set this False.
        self.writer = True

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Path) -> Project:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise PdctlError(f"{path}: cannot read ({e.strerror})") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise PdctlError(f"{path}: not UTF-8 text") from None
        return cls.from_text(path, text)

    @classmethod
    def from_text(cls, path: Path, text: str) -> Project:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise PdctlError(f"{path.name}: invalid TOML: {e}") from None
        user, state_part = split_state(text)
        user_raw = tomllib.loads(user) if state_part else raw
        if "state" in user_raw:
            raise PdctlError(f"{path.name}: `state` is pdctl's table; remove it from your config")
        if state_part:
            extra = sorted(set(tomllib.loads(state_part)) - {"state"})
            if extra:
                raise PdctlError(
                    f"{path.name}: [{extra[0]}] comes after the [state.*] tables; "
                    "move your tables above them"
                )
        state = raw.get("state", {})
        if not isinstance(state, dict):
            raise PdctlError(f"{path.name}: `state` must be [state.<stage>] tables")
        unknown = sorted(set(state) - set(STAGES))
        if unknown:
            raise PdctlError(f"state.{unknown[0]}: unknown stage (stages: {', '.join(STAGES)})")
        for name, st in state.items():
            if not isinstance(st, dict):
                raise PdctlError(f"state.{name}: must be a table ([state.{name}])")
        config = parse_config(user_raw)
        return cls(path, text, config, {k: dict(v) for k, v in state.items()})

    @classmethod
    def find(cls, explicit: Path | None = None, start: Path | None = None) -> Project:
        return cls.load(find_project_file(start, explicit))

    # ---- state ---------------------------------------------------------------------------
    def render(self) -> str:
        prefix = self._user_text
        body = render_state(self.state)
        if body and STATE_MARKER not in prefix:
            if prefix and not prefix.endswith("\n"):
                prefix += "\n"
            if prefix and not prefix.endswith("\n\n"):
                prefix += "\n"
            self._user_text = prefix
        return prefix + body

    def save_state(self) -> None:
        """Atomically write the state back; every byte above it stays as the user wrote it."""
        if not self.writer:
            return
        text = self.render()
        tomllib.loads(text)  # never write a file we could not read back
        with self.locked():
            atomic_write(self.path, text.encode("utf-8"))

    def stage(self, name: str) -> dict[str, Any]:
        return self.state.get(name, {})

    def update_stage(self, name: str, **fields: Any) -> dict[str, Any]:
        st = self.state.setdefault(name, {})
        st.update(fields)
        st["updated_at"] = _now()
        self.save_state()
        return st

    def reset_stage(self, name: str, **fields: Any) -> dict[str, Any]:
        self.state[name] = {}
        return self.update_stage(name, **fields)

    def fingerprint(self, stage: str) -> str:
        return fingerprint(self.config, stage)

    def is_stale(self, stage: str) -> bool:
        st = self.stage(stage)
        return bool(st) and st.get("fingerprint") != self.fingerprint(stage)

    def is_done(self, stage: str) -> bool:
        return self.stage(stage).get("status") == "done"

    # ---- lock ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the run directory's lock (re-entrant within this process)."""
        self.acquire_lock()
        try:
            yield
        finally:
            self.release_lock()

    def acquire_lock(self) -> None:
        if self._lock_depth:
            self._lock_depth += 1
            return
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise PdctlError(
                    f"{self.root} is in use by another pdctl process (pid {holder}); "
                    "wait for it to finish or stop it"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        self._lock_depth = 1

    def release_lock(self) -> None:
        if not self._lock_depth:
            return
        self._lock_depth -= 1
        if self._lock_depth == 0 and self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def lock_is_free(self) -> bool:
        """True when no process holds the lock (a `running` stage then means a crash)."""
        if self._lock_depth:
            return False
        try:
            fd = os.open(self.root / LOCK_FILE, os.O_RDWR)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

    # ---- paths ---------------------------------------------------------------------------
    def checkpoint_dir(self, stage: str) -> Path:
        return self.root / "checkpoints" / stage

    def metrics_path(self, stage: str) -> Path:
        return self.root / "metrics" / f"{stage}.jsonl"

    @property
    def profiles_dir(self) -> Path:
        return self.root / "profiles"

    @property
    def wandb_dir(self) -> Path:
        return self.root / "wandb"

    # ---- status --------------------------------------------------------------------------
    def status_report(self) -> dict[str, dict[str, Any]]:
        """The `pdctl status --json` shape: one object per stage, its state fields plus `stale`."""
        crashed_ok = None
        out: dict[str, dict[str, Any]] = {}
        for name in STAGES:
            st = dict(self.stage(name))
            st.setdefault("status", "pending")
            st["stale"] = self.is_stale(name)
            if st["status"] == "running":
                if crashed_ok is None:
                    crashed_ok = self.lock_is_free()
                st["crashed"] = crashed_ok
            out[name] = st
        return out
