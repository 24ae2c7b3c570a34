"""Work started ahead on a host thread (`[compile] ahead`): `pdctl run` compiles its later
stages' steps into the persistent compile cache while the earlier stages run on the devices,
and the train stage its evaluation's programs while its steps run.

A thread runs its jobs in order; each job sets its event when it ends, however
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
_threads: list[threading.Thread] = []
_current: dict[int, str] = {}  # thread ident -> the job it runs


def enabled(setting: bool | str) -> bool:
    """`[compile] ahead`: "auto" is on where the devices are not the host's own cores (a GPU or
    TPU: the host's cores compile while the devices run the earlier stages, or the steps). On a
    CPU the stages' own programs need those cores (measured: a 2-core machine gained nothing,
    docs/performance.md "Time to the first train step on this CPU, part 2"). Only with the
    compile cache, which carries the programs to the stages."""
    import jax

    from pdctl.engine import compile_cache

    if setting == "auto":
        setting = jax.default_backend() != "cpu"
    return bool(setting) and compile_cache.active()


def start(jobs: list[tuple[str, Callable[[], None]]]) -> None:
    """Run `jobs` ([(name, fn)], in order) on a daemon thread of their own. A job named as an
    earlier one replaces it for `pending` / `wait` (`event` gives the earlier one's first)."""
    if not jobs:
        return
    events = [threading.Event() for _ in jobs]
    for (name, _), event in zip(jobs, events, strict=True):
        _events[name] = event

    def work() -> None:
        me = threading.get_ident()
        for (name, fn), event in zip(jobs, events, strict=True):
            _current[me] = name
            t0 = time.perf_counter()
            try:
                fn()
                log.info("compiled %s ahead in %.1f s", name, time.perf_counter() - t0)
            except Exception as e:  # the stage compiles it itself, as it would have
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                log.warning("compiling %s ahead failed (%s); it compiles when it starts",
                            name, first[:200])  # fmt: skip
            finally:
                event.set()
        _current.pop(me, None)

    thread = threading.Thread(target=work, name="pdctl: compiling ahead", daemon=True)
    _threads.append(thread)
    thread.start()


def event(name: str) -> threading.Event | None:
    """The event of the job called `name` (set when it ends), or None."""
    return _events.get(name)


def pending(name: str) -> bool:
    """Whether `name`'s job was started and has not ended."""
    found = _events.get(name)
    return found is not None and not found.is_set()


def wait(name: str) -> None:
    """Until `name`'s job has ended (at once when there is none)."""
    found = _events.get(name)
    if found is not None:
        found.wait()


def current() -> str | None:
    """The job the calling thread runs, or None (not a thread of this module's)."""
    return _current.get(threading.get_ident())


def running() -> str | None:
    """What a thread is compiling now, or None."""
    if not any(t.is_alive() for t in _threads):
        return None
    names = sorted(set(_current.values()))
    return f"compiling {', '.join(names)} ahead" if names else "compiling ahead"


def reset() -> None:
    """Forget finished jobs (a process that runs several pipelines: the tests)."""
    if running() is None:
        _events.clear()
        _threads.clear()
