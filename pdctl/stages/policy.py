"""When a stage may run, continue or must start over, and how each way a stage ends is recorded.

- Staleness: a stage's result depends on the config tables the registry names
  (`config.fingerprint`); `Project.is_stale` compares the recorded fingerprint and upstream run
  ids with today's. Here: why (`stale_reason`), and the refusal to continue a stale run.
- Resume: which checkpoint a stage continues from (`resume_point`), which stages `pdctl resume`
  may continue (`resumable`), and what to run to finish a stage (`how_to_finish`).
- Failure: `guarded` runs a stage so that a stop, a user mistake, a crash or a lost process
  each leave its state as the README promises (never `running`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, Protocol

import jax

from pdctl.config import config_snapshot
from pdctl.engine import peers, runtime
from pdctl.engine.checkpoint import complete_steps, drop_unfinished, read_meta
from pdctl.engine.loop import Interrupted, describe_exception
from pdctl.errors import PdctlError, StageFailed, notify
from pdctl.project import WRITE_LOCK, Project, RunDirMoved
from pdctl.registry import command


class StageEnv(Protocol):
    """What these rules read of a stage's environment: `stages.env.StageEnv` is one (env
    imports this module, so the rules name only what they use)."""

    project: Project
    stage: str

    def fingerprint(self) -> str: ...

    def config_snapshot(self) -> dict[str, Any]: ...


def how_to_finish(project: Project, stage: str) -> str:
    """What to run so that `stage` ends `done`, as its status stands."""
    cli = command(stage)
    status = project.stage(stage).get("status", "pending")
    if status == "pending":
        return f"run `pdctl {cli}`"
    if status == "interrupted":
        if project.is_stale(stage):
            return f"its config changed since it stopped, so start it over: `pdctl {cli} --fresh`"
        return f"continue it with `pdctl {cli} --resume` (or `pdctl resume`)"
    if status == "running":
        if project.lock_is_free():
            return f"it crashed; continue it with `pdctl {cli} --resume` (or `pdctl resume`)"
        return "it is running in another pdctl process; wait for it to finish"
    if status == "failed" and project.stage(stage).get("lost_process") is not None:
        how = f"`pdctl {cli} --resume` (or `pdctl resume`)"
        return f"a process of its run was lost; continue it with {how}"
    if status == "failed":
        return (
            f"it failed; fix the cause and start it over with `pdctl {cli} --fresh`, or "
            f"continue from its last good checkpoint with `pdctl {cli} --resume`"
        )
    return f"run `pdctl {cli}`"


def stale_reason(project: Project, stage: str, changed: list[str] | None = None) -> str:
    """Why `stage` is stale, in words: the upstream stages rerun, or the keys that changed."""
    rerun = project.rerun_upstream(stage)
    if rerun:
        return f"{', '.join(rerun)} ran again since {stage} started"
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return "its config changed: " + ", ".join(changed[:3]) + more
    return "pdctl.toml differs from the config it ran with"


def checkpoint_changes(project: Project, stage: str, step: int) -> list[str]:
    """The config keys that differ between checkpoint `step` of `stage` and pdctl.toml now."""
    meta = read_meta(project.checkpoint_dir(stage), step) or {}
    return changed_keys(meta.get("config"), config_snapshot(project.config, stage))


def changed_keys(before: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """`key (old → new)` for every key whose value differs (added or removed ones included)."""
    if not before:
        return []
    out = []
    for k in sorted(set(before) | set(now), key=lambda k: (k not in now, k)):
        a, b = before.get(k, "<unset>"), now.get(k, "<unset>")
        if a != b:
            out.append(f"{k} ({a!r} → {b!r})")
    return out


def resumable(project: Project, stage: str) -> bool:
    """Interrupted, `running` with nobody holding the lock (a crash), or `failed` because a
    process of its run was lost (`lost_process`: nothing was wrong with the stage itself)."""
    st = project.stage(stage)
    status = st.get("status")
    if status == "failed":
        return st.get("lost_process") is not None
    return status == "interrupted" or (status == "running" and project.lock_is_free())


def own_steps(env: StageEnv) -> list[int]:
    """The complete checkpoints that belong to the stage's current run (its run id), oldest
    first. Checkpoints a fresh run has not yet replaced, and those of older runs, are not the
    current run's progress and are never resumed from."""
    run_id = env.project.stage(env.stage).get("run_id")
    directory = env.project.checkpoint_dir(env.stage)
    steps = complete_steps(directory)
    if not run_id:
        return steps
    out = []
    for s in steps:
        meta = read_meta(directory, s)
        # Unreadable meta: keep it, the restore decides (and falls back if it must).
        if meta is None or meta.get("run_id") in (None, run_id):
            out.append(s)
    return out


def resume_point(env: StageEnv, *, resume: bool, fresh: bool) -> int | None:
    """The checkpoint step to continue from, or None to start fresh; refuses to drop progress
    and to continue a run under a config other than the one it started with."""
    stage, cli = env.stage, command(env.stage)
    if resume and fresh:
        raise PdctlError("--resume and --fresh: choose one (continue the stage, or start it over)")
    if fresh:
        return None
    st = env.project.stage(stage)
    status = st.get("status", "pending")
    latest = None
    if status != "pending":
        steps = own_steps(env)
        latest = steps[-1] if steps else None
    if resume:
        if status == "done":
            raise PdctlError(
                f"{stage} is done; nothing to resume (`pdctl {cli} --fresh` reruns it)"
            )
        if status == "pending":
            raise PdctlError(f"{stage} has not started; nothing to resume: run `pdctl {cli}`")
        if latest is None:
            how = {"running": "crashed", "failed": "failed"}.get(status, "stopped")
            notify(f"{stage}: its last run {how} before its first checkpoint; starting it over")
            return None
        refuse_if_stale(env, latest)
        return latest
    if status in ("interrupted", "running", "failed") and latest is not None:
        refuse_if_stale(env, latest)
        raise PdctlError(
            f"{stage} stopped at step {latest} ({status}); continue it with "
            f"`pdctl {cli} --resume` or start over with `pdctl {cli} --fresh`"
        )
    return None


def is_stale_run(env: StageEnv) -> bool:
    """The stage's current run began under another config (`--steps` included) or read from
    a run of an earlier stage that has since been replaced."""
    st = env.project.stage(env.stage)
    return bool(env.project.rerun_upstream(env.stage)) or st.get("fingerprint") != env.fingerprint()


def refuse_if_stale(env: StageEnv, latest: int) -> None:
    """Continuing `env.stage` from checkpoint `latest` would mix two configs (or two upstream
    results): refuse, naming what changed and the two ways on."""
    if not is_stale_run(env):
        return
    stage, cli = env.stage, command(env.stage)
    meta = read_meta(env.project.checkpoint_dir(stage), latest) or {}
    changed = changed_keys(meta.get("config"), env.config_snapshot())
    reason = stale_reason(env.project, stage, changed)
    undo = "" if env.project.rerun_upstream(stage) else ", or restore the config to continue it"
    raise PdctlError(
        f"{stage} is stale, so it cannot continue from step {latest} ({reason}); start over "
        f"with `pdctl {cli} --fresh`{undo}"
    )


@contextlib.contextmanager
def guarded(project: Project, stage: str) -> Iterator[None]:
    """Run one stage so that every way it can end keeps the README's promises.

    SIGTERM/SIGINT are turned into a clean stop from the start (imports, restore, compile
    included). A user mistake found after the stage began (exit 2) puts its state back as it
    was; any other failure leaves status `failed` and one line (exit 1), never `running`."""
    from pdctl import supervisor

    with runtime.stop_signals(), peers.watch(lambda lost: _peer_lost(project, stage, lost)):
        supervisor.tell(
            stage=stage, cli=command(stage), toml=str(project.path), writer=runtime.is_writer(),
            processes=jax.process_count(),
        )  # fmt: skip
        try:
            try:
                yield
            except Exception as e:
                if not isinstance(e, PdctlError):  # a collective failed: did a process die?
                    peers.settle()
                moved = project.moved()
                if moved:  # whatever failed first (a checkpoint, a state write) failed for that
                    raise RunDirMoved(f"{stage}: {moved}") from None
                raise
        except runtime.StopNow as e:  # a long call before the step loop was left running
            raise Interrupted(_left_running(project, stage, e)) from None
        except RunDirMoved:
            raise  # nothing can be written where the run directory was
        except (Interrupted, StageFailed):
            _mark_failed(project, stage, None)
            raise
        except PdctlError:
            _roll_back(project, stage)
            raise
        except Exception as e:
            line = describe_exception(stage, e)
            _mark_failed(project, stage, line)
            raise StageFailed(f"{stage}: {line}") from e
        finally:
            project.attempts.pop(stage, None)
        signum = runtime.stop_requested()
        if signum is not None:
            import signal

            name = signal.Signals(signum).name
            status = project.stage(stage).get("status", "pending")
            if project.is_done(stage):  # it had finished: nothing is left to stop or resume
                notify(f"{stage}: {name} came after it finished; it is {status}")
                return
            raise Interrupted(
                f"{stage}: stopped by {name} after it ended ({status} at step "
                f"{project.stage(stage).get('step')}); continue with `pdctl resume`"
            )


def _peer_lost(project: Project, stage: str, lost: int) -> None:
    """Another process of the run is gone (`engine.peers`), so this stage cannot go on.
    Process 0 records it `failed` at its last complete checkpoint with `lost_process`, which
    `pdctl resume` continues (with any number of processes); nothing partial is kept (a save
    in progress is dropped, no stop checkpoint is taken). Every process says one line and
    ends at once with os._exit(1): it may be waiting in a barrier or a collective that ends
    only with JAX's heartbeat timeout, and so would JAX's shutdown at exit. A stage that had
    already ended here is left as it is (the process then ends at exit: `cli.main`).

    Runs on pdctl's watchdog thread (or on the main thread, from a failure path): it takes
    the state's write lock and keeps it, so no write of the main thread follows its own."""
    from pdctl import supervisor

    supervisor.tell(lost=lost)
    WRITE_LOCK.acquire()
    st = project.stage(stage)
    began = stage in project.attempts
    if began and st.get("status") != "running":  # it ended here: nothing left to stop
        WRITE_LOCK.release()
        return
    who = (
        f"{stage}: process {lost} of {jax.process_count()} is gone (killed, or crashed: see "
        "its output), so the run cannot go on"
    )
    if not began:
        line = f"{who}; it had not begun the stage here: nothing was written"
    elif project.writer:
        latest = supervisor.latest_checkpoint(project, stage, st)
        with contextlib.suppress(Exception):
            drop_unfinished(project.checkpoint_dir(stage))
        kept = (
            f"the last checkpoint is step {latest}; continue with `pdctl resume`"
            if latest is not None
            else "no checkpoint of this run was saved; `pdctl resume` starts it over"
        )
        line = f"{who}; nothing partial was saved, {kept} (with any number of processes)"
        try:
            project.update_stage(
                stage, status="failed", error=line[:300], checkpoint=latest, lost_process=lost
            )
        except Exception as e:
            line += f" (its state could not be written: {e})"
    elif lost == 0:
        line = (
            f"{who}; only process 0 writes the stage's state, so this one writes nothing: "
            "`pdctl status` shows what process 0 last recorded"
        )
    else:
        line = f"{who}; process 0 records the stage's state (see its output, or `pdctl status`)"
    sys.stdout.flush()
    sys.stderr.flush()
    # The last line: what JAX's agent may log while the process ends (process 0's service
    # gone) would only repeat it. Its threads write to fd 2 at any moment, so fd 2 goes to
    # /dev/null first and the line is written whole, in one write, to a copy of the old one.
    out = 2
    with contextlib.suppress(OSError):
        out = os.dup(2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    with contextlib.suppress(OSError):
        os.write(out, f"error: {line}\n".encode())
    supervisor.tell_said(1)
    os._exit(1)


def _left_running(project: Project, stage: str, e: runtime.StopNow) -> str:
    """A stop while the stage restored, tokenized or compiled before its step loop, in a call
    that did not end: the stage is `interrupted` where its last checkpoint is (nothing new is
    saved), and the line says so."""
    began = stage in project.attempts
    st = project.stage(stage)
    if began and project.writer and st.get("status") == "running":
        with contextlib.suppress(Exception):
            project.update_stage(stage, status="interrupted")
    where = f"{stage}: stopped by {e.name} while {e.what} (left unfinished)"
    if not began:
        return f"{where}, before the stage began; nothing was written"
    latest = st.get("checkpoint")
    if latest is not None:
        return f"{where}; the last checkpoint, step {latest}, is kept; continue with `pdctl resume`"
    return f"{where}; no checkpoint of this run was saved; `pdctl resume` starts it over"


def _mark_failed(project: Project, stage: str, error: str | None) -> None:
    """A stage this process began and left `running` ends `failed`."""
    if stage not in project.attempts or not project.writer:
        return
    if project.stage(stage).get("status") == "running":
        with contextlib.suppress(Exception):
            project.update_stage(stage, status="failed", error=(error or "")[:300] or None)


def _roll_back(project: Project, stage: str) -> None:
    """Undo this process's writes to `stage`'s state after a user mistake: nothing written."""
    attempt = project.attempts.get(stage)
    if attempt is None or not project.writer:
        return
    if attempt["ckpt"]:  # it got as far as a checkpoint: keep that, say it failed
        _mark_failed(project, stage, "stopped by an input error")
        return
    before = attempt["before"]
    with contextlib.suppress(Exception):
        if before:
            project.state[stage] = before
        else:
            project.state.pop(stage, None)
        project.save_state()
