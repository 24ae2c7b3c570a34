"""Compiles started ahead on one host thread (`[compile] ahead`): `pdctl run` compiles its later
stages' steps into the persistent compile cache while the earlier stages run on the devices,
and each training stage its own step while it restores its state, and its evaluation's
programs while its steps run.

One worker thread runs the jobs (`submit`), the lowest rank first (the stage's place in the
pipeline, so that a stage's own job does not wait behind a later stage's compile), in the order
submitted within a rank; `pdctl run`'s jobs are held back (`hold`) until the stage that runs
first has queued its own, since a compile already started cannot be overtaken. Each job's
event is set when it ends, however it ends: a failed job only costs its stage the compile it
would have done anyway. A compile is one C++ call and is never cancelled: `close` drops the
jobs not yet started, and a process that ends while one runs ends with os._exit (`running`:
`cli.process.run`), as for a compile a stop left running.

JAX's tracing caches are cleared between stages (`runtime.release_device_memory`); jobs trace
and lower under `TRACING`, which that clearing takes too, and compile outside it."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("pdctl")

TRACING = threading.Lock()
_jobs: queue.PriorityQueue = queue.PriorityQueue()
_order = itertools.count()
_worker: threading.Thread | None = None
_busy: str | None = None  # the job the worker runs now
_lock = threading.Lock()  # the worker's start, `_busy` and `_closed`
_closed = False  # the process is ending: no job starts any more
_held: list[tuple] = []  # queued only with the next `submit` or `release` (`hold`)


def enabled(setting: bool | str) -> bool:
    """`[compile] ahead`: "auto" is on for one process whose devices are not the host's own
    cores (a GPU or TPU: the host's cores compile while the devices run). On a CPU the stages'
    own programs need those cores (measured: a 2-core machine gained nothing, docs/performance.md
    "Time to the first train step on this CPU, part 2"); several processes (jax.distributed)
    would each end on their own if one still compiled. Only with the compile cache, which
    carries the programs from `pdctl run`'s jobs to the stages."""
    import jax

    from pdctl.engine import compile_cache

    if setting == "auto":
        setting = jax.default_backend() != "cpu" and jax.process_count() == 1
    return bool(setting) and compile_cache.active()


def submit(name: str, fn: Callable[[], None], rank: int = 0) -> threading.Event:
    """Queue `fn` for the worker thread (with any jobs held back: `hold`); the event is set
    when it has ended (or was dropped by `close`)."""
    done = threading.Event()
    with _lock:
        _jobs.put((rank, next(_order), name, fn, done))
        _queue_held()
    return done


def hold(name: str, fn: Callable[[], None], rank: int = 0) -> threading.Event:
    """As `submit`, but queued only with the next `submit` or `release`: `pdctl run`'s jobs for
    later stages wait until the stage that runs first has queued its own step, which a job
    already compiling would otherwise hold up."""
    done = threading.Event()
    with _lock:
        _held.append((rank, next(_order), name, fn, done))
    return done


def release() -> None:
    """Queue the jobs held back (`hold`), if any."""
    with _lock:
        if _held:
            _queue_held()


def _queue_held() -> None:  # under _lock
    global _worker
    for job in _held:
        _jobs.put(job)
    _held.clear()
    if _worker is None or not _worker.is_alive():
        _worker = threading.Thread(target=_work, name="pdctl: compiling ahead", daemon=True)
        _worker.start()


def _work() -> None:
    global _busy
    while True:
        _, _, name, fn, done = _jobs.get()
        with _lock:
            if _closed:
                done.set()
                continue
            _busy = name
        t0 = time.perf_counter()
        try:
            fn()
            log.info("compiled %s ahead in %.1f s", name, time.perf_counter() - t0)
        except BaseException as e:  # the stage compiles it itself, as it would have
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("compiling %s ahead failed (%s); it compiles when it starts",
                        name, first[:200])  # fmt: skip
        finally:
            with _lock:
                _busy = None
            done.set()


def current() -> str | None:
    """The job the calling thread runs (None off the worker thread)."""
    return _busy if threading.current_thread() is _worker else None


def running() -> str | None:
    """What the worker is compiling now, or None."""
    name = _busy
    return None if name is None else f"compiling {name} ahead"


def close() -> None:
    """The process is ending: no queued or held job starts any more (their events are set:
    nobody waits for them); one already running is `running`."""
    global _closed
    with _lock:
        _closed = True
        _held.clear()
    while True:
        try:
            *_, done = _jobs.get_nowait()
        except queue.Empty:
            return
        done.set()
