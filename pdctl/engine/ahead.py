"""Work started ahead on a host thread: `pdctl run` compiles its later stages' steps into the
persistent compile cache while the earlier stages run on the devices (`[compile] ahead`).

One thread per process runs the jobs in order; each job sets its event when it ends, however
it ends (a failed compile only costs the stage its own compile, as without this). A stage
`wait`s for its job before it compiles, then reads the cache. The thread is never cancelled (a
compile is one C++ call): a stop or an error that ends the process while it runs ends it with
os._exit (`running`: `cli.process.run`), as for a compile a stop left on a worker thread.

JAX's tracing caches are cleared between stages (`runtime.release_device_memory`); the thread
traces and lowers under `TRACING`, which that clearing takes too, and compiles outside it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("pdctl")

TRACING = threading.Lock()
_events: dict[str, threading.Event] = {}
_thread: threading.Thread | None = None
_current: str | None = None


def start(jobs: list[tuple[str, Callable[[], None]]]) -> None:
    """Run `jobs` ([(name, fn)], in order) on one daemon thread."""
    global _thread
    if not jobs:
        return
    for name, _ in jobs:
        _events[name] = threading.Event()

    def work() -> None:
        global _current
        for name, fn in jobs:
            _current = name
            t0 = time.perf_counter()
            try:
                fn()
                log.info("compiled %s ahead in %.1f s", name, time.perf_counter() - t0)
            except Exception as e:  # the stage compiles it itself, as it would have
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                log.warning("compiling %s ahead failed (%s); it compiles when it starts",
                            name, first[:200])  # fmt: skip
            finally:
                _events[name].set()
        _current = None

    _thread = threading.Thread(target=work, name="pdctl: compiling ahead", daemon=True)
    _thread.start()


def pending(name: str) -> bool:
    """Whether `name`'s job was started and has not ended."""
    event = _events.get(name)
    return event is not None and not event.is_set()


def wait(name: str) -> None:
    """Until `name`'s job has ended (at once when there is none)."""
    event = _events.get(name)
    if event is not None:
        event.wait()


def running() -> str | None:
    """What the thread is compiling now, or None."""
    if _thread is None or not _thread.is_alive():
        return None
    return f"compiling {_current} ahead" if _current else "compiling ahead"


def reset() -> None:
    """Forget finished jobs (a process that runs several pipelines: the tests)."""
    global _thread
    if running() is None:
        _events.clear()
        _thread = None
