"""Process-wide JAX setup done once, before any computation: multi-host runtime, compile cache,
logging. Everything else is the same program on one process or many."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

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


def initialize(cfg: Config, flags: DistributedFlags | None = None) -> None:
    """jax.distributed when flags, [distributed] or the environment ask for it; compile cache."""
    global _initialized
    import jax

    if cfg.compile.cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cfg.compile.cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if _initialized:
        return
    flags = flags or DistributedFlags()
    d = cfg.distributed
    coordinator = flags.coordinator or d.coordinator
    if coordinator:
        nproc = flags.num_processes or d.num_processes
        pid = flags.process_id if flags.process_id is not None else d.process_id
        if nproc <= 0 or pid < 0:
            from pdctl.errors import PdctlError

            raise PdctlError(
                "distributed: a coordinator needs num_processes and process_id "
                "(--num-processes N --process-id I, or [distributed])"
            )
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
    _initialized = True


def _cpu_collectives() -> None:
    """Cross-process collectives on the CPU backend go through gloo (GPU/TPU ignore this)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_writer() -> bool:
    """Only process 0 writes pdctl.toml, metrics and trackers."""
    import jax

    return jax.process_index() == 0
