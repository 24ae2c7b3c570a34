"""Process-wide JAX setup done once, before any computation: multi-host runtime, compile cache,
logging. Everything else is the same program on one process or many."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdctl.errors import PdctlError

if TYPE_CHECKING:
    from pathlib import Path

    from jax.sharding import Mesh

    from pdctl.config import Config

log = logging.getLogger("pdctl")
_initialized = False
# How a stage logs (`pdctl --log-format`; engine.loop): the flag is handed to the stage's
# process (a supervised child) through this variable.
LOG_FORMAT_ENV = "PDCTL_LOG_FORMAT"
LOG_FORMATS = ("auto", "text", "json")
# When the `pdctl` command started (wall clock): a supervised stage's process inherits it, so
# that a stage's `first_step_s` counts from the command, not from its own process.
STARTED_ENV = "PDCTL_STARTED"
_T0 = time.time()


def started() -> float:
    """The wall-clock time the `pdctl` command started (this process's, unless inherited)."""
    value = os.environ.get(STARTED_ENV)
    try:
        return float(value) if value else _T0
    except ValueError:
        return _T0


# Set by the real entry point (`cli.process.run`): this process runs one command and ends.
_one_command = False


def one_command() -> None:
    global _one_command
    _one_command = True


def freeze_heap() -> None:
    """In a process that runs one command (`one_command`), once its modules are imported: every
    object alive goes to the collector's permanent generation
    (`gc.freeze`), where no later collection walks it. The imports leave ~160,000 objects
    (JAX, orbax, pdctl), which every full collection would otherwise traverse: the two of each
    `release_device_memory` between the stages of `pdctl run` took ~0.25 s, then ~0.05 s. (No
    collection first: it would cost ~0.1 s, for the few cycles the imports left.) Not in a
    process that runs many commands (the tests' in-process CLI): what it froze could never be
    collected."""
    if _one_command:
        import gc

        gc.freeze()


@dataclass(frozen=True)
class DistributedFlags:
    """`pdctl --coordinator HOST:PORT --num-processes N --process-id I` (override the config)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever `sys.stderr` is when it emits (CliRunner and pytest swap
    it; a handler bound to the stream of the moment would later write to a closed file)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging() -> None:
    """pdctl's own logger to stderr. Only that logger is touched: JAX's loggers stay enabled
    (JAX_LOG_COMPILES=1 shows), and no other handler is reconfigured. Not `dictConfig`: even
    with disable_existing_loggers=False it closes every existing handler, and absl's handler
    then closes the stream it holds whenever that is not the current sys.stderr (in-process
    runs: it closed pytest's capture file)."""
    logger = logging.getLogger("pdctl")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)


def _env_says_multihost() -> bool:
    env = os.environ
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return True
    # Cloud TPU pod slices: several workers listed.
    return "," in env.get("TPU_WORKER_HOSTNAMES", "")


def cpu_devices() -> int:
    """The CPU devices pdctl asks JAX for: one per core this process may run on (XLA:CPU runs
    each device's program on one thread, so a single device leaves the other cores idle)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# XLA:CPU options pdctl sets unless XLA_FLAGS names them, for the jaxlib versions they were
# measured on (an unknown flag in XLA_FLAGS aborts the process, and these are experimental):
# YNNPACK keeps its dot fusions but not its reduction fusions, which took materialised
# broadcasts as operands; without them XLA fuses the CI functions' (B, C, hidden) work into
# its own loops (docs/performance.md, the TMS 5-2 step).
CPU_XLA_FLAGS = {
    "0.10.2": ("--xla_cpu_experimental_ynn_fusion_type=individual_dot,individual_convolution",),
}


def cpu_xla_flags() -> None:
    """Add `CPU_XLA_FLAGS` to XLA_FLAGS (before JAX starts its backends: afterwards they do
    nothing). GPUs and TPUs ignore XLA:CPU's flags."""
    try:
        from jaxlib.version import __version__ as version
    except ImportError:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    add = [f for f in CPU_XLA_FLAGS.get(version, ()) if f.split("=")[0] not in flags]
    if add:
        os.environ["XLA_FLAGS"] = " ".join([flags, *add]).strip()


def accelerator_host() -> bool:
    """Whether JAX's default backend here is not the CPU, told without starting JAX: the
    first platform of JAX_PLATFORMS, else an installed TPU runtime or a GPU plugin."""
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() != "cpu"
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")
    if any(importlib.util.find_spec(name) is not None for name in plugins):
        return True
    # libtpu also serves a CPU machine that compiles for a TPU (`inspect-sharding --topology`,
    # the tpu-aot extra): a TPU host is one with TPU chips, counted as JAX counts them
    return importlib.util.find_spec("libtpu") is not None and _tpu_chips() > 0


def _tpu_chips() -> int:
    try:
        from jax._src import hardware_utils

        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except Exception:  # another JAX: take libtpu at its word, as before
        return 1


def cpu_without_tpu_chips() -> None:
    """libtpu without TPU chips (the tpu-aot extra on a CPU machine) would make JAX load it for
    nothing, print its initialization errors and take the chips' lockfile: JAX's backend is
    then the CPU alone. Not where JAX_PLATFORMS is set, nor once JAX has started its backends
    (an in-process caller's choice stands). Every entry point that starts JAX calls it: the
    commands through `configure_devices`, the Python API (`pdctl.open`) itself."""
    import importlib.util

    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return
    if _tpu_chips() == 0:
        import jax

        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_platforms", "cpu")


def configure_devices() -> None:
    """One JAX CPU device per core, unless XLA_FLAGS already sets a device count (the user's
    choice, e.g. `--xla_force_host_platform_device_count=1`) or JAX has started its backends.
    On a host with an accelerator (JAX_PLATFORMS naming another platform first, or a TPU / GPU
    plugin installed) nothing changes: the CPU devices would only hold threads and memory.
    Where libtpu is installed without TPU chips, the CPU alone (`cpu_without_tpu_chips`)."""
    import jax

    cpu_without_tpu_chips()
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    if accelerator_host():
        return

    # Backends already initialised (an in-process caller): keep them.
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", cpu_devices())


# XLA:CPU runs a collective between the devices of one process as an in-process rendezvous,
# and admits at most 32 programs in flight per device (`max_inflight_computations_per_device`,
# not settable from JAX). When a program with a collective is in flight and 32 more
# multi-device programs are dispatched before it completes, one device's part of it waits in
# the rendezvous while the other device's launch waits for an in-flight slot: after 40 s XLA
# aborts the process (`rendezvous.cc: Termination timeout for all reduce ...`, SIGABRT). So
# pdctl never dispatches many programs behind a collective one: the loop runs at most
# `MAX_AHEAD` steps ahead, and on such a mesh the evaluation, which dispatches dozens of small
# per-site ops, works on replicated arrays and has no collective at all
# (`collective_free_eval`). tests/engine/test_rendezvous.py pins the condition and the fix.
CPU_INFLIGHT_LIMIT = 32


def collective_free_eval(mesh: Mesh) -> bool:
    """Whether the evaluation on `mesh` must do without collectives: XLA:CPU with several
    devices in this process (see above). GPUs and TPUs, one device, or CPU collectives
    between processes (gloo) keep the evaluation batch sharded."""
    devices = list(mesh.devices.flat)
    return (
        len(devices) > 1
        and devices[0].platform == "cpu"
        and len({d.process_index for d in devices}) == 1
    )


def initialize(
    cfg: Config, flags: DistributedFlags | None = None, root: Path | None = None
) -> None:
    """jax.distributed when flags, [distributed] or the environment ask for it; compile cache
    (a cache directory inside the run directory `root` is checked for symlinks first);
    one CPU device per core (`configure_devices`)."""
    global _initialized
    flags = flags or DistributedFlags()
    d = cfg.distributed
    coordinator = flags.coordinator or d.coordinator
    nproc = flags.num_processes or d.num_processes
    pid = flags.process_id if flags.process_id is not None else d.process_id
    # The flags are checked before anything starts: a bad one is a line, not a hang.
    if coordinator:
        _check_address(
            coordinator, "--coordinator" if flags.coordinator else "distributed.coordinator"
        )
        if nproc <= 0 or pid < 0:
            raise PdctlError(
                "distributed: a coordinator needs num_processes and process_id "
                "(--num-processes N --process-id I, or [distributed])"
            )
        if pid >= nproc:
            key = "--process-id" if flags.process_id is not None else "distributed.process_id"
            raise PdctlError(
                f"{key}: must be below the number of processes ({nproc}), got {pid} "
                "(process ids are 0-based)"
            )
    elif (
        flags.num_processes is not None or flags.process_id is not None
    ) and not _env_says_multihost():
        raise PdctlError(
            "--num-processes/--process-id need --coordinator HOST:PORT (the address of process 0)"
        )
    import jax

    # Relative paths were made relative to the run directory when pdctl.toml was loaded. The
    # cache (by default in the run directory) holds executables JAX loads and runs: a private
    # directory pdctl created for this user, and only entries signed with this user's key
    # (`compile_cache`).
    from pdctl.engine import compile_cache

    compile_cache.install_chosen(cfg.compile.cache_dir, root)
    if _initialized:
        return
    cpu_xla_flags()
    configure_devices()
    if coordinator:
        _cpu_collectives()
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=nproc,
            process_id=pid,
            local_device_ids=d.local_device_ids or None,
            initialization_timeout=d.init_timeout_s,
            heartbeat_timeout_seconds=d.heartbeat_timeout_s,
        )
    elif _env_says_multihost():
        _cpu_collectives()
        jax.distributed.initialize(
            initialization_timeout=d.init_timeout_s,
            heartbeat_timeout_seconds=d.heartbeat_timeout_s,
        )
    check_backend()
    if jax.process_count() > 1:
        _watch_peers()
    _initialized = True


def _watch_peers() -> None:
    """Connections between the processes that tell within a second when one dies
    (`engine.peers`); JAX alone notices only after `heartbeat_timeout_s`."""
    import jax

    from pdctl.engine import peers

    state = sys.modules["jax._src.distributed"].global_state
    peers.start(jax.process_index(), jax.process_count(), state.coordinator_address or "")


def _check_address(address: str, key: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PdctlError(f"{key}: expected HOST:PORT (e.g. node0:1234), got {address!r}")


def check_backend() -> None:
    """JAX's devices, or one line saying why there are none (`JAX_PLATFORMS=gpu` on a machine
    without a GPU, a CUDA install that does not load, ...)."""
    import jax

    try:
        jax.devices()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        platforms = os.environ.get("JAX_PLATFORMS", "")
        fix = (
            f"JAX_PLATFORMS={platforms}: no such device here; unset it or install the matching jax"
            if platforms
            else "JAX found no usable device; check the jax installation"
        )
        raise PdctlError(f"{fix} ({first})") from None


def _cpu_collectives() -> None:
    """Cross-process collectives on the CPU backend go through gloo (GPU/TPU ignore this)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_writer() -> bool:
    """Only process 0 writes pdctl.toml, metrics and trackers."""
    import jax

    return jax.process_index() == 0


# ---- SIGTERM / SIGINT ---------------------------------------------------------------------------
#
# A signal is a request: it sets `_stop`, and the stage acts on it at the next point where it
# can stop cleanly (between steps: a stop checkpoint). Long calls into C++ (XLA compiles, an
# evaluation, an orbax restore, tokenization) never return to Python in between, so they run on
# a worker thread (`interruptible`) while the main thread waits in short slices: when a stop is
# requested and the call has not ended `STOP_GRACE_S` later, the stage leaves it running
# (`StopNow`), records `interrupted` with the last checkpoint it has, and the process ends with
# `os._exit` (`abandoned()`: cli.main), since a C++ call cannot be cancelled.
#
# Under jax.distributed, JAX's preemption sync manager owns SIGTERM (its C++ notifier replaces
# any Python handler) and tells every process through the coordination service; the training
# loop then stops at the step all processes agree on (`agreed_stop`, JAX's
# `reached_preemption_sync_point`). A SIGINT (or a SIGTERM that came before jax.distributed
# started) is handed over to that notifier as a SIGTERM to this process, so it too reaches all.

_stop: int | None = None  # the first SIGTERM/SIGINT received while the handlers are installed
_depth = 0
_abandoned: str | None = None  # what a stop left running on a worker thread
_handed_over = False  # this process's own signal was passed on to the preemption notifier
_notice_seen = False  # the coordination service holds a preemption notice
_notice_checked = 0.0
_on_stop: list = []  # called once with the signal when a stop is first seen (the supervisor)
_told = False

STOP_GRACE_S = 2.0  # how long a long call may still run after a stop before it is left behind
PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"  # set by JAX's preemption notifier


class StopNow(BaseException):
    """A stop was requested while a long call ran on a worker thread (`interruptible`) and the
    call did not end within `STOP_GRACE_S`: the stage stops now and leaves it running.

    A BaseException, so the `except Exception` of the code it passes through (a restore that
    turns every error into "does not restore") lets it by."""

    def __init__(self, signum: int, what: str):
        super().__init__(signum, what)
        self.signum = signum
        self.what = what

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def distributed_client():
    """jax.distributed's coordination client when it started in this process, else None
    (looked up without importing JAX)."""
    mod = sys.modules.get("jax._src.distributed")
    return getattr(getattr(mod, "global_state", None), "client", None)


def _preemption_manager():
    """JAX's preemption sync manager when jax.distributed started one (it then owns SIGTERM)."""
    mod = sys.modules.get("jax._src.distributed")
    state = getattr(mod, "global_state", None)
    return getattr(state, "preemption_sync_manager", None)


def coordinated() -> bool:
    """Stops are agreed between processes (jax.distributed with its preemption service)."""
    return _preemption_manager() is not None


def _hand_over() -> None:
    """Pass this process's own signal on to JAX's preemption notifier (a SIGTERM to itself),
    so every process of the run hears of it."""
    global _handed_over
    if _handed_over or _stop is None:
        return
    _handed_over = True
    os.kill(os.getpid(), signal.SIGTERM)


def _notice_posted() -> bool:
    """The coordination service holds a preemption notice: some process got SIGTERM (asked at
    most every 0.25 s; once seen, remembered)."""
    global _notice_seen, _notice_checked
    if _notice_seen:
        return True
    import time

    now = time.monotonic()
    if now - _notice_checked < 0.25:
        return False
    _notice_checked = now
    client = distributed_client()
    if client is None:
        return False
    try:
        client.key_value_try_get(PREEMPTION_NOTICE_KEY)
    except Exception:  # NOT_FOUND: no notice (or the service is gone)
        return False
    _notice_seen = True
    return True


def _seen(signum: int | None) -> int | None:
    global _told
    if signum is not None and not _told:
        _told = True
        for fn in _on_stop:
            with contextlib.suppress(Exception):
                fn(signum)
    return signum


def stop_requested() -> int | None:
    """The signal number of the first SIGTERM/SIGINT since the handlers went in, or None. Under
    jax.distributed also SIGTERM once any process of the run received one (the preemption
    notice): every process then leaves a long call it is in."""
    if _preemption_manager() is None:
        return _seen(_stop)
    if _stop is not None:
        _hand_over()
        return _seen(_stop)
    return _seen(signal.SIGTERM if _notice_posted() else None)


def agreed_stop(step: int) -> int | None:
    """For the training loop, asked once before the first step and once per step (`step`: the
    steps done so far), the same way by every process: the signal to stop on now, or None.

    One process: the pending signal. Under jax.distributed: SIGTERM (or this process's SIGINT)
    once every process has reached the step at which they agreed to stop (JAX's preemption
    sync point: the step after the furthest any process had reported when the notice came).

    The counter JAX keeps is the last value passed to `reached_preemption_sync_point` by
    anyone in the process, and orbax's CheckpointManager passes the step it saves. So the loop
    passes the step too: a counter of its own would be set back by every checkpoint, and a
    notice that came during one would fix a sync point the loop had already passed (both
    processes then trained on and deadlocked)."""
    if _preemption_manager() is None:
        return _seen(_stop)
    from jax.experimental import multihost_utils

    if _stop is not None:
        _hand_over()
    if multihost_utils.reached_preemption_sync_point(int(step)):
        return _seen(_stop or signal.SIGTERM)
    return None


def on_stop(fn) -> None:
    """Call `fn(signum)` once, when a stop request is first acted on (the supervisor hears of
    it: a child that then dies by a signal was stopping, not failing)."""
    if fn not in _on_stop:
        _on_stop.append(fn)


def abandoned() -> str | None:
    """What a stop left running on a worker thread (the process must then end with os._exit:
    that call cannot be cancelled and would hold up the interpreter's exit), or None. A compile
    started ahead (`engine.ahead`) that is still running counts as well."""
    from pdctl.engine import ahead

    return _abandoned or ahead.running()


def barrier(name: str, timeout_s: float) -> None:
    """Under jax.distributed, wait until every process has reached `name` (each name once per
    job); a no-op in one process. Waits on a worker thread (`interruptible`), so a stop is
    acted on; a process that does not come within `timeout_s` is an error line."""
    client = distributed_client()
    if client is None:
        return
    try:
        interruptible(client.wait_at_barrier, name, int(timeout_s * 1000),
                      what=f"waiting for the other processes ({name})")  # fmt: skip
    except Exception as e:  # DEADLINE_EXCEEDED, a process that died (StopNow passes: Base)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PdctlError(
            f"distributed: not every process reached {name!r} within {timeout_s:.0f} s "
            f"(one failed or was stopped: see its output) ({first[:200]})"
        ) from None


def leave_together(timeout_s: float = 10.0) -> None:
    """Under jax.distributed, before a stop that abandoned a call ends the process with
    os._exit: every process meets at one barrier, and process 0 (which hosts the coordination
    service) then waits a moment, so it leaves last. Otherwise a process still writing its stop
    line sees the service vanish, and JAX's agent aborts it ("the JAX distributed service
    detected fatal errors", SIGABRT). A process that does not come (it ended another way)
    costs the others `timeout_s`; any error here is ignored: the process is ending anyway."""
    mod = sys.modules.get("jax._src.distributed")
    state = getattr(mod, "global_state", None)
    client = getattr(state, "client", None)
    if client is None:
        return
    import time

    with contextlib.suppress(Exception):
        client.wait_at_barrier("pdctl-stop-abandoned", int(timeout_s * 1000))
    if getattr(state, "process_id", 0) == 0:
        time.sleep(1.0)


def interruptible(fn, *args, what: str, **kwargs):
    """`fn(*args, **kwargs)`, with SIGTERM/SIGINT still acted on while it runs.

    It runs on a worker thread and the main thread waits in 0.1 s slices: when a stop is
    requested and `fn` has not returned `STOP_GRACE_S` later, `StopNow` is raised (naming
    `what`, e.g. "compiling the step") and `fn` is left running. A call that ends within the
    grace returns as usual (the caller then stops where it is: a quick restore still ends in a
    stop checkpoint). Outside the handlers, or off the main thread, `fn` is simply called."""
    import threading
    import time

    if _depth == 0 or threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    box: dict = {}

    def work() -> None:
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the main thread as it is
            box["err"] = e

    worker = threading.Thread(target=work, name=f"pdctl: {what}", daemon=True)
    worker.start()
    deadline = None
    while True:
        worker.join(0.1)
        if not worker.is_alive():
            break
        signum = stop_requested()
        if signum is None:
            continue
        if deadline is None:
            deadline = time.monotonic() + STOP_GRACE_S
        elif time.monotonic() >= deadline:
            global _abandoned
            _abandoned = what
            raise StopNow(signum, what)
    if "err" in box:
        raise box["err"]
    return box.get("out")


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGINT into a request to stop cleanly (`stop_requested()`).

    Installed for a whole stage (imports, restore, compile, steps, the final save), so a signal
    at any point ends with a checkpoint and exit 3 rather than a kill mid-write. Re-entrant:
    only the outermost use installs and restores the handlers, and clears an earlier request.
    Later signals after the first are ignored so that a second Ctrl-C cannot cut a save short.
    Where JAX's preemption notifier already owns SIGTERM (jax.distributed), it keeps it."""
    global _stop, _depth, _handed_over, _told

    def handler(signum, frame):
        global _stop
        if _stop is None:
            _stop = signum
            if _preemption_manager() is not None:  # tell the other processes
                _hand_over()

    old: dict[signal.Signals, Any] = {}  # the handlers `signal.signal` replaced
    if _depth == 0:
        _stop = None
        _handed_over = _told = False
        try:
            for s in (signal.SIGTERM, signal.SIGINT):
                if s == signal.SIGTERM and _preemption_manager() is not None:
                    continue
                old[s] = signal.signal(s, handler)
        except ValueError:  # not the main thread: no signal handling
            pass
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for s, h in old.items():
            signal.signal(s, h)


def release_device_memory() -> None:
    """Free what finished work left on the devices: unreferenced arrays (cycles included) and
    every compiled executable JAX caches, with the memory an accelerator's runtime reserves for
    their temporaries (a TPU keeps those apart from its buffers until the executable goes).

    `pdctl run` calls it between stages, so that the train stage finds the devices as a fresh
    process would: the warmup step compiled for 52.7 s on a v5e held a 6.4 GiB program that
    the train step then could not fit beside (issue 49). Whatever the caller still references
    stays; the next compile of a freed program reads the persistent cache where there is one."""
    import gc

    import jax

    from pdctl.engine import ahead

    gc.collect()
    # not while a compile ahead traces (`engine.ahead`); after a stop, not waiting for it either
    # (the process is ending: nothing more runs on the devices)
    if ahead.TRACING.acquire(blocking=stop_requested() is None):
        try:
            jax.clear_caches()
        finally:
            ahead.TRACING.release()
    gc.collect()
