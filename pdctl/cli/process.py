"""Process supervision for the command line: which commands stop cleanly on SIGTERM/SIGINT, the
clean stop itself (`stopping_cleanly`), and how the process ends (`run`, with os._exit where the
interpreter's own exit would wait for a call that cannot be cancelled)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import typer

# The commands that turn SIGTERM/SIGINT into a clean stop (`stopping_cleanly`), by function name:
# a signal that came while `main` started is theirs to act on. Every other command gets it back
# as it begins (`base.guard`).
STOPS_CLEANLY = {"init_weights", "pretrain", "warmup", "train", "run_pipeline", "resume",
                 "sweep_run"}  # fmt: skip


@contextlib.contextmanager
def stopping_cleanly():
    """SIGTERM/SIGINT from here on ask the stage to stop with a checkpoint (exit 3) instead of
    killing the process: installed before JAX is imported, the run restored or compiled.

    From the real entry point (`main`), the stage runs in a supervised child process instead
    (`pdctl.supervisor`): this process forwards the signals and answers for a child that dies
    by one."""
    from pdctl import supervisor

    if supervisor.active():
        import sys

        raise typer.Exit(supervisor.run_child(sys.argv[1:]))
    from pdctl.engine import runtime

    with runtime.stop_signals():
        for s in supervisor.take_held():  # a stop that came while the process started
            os.kill(os.getpid(), s)
        supervisor.tell(ready=True)
        runtime.on_stop(supervisor.tell_stopping)
        yield


def run(app: Any) -> None:
    """Run the Typer `app` as the `pdctl` command. Stage commands run supervised
    (`pdctl.supervisor`). A stage that stopped while a compile, restore or evaluation was still
    running on a worker thread ends the process with os._exit once its state and last line are
    written: that C++ call cannot be cancelled, and the interpreter would wait for it on the way
    out. A stage command's supervised child ends so too once its command is over (`_end_child`),
    in one process."""
    import sys

    from pdctl import supervisor

    supervisor.hold_signals()  # a stop while Python starts up is acted on, not fatal
    from pdctl.engine import runtime

    runtime.cpu_xla_flags()  # before JAX starts (any command)
    runtime.one_command()
    supervisor.enable()
    try:
        app(prog_name="pdctl")
    except SystemExit as e:
        rt = sys.modules.get("pdctl.engine.runtime")
        peers = sys.modules.get("pdctl.engine.peers")
        ahead = sys.modules.get("pdctl.engine.ahead")
        code = e.code if isinstance(e.code, int) else 1
        if ahead is not None:
            ahead.close()  # no compile ahead starts now; one running is `abandoned`
        if rt is not None and rt.abandoned():
            sys.stdout.flush()
            sys.stderr.flush()
            if peers is not None:
                peers.say_bye()
            rt.leave_together()
            os._exit(code)
        if peers is not None and peers.lost() is not None:
            # another process of the run died after this one's stage ended: JAX's shutdown
            # at exit would wait for it until the heartbeat timeout, then abort
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if supervisor.is_child() and runtime.distributed_client() is None:
            # one process (under jax.distributed, the exit is a meeting of all of them)
            _end_child(code)
        raise
    except BaseException:
        # anything else (a bug: the traceback is printed) while a compile ahead still runs: the
        # interpreter's exit would meet that C++ call on its way out
        ahead = sys.modules.get("pdctl.engine.ahead")
        if ahead is not None:
            ahead.close()
        if ahead is None or ahead.running() is None:
            raise
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _end_child(code: int) -> None:
    """End the supervised child of a stage command at once, its command over: the stage's
    state, checkpoints, metrics and last line are written and closed by then, and the parent
    (`pdctl.supervisor`) is the process the user waits on. The interpreter's own exit would
    still join every non-daemon thread and tear the accelerator's runtime down: after a stop
    in the final evaluation, a v5e run's process had not ended 150 s after its last line
    (docs/performance.md "The seventh chip session"; where it waited was not seen), where this
    CPU's ends in 2-3.5 s."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
