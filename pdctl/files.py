"""Files that are either whole or absent, and writes that stay where they were meant to go.

`atomic_output(path)` yields a temporary path next to `path`; once the caller has written it,
it is fsynced, renamed over `path` (a symlinked `path` keeps its link: the file it points to is
replaced) and the directory is fsynced. A crash at any point leaves the old file or the new one,
never a half-written one. The temporary file is created by this module (`O_EXCL | O_NOFOLLOW`),
so a symlink planted at its name is removed, never written through.

A run directory may come from someone else (docs/commands.md, "The run directory"): the files and
directories pdctl keeps in it must not be symlinks that would send a write elsewhere.
`refuse_links` checks a path (and, to a depth, what is under it) and `open_nofollow` opens a
file without following a link; both raise `UnsafePath`, one line naming the file (exit 2).
`check_private_dir` is the check for a directory whose contents pdctl executes (the compile
cache). Imports only `pdctl.errors` (a leaf), so every layer can use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from pdctl.errors import PdctlError

# Test hook: called with the temporary path between writing it and renaming it.
_before_rename = None


class UnsafePath(PdctlError):
    """A path in the run directory that pdctl refuses to write through (a symlink, ...)."""


def symlink_error(path: Path) -> UnsafePath:
    return UnsafePath(
        f"{path}: is a symlink; pdctl does not write through symlinks in a run directory "
        "(replace it with a real file or directory, or remove it)"
    )


def refuse_links(path: Path, depth: int = 0) -> None:
    """Raise `UnsafePath` when `path`, or anything up to `depth` levels below it, is a
    symlink. Paths that do not exist are fine (pdctl will create them)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError:
        return  # unreadable: whatever opens it reports that
    if stat.S_ISLNK(st.st_mode):
        raise symlink_error(path)
    if depth > 0 and stat.S_ISDIR(st.st_mode):
        try:
            children = sorted(os.listdir(path))
        except OSError:
            return
        for name in children:
            refuse_links(Path(path) / name, depth - 1)


def refuse_links_between(root: Path, path: Path) -> None:
    """Every component of `path` below `root` (which it must be under) that exists is not a
    symlink."""
    rel = Path(path).relative_to(root)
    p = Path(root)
    for part in rel.parts:
        p = p / part
        refuse_links(p)


def open_nofollow(path: Path, flags: int, mode: int = 0o666) -> int:
    """`os.open` that never follows a symlink at `path` (`UnsafePath` instead) and refuses
    anything but a regular file (a FIFO or a device planted at the name)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise symlink_error(Path(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePath(
                f"{path}: is not a regular file; pdctl keeps only regular files there (remove it)"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private_dir(path: Path, key: str) -> Path:
    """`path` as a directory only this user can write: created 0700 when it does not exist;
    an existing one must be a directory owned by this user and writable by no one else (not
    by others; by its group only when that is the user's own private group). For directories
    whose contents pdctl loads and runs (the compile cache)."""
    path = Path(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise PdctlError(f"{key}: cannot create {path} ({e.strerror})") from None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PdctlError(f"{key}: {path} is not a directory")
    why = None
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        why = f"is owned by another user (uid {st.st_uid})"
    elif mode & stat.S_IWOTH:
        why = f"is writable by others (mode {mode:o})"
    elif mode & stat.S_IWGRP and not _own_private_group(st.st_gid):
        why = f"is writable by its group (gid {st.st_gid}, mode {mode:o})"
    if why:
        raise PdctlError(
            f"{key}: {path} {why}; the compile cache holds code pdctl executes, so it must be "
            "a directory only you can write (`chmod go-w` it, or choose another)"
        )
    return path


def _own_private_group(gid: int) -> bool:
    """`gid` is this user's private group (named as the user, no other listed members): a
    group-writable directory in it (umask 002) is writable by this user alone."""
    import grp
    import pwd

    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == os.getegid() and group.gr_name == user and set(group.gr_mem) <= {user}


def _create_exclusive(tmp: Path) -> None:
    """Create `tmp` empty and new (never through a link); a stale file or planted symlink of
    that name is removed first (removing a link does not touch what it points to)."""
    for attempt in (0, 1):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except FileExistsError:
            if attempt:
                raise
            st = os.lstat(tmp)
            if stat.S_ISDIR(st.st_mode):
                raise UnsafePath(
                    f"{tmp}: a directory where pdctl writes a temporary file"
                ) from None
            os.unlink(tmp)
            continue
        os.close(fd)
        return


@contextlib.contextmanager
def atomic_output(path: Path, suffix: str = "") -> Iterator[Path]:
    """A temporary path to write `path`'s new content to (keeping `suffix`, for writers that
    insist on one, like np.savez); committed when the block exits without an exception."""
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{suffix}")
    try:
        _create_exclusive(tmp)
        yield tmp
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if _before_rename is not None:
            _before_rename(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            if os.path.islink(tmp) or os.path.isfile(tmp):
                tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash at any point leaves the old or the new file."""
    with atomic_output(path) as tmp:
        fd = open_nofollow(tmp, os.O_WRONLY | os.O_TRUNC)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
