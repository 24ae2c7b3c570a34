"""Process-wide JAX setup done once, before any computation: multi-host runtime, compile cache,
logging. Everything else is the same program on one process or many."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdctl.errors import PdctlError

if TYPE_CHECKING:
    from pdctl.config import Config

log = logging.getLogger("pdctl")
_initialized = False


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


def configure_devices() -> None:
    """One JAX CPU device per core, unless XLA_FLAGS already sets a device count (the user's
    choice, e.g. `--xla_force_host_platform_device_count=1`) or JAX has started its backends.
    GPUs and TPUs are not affected (they are the default backend where present)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    # Backends already initialised (an in-process caller): keep them.
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", cpu_devices())


def initialize(cfg: Config, flags: DistributedFlags | None = None) -> None:
    """jax.distributed when flags, [distributed] or the environment ask for it; compile cache;
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

    if cfg.compile.cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cfg.compile.cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if _initialized:
        return
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
    _initialized = True


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

_stop: int | None = None  # the first SIGTERM/SIGINT received while the handlers are installed
_depth = 0


def stop_requested() -> int | None:
    """The signal number of the first SIGTERM/SIGINT since the handlers went in, or None."""
    return _stop


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGINT into a request to stop cleanly (`stop_requested()`).

    Installed for a whole stage (imports, restore, compile, steps, the final save), so a signal
    at any point ends with a checkpoint and exit 3 rather than a kill mid-write. Re-entrant:
    only the outermost use installs and restores the handlers, and clears an earlier request.
    Later signals after the first are ignored so that a second Ctrl-C cannot cut a save short."""
    global _stop, _depth

    def handler(signum, frame):
        global _stop
        if _stop is None:
            _stop = signum

    old: dict[int, object] = {}
    if _depth == 0:
        _stop = None
        try:
            for s in (signal.SIGTERM, signal.SIGINT):
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
