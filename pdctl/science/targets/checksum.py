"""Content checksums of an imported model's files, cheap to re-check.

`init-weights` hashes every byte of the weight files once (`content_digest`): sha256 over
64 MiB chunks hashed on a thread pool (hashlib releases the GIL on large buffers), combined in
file and chunk order, so the cost is the disk's read rate divided over the cores rather than one
core's hash rate. It records, next to the digest, each file's stat signature: device, inode,
size, mtime and ctime. A later stage compares signatures first; only when one differs (the file
was replaced, edited, touched, or the run moved to another machine) does it hash again and
compare digests. An in-place edit always moves ctime, which no user call can set back, so a
file whose signature is unchanged has unchanged bytes; a changed file is caught by its bytes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHUNK = 64 << 20
ALGORITHM = "sha256-64MiB-tree"  # recorded with the digest, so a later scheme can tell


def _chunk_digest(path: Path, offset: int, size: int) -> bytes:
    h = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = size
        while left:
            buf = f.read(min(left, 8 << 20))
            if not buf:
                raise OSError(f"{path} is shorter than when it was listed")
            h.update(buf)
            left -= len(buf)
    return h.digest()


def content_digest(files: Sequence[Path], workers: int | None = None) -> str:
    """sha256 of the sha256 of every 64 MiB chunk of `files`, in order (names excluded, so a
    moved or copied model keeps its digest)."""
    jobs = []
    for path in files:
        size = path.stat().st_size
        jobs += [(path, off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)] or [
            (path, 0, 0)
        ]
    workers = workers or min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda job: _chunk_digest(*job), jobs))
    top = hashlib.sha256()
    for d in digests:
        top.update(d)
    return top.hexdigest()


def signature(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def record(files: Sequence[Path], root: Path) -> dict[str, Any]:
    """What init-weights keeps in `[state.pretrain]`: the content digest and the signatures."""
    return {
        "checksum": content_digest(files),
        "checksum_of": f"the bytes of {len(files)} file(s) ({ALGORITHM})",
        "files": {_name(p, root): signature(p) for p in files},
    }


def unchanged(files: Sequence[Path], root: Path, recorded: dict[str, Any]) -> bool:
    """True when `files` hold the bytes `recorded` was made from: every stat signature equal
    (no read at all), or else the content digest equal."""
    sigs = recorded.get("files")
    if isinstance(sigs, dict) and {_name(p, root): signature(p) for p in files} == sigs:
        return True
    return content_digest(files) == recorded.get("checksum")


def _name(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)
