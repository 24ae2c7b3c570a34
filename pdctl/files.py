"""Files that are either whole or absent: every file pdctl writes goes through here.

`atomic_output(path)` yields a temporary path next to `path`; once the caller has written it,
it is fsynced, renamed over `path` (a symlinked `path` keeps its link: the file it points to is
replaced) and the directory is fsynced. A crash at any point leaves the old file or the new one,
never a half-written one. A leaf module (no pdctl imports), so every layer can use it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

# Test hook: called with the temporary path between writing it and renaming it.
_before_rename = None


@contextlib.contextmanager
def atomic_output(path: Path, suffix: str = "") -> Iterator[Path]:
    """A temporary path to write `path`'s new content to (keeping `suffix`, for writers that
    insist on one, like np.savez); committed when the block exits without an exception."""
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{suffix}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
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


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash at any point leaves the old or the new file."""
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)
