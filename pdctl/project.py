"""The run directory: pdctl.toml (the user's config + pdctl's `[state.*]`), its lock and its paths.

Commands never parse pdctl.toml themselves; they load a `Project`. The file is two parts:
everything the user wrote, kept byte for byte, and after a marker line the `[state.<stage>]`
tables that pdctl owns and re-renders with tomli-w. Writes are atomic (temp file in the same
directory, fsync, rename) and only happen while holding the run directory's lock (a flock on
the directory itself, so deleting `.pdctl.lock` does not release it).

A run directory may come from someone else: taking the lock first checks that nothing pdctl
writes in it (the lock file, checkpoints/, metrics/, profiles/, report/, cache/, wandb/,
harvest/, a compile cache inside it) is a symlink, and refuses with one line naming it (exit 2)
before anything is written. Only pdctl.toml itself may be a link. A relative `[compile]
cache_dir` is made relative to the run directory here, when the file is loaded.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import errno
import fcntl
import os
import re
import threading
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tomli_w

from pdctl.config import Config, fingerprint, parse_config
from pdctl.errors import PdctlError, StageFailed
from pdctl.files import (
    atomic_write,
    open_nofollow,
    refuse_links,
    refuse_links_between,
)
from pdctl.registry import STAGES

PROJECT_FILE = "pdctl.toml"
LOCK_FILE = ".pdctl.lock"
INIT_FROM = "init_from"  # in [state.train] upstream: the run id of the init_from run's train
STATE_MARKER = "# ---- pdctl state: written by pdctl, do not edit below this line ----"
# What pdctl writes in a run directory, each with how many levels below it are checked for
# symlinks too (checkpoints/<stage>/<step>, cache/tokens/<file>, ...). wandb/ is wandb's: it
# makes its own `latest-run` link inside, so only the directory itself is checked.
_NO_LINKS = {
    LOCK_FILE: 0,
    "checkpoints": 2,
    "metrics": 1,
    "profiles": 4,
    "report": 2,
    "cache": 2,
    "wandb": 0,
    "harvest": 1,
}
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
# Held around every write of the state: a thread that must write last (a lost process ends the
# stage from pdctl's watchdog thread, `stages.policy`) takes it and keeps it.
WRITE_LOCK = threading.RLock()
_STATE_HEADER = re.compile(r"^[ \t]*\[\[?[ \t]*state[ \t]*[.\]]", re.MULTILINE)


def now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()


def split_state(text: str) -> tuple[str, str]:
    """(user part, state part). The state part starts at the marker line or the first
    `[state.*]` header, whichever comes first, that really is a line of TOML: one inside a
    multi-line string of the user's would cut that string short, so the user part before a
    true split point is itself valid TOML."""
    candidates = sorted(
        {text.rfind("\n", 0, i) + 1 for i in _find_all(text, STATE_MARKER)}
        | {m.start() for m in _STATE_HEADER.finditer(text)}
    )
    if not candidates:
        return text, ""
    for idx in candidates:
        if _parses(text[:idx]):
            return text[:idx], text[idx:]
    if _parses(text):  # every candidate is inside a string: there are no state tables
        return text, ""
    idx = candidates[0]  # the file is not valid TOML anyway; loading reports that
    return text[:idx], text[idx:]


def _find_all(text: str, needle: str) -> Iterator[int]:
    i = text.find(needle)
    while i >= 0:
        yield i
        i = text.find(needle, i + 1)


def _parses(text: str) -> bool:
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    return True


# "imported": [state.pretrain] of a target pdctl does not train (a Hugging Face model).
STATUSES = ("pending", "running", "done", "failed", "interrupted", "imported")
# The fields pdctl itself reads back, with the types it writes (others are informational).
# `lost_process`: a `failed` stage whose run lost that process (`pdctl resume` continues it)
_INT_FIELDS = ("step", "steps", "checkpoint", "lost_process")
_NUM_FIELDS = ("wall_s", "step_ms", "mfu")
_STR_FIELDS = ("fingerprint", "run_id", "wandb_id", "error")
_TABLE_FIELDS = ("compile_s", "metrics", "eval", "upstream")


def check_state(stage: str, st: dict[str, Any]) -> None:
    """The `[state.<stage>]` fields pdctl reads back have the types it writes; a hand-edited
    one that does not is an error naming it and the way out, not a crash later."""

    def bad(key: str, what: str) -> PdctlError:
        return PdctlError(
            f"state.{stage}.{key}: must be {what}, got {st[key]!r} ([state.*] is written by "
            f"pdctl: restore it, or delete [state.{stage}] and rerun the stage)"
        )

    if "status" in st and st["status"] not in STATUSES:
        raise bad("status", "one of " + ", ".join(STATUSES))
    for k in _INT_FIELDS:
        if k in st and (not isinstance(st[k], int) or isinstance(st[k], bool) or st[k] < 0):
            raise bad(k, "an integer >= 0")
    for k in _NUM_FIELDS:
        if k in st and (not isinstance(st[k], int | float) or isinstance(st[k], bool)):
            raise bad(k, "a number")
    for k in _STR_FIELDS:
        if k in st and not isinstance(st[k], str):
            raise bad(k, "a string")
    for k in _TABLE_FIELDS:
        if k in st and not isinstance(st[k], dict):
            raise bad(k, "a table")


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


def resolve_paths(config: Config, root: Path) -> Config:
    """The config with `[compile] cache_dir` made absolute: a relative one is relative to the
    run directory (where pdctl.toml is), never to the directory pdctl was started in."""
    cache = config.compile.cache_dir
    if not cache:
        return config
    p = Path(cache).expanduser()
    if p.is_absolute():
        return config
    resolved = os.path.abspath(root / p)
    compile_cfg = config.compile.model_copy(update={"cache_dir": resolved})
    return config.model_copy(update={"compile": compile_cfg})


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
        # The run directory is the one pdctl.toml is in, as named: a symlinked pdctl.toml
        # keeps its run directory (checkpoints, lock, metrics) next to the link.
        return p.absolute().parent.resolve() / p.name
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / PROJECT_FILE).is_file():
            return d / PROJECT_FILE
    raise PdctlError(
        f"no {PROJECT_FILE} in {here} or its parents; run `pdctl new NAME` and `cd NAME`, "
        "or pass --project PATH"
    )


def _flock(fd: int, root: Path, holder: Callable[[], str], *, required: bool = False) -> bool:
    """Take an exclusive flock on `fd` without waiting: True when taken; a one-line PdctlError
    when another process holds it; False when this file system cannot flock it (a directory
    on NFS), unless `required`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in _BUSY:
            raise PdctlError(
                f"{root} is in use by another pdctl process (pid {holder()}); "
                "wait for it to finish or stop it"
            ) from None
        if required:
            raise
        return False
    return True


def _dir_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class RunDirMoved(StageFailed):
    """The run directory was renamed or removed while pdctl worked in it (exit 1): its files
    are no longer where pdctl writes them."""


class Project:
    """One run directory: its validated config, its state, its lock and its paths."""

    def __init__(self, path: Path, text: str, config: Config, state: dict[str, dict[str, Any]]):
        self.path = path
        self.root = path.parent
        self._root_id = _dir_id(self.root)  # to tell when the directory moves (`moved`)
        self.config = config
        self.state = state
        self._user_text, _ = split_state(text)
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None
        self._lock_made = False  # this hold created `.pdctl.lock` (it goes again on release)
        self._lock_depth = 0
        # {stage: {"before": its state before this process began it, "ckpt": wrote one}}
        self.attempts: dict[str, dict[str, Any]] = {}
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
        try:
            user_raw = tomllib.loads(user) if state_part else raw
            state_raw = tomllib.loads(state_part) if state_part else {}
        except tomllib.TOMLDecodeError as e:
            raise PdctlError(
                f"{path.name}: invalid TOML around the [state.*] tables: {e}"
            ) from None
        if "state" in user_raw:
            raise PdctlError(f"{path.name}: `state` is pdctl's table; remove it from your config")
        if state_part:
            extra = sorted(set(state_raw) - {"state"})
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
            check_state(name, st)
        config = resolve_paths(parse_config(user_raw), path.parent)
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
        """Atomically write the state back; every byte above it stays as the user has it.

        The user part is re-read from disk under the lock at every write, so edits made while
        a stage runs (a comment, a changed learning rate) are kept; only the `[state.*]` tables
        are this process's."""
        if not self.writer:
            return
        with WRITE_LOCK, self.locked():
            try:
                on_disk = self.path.read_bytes().decode("utf-8")
            except FileNotFoundError:
                on_disk = None  # deleted under us: write it back from memory
            except (OSError, UnicodeDecodeError) as e:
                raise PdctlError(
                    f"{self.path}: cannot read it back to update the state ({e})"
                ) from None
            if on_disk is not None:
                self._user_text, _ = split_state(on_disk)
            text = self.render()
            # Never write a file we could not read back because of our part. A user part that
            # does not parse (an edit in progress) is theirs: it is kept as it is.
            tomllib.loads(render_state(self.state))
            if _parses(self._user_text):
                tomllib.loads(text)
            try:
                atomic_write(self.path, text.encode("utf-8"))
            except OSError as e:
                moved = self.moved()
                if moved:
                    raise RunDirMoved(moved) from None
                raise PdctlError(
                    f"{self.path.parent}: cannot write {self.path.name} ({e.strerror}); "
                    "pdctl needs write access to the run directory"
                ) from None

    def stage(self, name: str) -> dict[str, Any]:
        return self.state.get(name, {})

    def moved(self) -> str | None:
        """Why the run directory is no longer at `root` (renamed or removed since it was
        loaded), or None while it is."""
        if self._root_id is None or _dir_id(self.root) == self._root_id:
            return None
        return (
            f"the run directory {self.root} was moved or removed while pdctl worked in it, so "
            "its state could not be written; in its new place `pdctl status` shows the stage "
            "as it was last written and `pdctl resume` continues it from its last checkpoint"
        )

    def update_stage(self, name: str, **fields: Any) -> dict[str, Any]:
        st = self.state.setdefault(name, {})
        st.update(fields)
        st["updated_at"] = now()
        self.save_state()
        return st

    def reset_stage(self, name: str, **fields: Any) -> dict[str, Any]:
        self.state[name] = {}
        return self.update_stage(name, **fields)

    def fingerprint(self, stage: str) -> str:
        return fingerprint(self.config, stage)

    def is_stale(self, stage: str) -> bool:
        """The config it ran with has changed, or a stage it read from has been rerun since."""
        st = self.stage(stage)
        if not st:
            return False
        return st.get("fingerprint") != self.fingerprint(stage) or bool(self.rerun_upstream(stage))

    def rerun_upstream(self, stage: str) -> list[str]:
        """The stages `stage` read from that have started over (a new run id) since it began."""
        upstream = self.stage(stage).get("upstream") or {}
        rerun = [
            s for s, rid in upstream.items() if s in STAGES and self.stage(s).get("run_id") != rid
        ]
        parent = upstream.get(INIT_FROM)  # `[train] init_from`: another run's train
        if parent is not None and self.config.train.init_from:
            now = self._init_from_run_id()
            if now is not None and now != parent:  # unreadable: nobody can tell
                rerun.append("the train of train.init_from's run")
        return rerun

    def _init_from_run_id(self) -> str | None:
        """The run id of the `[train] init_from` run's train now, or None when unreadable."""
        p = Path(self.config.train.init_from).expanduser()
        try:
            parent = Project.load((p if p.is_absolute() else self.root / p) / PROJECT_FILE)
        except (PdctlError, OSError):
            return None
        return parent.stage("train").get("run_id")

    # ---- stage attempts (for rolling back what a failed command wrote) ----------------------
    def begin_attempt(self, stage: str) -> None:
        """Remember `stage`'s state as it was before this process starts writing it."""
        if stage not in self.attempts:
            self.attempts[stage] = {"before": copy.deepcopy(self.state.get(stage)), "ckpt": False}

    def attempt_committed(self, stage: str) -> None:
        if stage in self.attempts:
            self.attempts[stage]["ckpt"] = True

    def is_done(self, stage: str) -> bool:
        """Finished: `done`, or (pretrain of an imported model) `imported`."""
        return self.stage(stage).get("status") in ("done", "imported")

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
        """Take the run directory's lock, or refuse (one line) when another process holds it.

        The lock is a `flock` on the run directory itself (an fd opened O_RDONLY|O_DIRECTORY),
        which deleting or replacing `.pdctl.lock` cannot release; `.pdctl.lock` is also
        flocked (the lock where directories cannot be: NFS) and holds the holder's pid. Before
        anything is written, the files pdctl keeps in the run directory are checked not to be
        symlinks (`check_run_dir`), and `.pdctl.lock` is opened without following one."""
        if self._lock_depth:
            self._lock_depth += 1
            return
        self.check_run_dir()
        try:
            opened = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise PdctlError(f"{self.root}: cannot open the run directory ({e.strerror})") from None
        dir_fd: int | None = opened  # None: the directory could not be locked
        try:
            if not _flock(opened, self.root, self._holder):
                os.close(opened)  # no flock on directories here: the lock file alone
                dir_fd = None
            made = not os.path.lexists(self.root / LOCK_FILE)
            try:
                fd = open_nofollow(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise PdctlError(
                    f"{self.root}: cannot write in the run directory ({e.strerror}); "
                    "pdctl needs write access to it to run a stage"
                ) from None
            try:
                _flock(fd, self.root, self._holder, required=True)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            if dir_fd is not None:
                os.close(dir_fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        self._dir_fd = dir_fd
        self._lock_made = made
        self._lock_depth = 1

    def _holder(self) -> str:
        """The pid the lock file names (never read through a symlink), or "?"."""
        try:
            fd = open_nofollow(self.root / LOCK_FILE, os.O_RDONLY)
        except (OSError, PdctlError):
            return "?"
        try:
            return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)

    def release_lock(self) -> None:
        if not self._lock_depth:
            return
        self._lock_depth -= 1
        if self._lock_depth == 0 and self._lock_fd is not None:
            self._remove_lock_file()
            for fd in (self._lock_fd, self._dir_fd):
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
            self._lock_fd = self._dir_fd = None

    def _remove_lock_file(self) -> None:
        """A `.pdctl.lock` this hold created goes again (a command that wrote nothing, such as
        one refused for a mistake in the input, leaves nothing behind), unlinked while both
        locks are still held. Only when the directory itself is locked (another pdctl is
        refused there first, so none can be holding the file's inode) and the name is still
        this file (it may have been replaced meanwhile)."""
        if not self._lock_made or self._dir_fd is None or self._lock_fd is None:
            return
        with contextlib.suppress(OSError):
            mine, now = os.fstat(self._lock_fd), os.lstat(self.root / LOCK_FILE)
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(self.root / LOCK_FILE)

    def lock_is_free(self) -> bool:
        """True when no process holds the lock (a `running` stage then means a crash)."""
        if self._lock_depth:
            return False
        # Read-only opens are enough for flock, and work in a read-only run directory.
        try:
            dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return False  # cannot tell: do not call a live stage crashed
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _BUSY:
                return False
        finally:
            os.close(dir_fd)
        try:
            fd = open_nofollow(self.root / LOCK_FILE, os.O_RDONLY)
        except FileNotFoundError:
            return True
        except (OSError, PdctlError):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

    def check_run_dir(self) -> None:
        """Refuse (one line naming it) a symlink where pdctl writes in the run directory: the
        lock, checkpoints/, metrics/, profiles/, report/, cache/, wandb/, harvest/ and what
        pdctl keeps in them, and a compile cache directory inside the run directory.
        `pdctl.toml` itself may be a symlink (the run directory is the one the link is in)."""
        for name, depth in _NO_LINKS.items():
            refuse_links(self.root / name, depth)
        cache = self.config.compile.cache_dir
        root = Path(os.path.abspath(self.root))  # a sweep member's root can be relative
        if cache and Path(cache).is_relative_to(root):
            refuse_links_between(root, Path(cache))

    # ---- paths ---------------------------------------------------------------------------
    def checkpoint_dir(self, stage: str) -> Path:
        return self.root / "checkpoints" / stage

    def metrics_path(self, stage: str) -> Path:
        return self.root / "metrics" / f"{stage}.jsonl"

    @property
    def report_dir(self) -> Path:
        """`<run>/report/`, the default output of `pdctl report`: refused (one line) when it,
        or a file in it, is a symlink."""
        path = self.root / "report"
        refuse_links(path, _NO_LINKS["report"])
        return path

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
