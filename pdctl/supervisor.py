"""A stage command (`pdctl init-weights|pretrain|warmup|train|run|resume`) as two processes.

The process the user (or a scheduler) starts and signals is a thin parent that imports no JAX:
it runs the same command in a child, forwards SIGTERM/SIGINT to it, and waits. What the child
cannot say itself, the parent says: when the child dies by a signal (SIGABRT from XLA or gloo,
SIGSEGV, SIGKILL from the out-of-memory killer) or exits leaving a stage `running`, the parent
writes that stage `failed` (or `interrupted`, when a stop had been asked for) with one line,
keeping the last checkpoint, and exits 1 (3).

The parent also holds the run directory's lock for the child (the child asks it to take and
release it), so the lock lives exactly as long as the process the user knows: after `kill -9`
of that process the lock is free at once (the stage is `running` with nobody holding it: a
crash, which `pdctl resume` continues), and the child, which dies with its parent
(PR_SET_PDEATHSIG), holds nothing that could outlive it.

Only the real entry point (`cli.main`, i.e. `pdctl` and `python -m pdctl`) supervises; the
Typer app called in-process (tests, `typer.testing.CliRunner`) runs stages directly, and so
does `PDCTL_SUPERVISOR=0`. Parent and child talk over a socket pair, one JSON object a line.
The child says `ready` (its signal handlers are in: forwarded signals are now stop requests),
`stage` (a stage began: its run directory and whether this process writes the state),
`stopping` (it acts on a stop request), `lost` (another process of its run died), `said`
(its `error:` line is out), `peer` (with a copy of its connection to another process of its
run, `engine.peers`, so that the parent can tell a lost process after an abort) and `left`
(that process said it leaves), and asks `op` = acquire / release / free about the lock, which
the parent answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ENV_CHILD = "PDCTL_SUPERVISED"  # in the child: "<socket fd>:<parent pid>"
ENV_SWITCH = "PDCTL_SUPERVISOR"  # "0": run stages in the process itself
_active = False
_sock: socket.socket | None = None
_replies: Any = None
_ask = threading.Lock()

_WHY = {
    "SIGABRT": "an abort inside XLA or a collective, often because another process of the "
    "run failed; see the lines above",
    "SIGKILL": "killed from outside, e.g. by the out-of-memory killer",
    "SIGSEGV": "a crash inside a native library",
    "SIGBUS": "a crash inside a native library",
}


# ---- the entry point -------------------------------------------------------------------------

_held: list[int] = []  # SIGTERM/SIGINT received before the command could act on them
_before: dict[signal.Signals, Any] = {}  # the handlers `hold_signals` replaced


def _hold(signum: int, frame: Any) -> None:
    _held.append(signum)


def hold_signals() -> None:
    """From the first line of `cli.main`: a SIGTERM/SIGINT that comes while Python is still
    importing and parsing the command is held, not fatal. A stage command then acts on it as
    on any stop request (exit 3: the parent forwards it to its child, which stops before it
    writes anything); any other command gets it back, under its default handling, as soon as
    it starts (`release_signals`)."""
    if _before:
        return
    with contextlib.suppress(ValueError):  # not the main thread: nothing to hold
        for s in (signal.SIGTERM, signal.SIGINT):
            _before[s] = signal.signal(s, _hold)


def take_held() -> list[int]:
    """Stop holding (the caller has installed its own handlers, which stay): the signals held
    so far, oldest first."""
    _before.clear()
    out = list(_held)
    _held.clear()
    return out


def release_signals() -> None:
    """Stop holding and put the handlers back as they were; a signal held meanwhile is then
    raised again, so it does what it would have done without the hold."""
    before = dict(_before)
    for s, h in before.items():
        signal.signal(s, h)
    for signum in take_held():
        os.kill(os.getpid(), signum)


def enable() -> None:
    """Called by `cli.main` only: stage commands run supervised (unless this is the child, or
    PDCTL_SUPERVISOR=0). In the child: die with the parent, and open the socket to it."""
    global _active, _sock, _replies
    child = os.environ.pop(ENV_CHILD, None)
    if child is not None:
        fd, parent = (int(x) for x in child.split(":"))
        _die_with(parent)
        os.set_inheritable(fd, False)
        _sock = socket.socket(fileno=fd)
        _replies = _sock.makefile("rb")
        return
    _active = os.environ.get(ENV_SWITCH, "1") != "0"


def active() -> bool:
    return _active


def is_child() -> bool:
    """This process is the supervised child of a stage command (`enable` found the parent)."""
    return _sock is not None


def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux), as if both were one process."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that took effect
        os._exit(1)


# ---- the child side --------------------------------------------------------------------------


def tell(**msg: Any) -> None:
    """One message to the parent (no-op when not supervised)."""
    if _sock is None:
        return
    with _ask, contextlib.suppress(OSError):
        _sock.sendall((json.dumps(msg) + "\n").encode())


def share_peer(pid: int, conn: socket.socket) -> None:
    """Hand the parent a copy of this process's connection to process `pid` of its run
    (`engine.peers`): should this process die by an abort, the parent can still tell whether
    that process had gone first (no-op when not supervised)."""
    if _sock is None:
        return
    with _ask, contextlib.suppress(OSError):
        socket.send_fds(_sock, [(json.dumps({"peer": pid}) + "\n").encode()], [conn.fileno()])


def tell_stopping(signum: int) -> None:
    tell(stopping=int(signum))


def tell_said(code: int) -> None:
    """The `error:` line is out and the process is to exit `code` (a death after this is not
    another failure to report)."""
    tell(said=int(code))


def _request(**msg: Any) -> dict[str, Any]:
    assert _sock is not None
    with _ask:
        _sock.sendall((json.dumps(msg) + "\n").encode())
        line = _replies.readline()
    if not line:
        from pdctl.errors import PdctlError

        raise PdctlError("pdctl: the supervising process is gone")
    return json.loads(line)


def adopt(project: Any) -> None:
    """In the child: `project`'s lock is the parent's to hold (no-op when not supervised).
    Taking it asks the parent to take it (its error, a run directory in use, is raised here
    as it is); releasing the last hold asks the parent to release it."""
    if _sock is None:
        return
    from pdctl.errors import PdctlError

    toml = str(project.path)
    depth = 0

    def acquire_lock() -> None:
        nonlocal depth
        if depth:
            depth += 1
            return
        reply = _request(op="acquire", toml=toml)
        if "error" in reply:
            raise PdctlError(reply["error"])
        depth = 1

    def release_lock() -> None:
        nonlocal depth
        if not depth:
            return
        depth -= 1
        if depth == 0:
            _request(op="release", toml=toml)

    def lock_is_free() -> bool:
        if depth:
            return False
        return bool(_request(op="free", toml=toml).get("free"))

    project.acquire_lock = acquire_lock
    project.release_lock = release_lock
    project.lock_is_free = lock_is_free


# ---- the parent side -------------------------------------------------------------------------


class _Child:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready = False
        self.pending: list[int] = []
        self.forwarded: list[int] = []
        self.stage: dict[str, Any] | None = None
        self.stopping: int | None = None
        self.said: int | None = None  # the child printed its `error:` line, to exit with this
        self.lost: int | None = None  # the child saw that process of its run die (engine.peers)
        self.fds: list[int] = []  # descriptors received, not yet matched with their message
        self.peers: dict[int, socket.socket] = {}  # copies of the child's peer connections
        self.left: set[int] = set()  # processes that said they leave on purpose
        self.proc: subprocess.Popen | None = None
        self.holder: Any = None  # the Project whose lock this process holds for the child
        self.held = 0

    def read(self, sock: socket.socket) -> None:
        with sock:
            for msg in _messages(sock, self.fds):
                if "op" in msg:
                    with contextlib.suppress(OSError):
                        sock.sendall((json.dumps(self._lock_op(msg)) + "\n").encode())
                if "stage" in msg:
                    self.stage = msg
                if "stopping" in msg:
                    self.stopping = int(msg["stopping"])
                if "said" in msg:
                    self.said = int(msg["said"])
                if "lost" in msg:
                    self.lost = int(msg["lost"])
                if "peer" in msg and self.fds:
                    self.peers[int(msg["peer"])] = socket.socket(fileno=self.fds.pop(0))
                if "left" in msg:
                    self.left.add(int(msg["left"]))
                if msg.get("ready"):
                    with self.lock:
                        self.ready = True
                        for s in self.pending:
                            self._send(s)
                        self.pending.clear()

    def _lock_op(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            from pdctl.project import Project

            if self.holder is None or str(self.holder.path) != msg["toml"]:
                if self.held:
                    return {"error": "pdctl: the child asked for a second run directory's lock"}
                self.holder = Project.load(Path(msg["toml"]))
            op = msg["op"]
            if op == "acquire":
                self.holder.acquire_lock()
                self.held += 1
                return {"ok": True}
            if op == "release":
                if self.held:
                    self.held -= 1
                    self.holder.release_lock()
                return {"ok": True}
            return {"free": self.holder.lock_is_free()}
        except Exception as e:  # PdctlError: in use, not writable, a symlink, ...
            return {"error": str(e)}

    def _send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            assert self.proc is not None
            os.kill(self.proc.pid, signum)

    def forward(self, signum: int, frame: Any) -> None:
        with self.lock:
            self.forwarded.append(signum)
            if self.ready:
                self._send(signum)
            else:  # before its handlers are in, a signal would kill it: hold it until then
                self.pending.append(signum)


def run_child(args: list[str]) -> int:
    """Run `pdctl ARGS` in a child process and return the exit code this process should end
    with (after writing the state the child could not write, and saying why)."""
    import pdctl

    mine, theirs = socket.socketpair()
    env = dict(os.environ)
    env[ENV_CHILD] = f"{theirs.fileno()}:{os.getpid()}"
    from pdctl.engine import runtime

    env.setdefault(runtime.STARTED_ENV, repr(runtime.started()))
    where = str(Path(pdctl.__file__).resolve().parent.parent)
    code = f"import sys; sys.path.insert(0, {where!r}); from pdctl.cli import main; main()"
    child = _Child()
    old = {s: signal.signal(s, child.forward) for s in (signal.SIGTERM, signal.SIGINT)}
    old.update(_before)  # what `hold_signals` replaced comes back at the end
    for s in take_held():  # a stop that came while this process started: the child's first
        child.forward(s, None)
    try:
        try:
            # The child starts with SIGTERM/SIGINT ignored (until `hold_signals`, then its
            # stage's handlers): what this process receives, it forwards once the child can
            # stop cleanly, so a signal to the whole process group (`timeout`, a terminal's
            # Ctrl-C) does not kill the child while Python starts it up.
            child.proc = subprocess.Popen(
                [sys.executable, "-c", code, *args],
                env=env,
                pass_fds=(theirs.fileno(),),
                preexec_fn=_ignore_stop_signals,
            )
        finally:
            theirs.close()
        # what answering for the lock needs, imported while the child starts up
        threading.Thread(target=_import_project, daemon=True).start()
        reader = threading.Thread(target=child.read, args=(mine,), daemon=True)
        reader.start()
        rc = child.proc.wait()
        reader.join(5)
        return _outcome(child, rc)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        while child.held:  # the child died holding it
            child.held -= 1
            with contextlib.suppress(Exception):
                child.holder.release_lock()


def _messages(sock: socket.socket, fds: list[int]):
    """The child's JSON lines, with the descriptors that come along appended to `fds`."""
    buf = b""
    while True:
        try:
            data, got, _, _ = socket.recv_fds(sock, 65536, 8)
        except OSError:
            return
        fds.extend(got)
        if not data:
            return
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def _peer_gone(child: _Child, wait_s: float = 1.0) -> int | None:
    """After the child died by an abort: the process of its run whose connection (the copy
    the child shared) had closed without a `bye`, or that process 0 named as lost; None when
    every one is still there after `wait_s` (the abort was the child's own)."""
    import select
    import time

    deadline = time.monotonic() + wait_s
    live = dict(child.peers)
    while live:
        ready, _, _ = select.select(
            list(live.values()), [], [], max(deadline - time.monotonic(), 0)
        )
        if not ready:
            return None
        for pid, conn in list(live.items()):
            if conn not in ready:
                continue
            try:
                data = conn.recv(256, socket.MSG_PEEK)
            except OSError:
                data = b""
            words = data.decode(errors="replace").split()
            if words[:1] == ["lost"] and len(words) > 1 and words[1].isdigit():
                return int(words[1])
            if data.startswith(b"bye") or pid in child.left:
                del live[pid]
                continue
            if not data:
                return pid
            with contextlib.suppress(OSError):  # something else unread: skip past it
                conn.recv(256)
    return None


def _ignore_stop_signals() -> None:
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)


def _import_project() -> None:
    with contextlib.suppress(Exception):
        import pdctl.project  # noqa: F401


def _outcome(child: _Child, rc: int) -> int:
    """The exit code for a child that ended with `rc` (negative: killed by that signal)."""
    died = signal.Signals(-rc).name if rc < 0 else None
    if died == "SIGABRT" and child.lost is None and child.peers:
        # XLA or gloo aborts a process whose peer died, often before pdctl's own thread in it
        # could say so: the connections it shared tell
        child.lost = _peer_gone(child)
    for conn in child.peers.values():
        conn.close()
    stop = child.stopping or (child.forwarded[0] if child.forwarded else None)
    info = child.stage
    if info is None:
        if died is None:
            return rc
        if stop is not None and died in ("SIGTERM", "SIGINT"):  # a stop it could not act on
            _say(f"pdctl: stopped by {died} before the stage began; nothing was written")
            return 3
        _say(f"pdctl: the process died by {died} ({_WHY.get(died, 'a fatal signal')})")
        return 1
    if died is None and rc in (0, 2, 3):  # it ended the way pdctl ends: its state is written
        return rc
    stage = info["stage"]
    how = f"died by {died}" if died else f"exited with code {rc}"
    if not info.get("writer", True):
        if died is None:
            return rc
        if child.said is not None:  # it had said why it ends, then died on its way out
            return child.said
        why = _WHY.get(died, "a fatal signal")
        if stop is not None:  # the run was stopping (it is process 0 that records it)
            _say(f"{stage}: stopped by {signal.Signals(stop).name}; this process then {how}")
            return 3
        if child.lost is not None:  # e.g. process 0 died, and JAX's agent aborted this one
            whose = "what process 0 last recorded" if child.lost == 0 else "process 0's record"
            _say(f"{_gone(child, info)}, and this process then {how}; `pdctl status` shows {whose}")
            return 1
        _say(f"{stage}: this process {how} ({why})")
        return 1
    try:
        from pdctl.project import Project

        project = Project.load(Path(info["toml"]))
        if child.held and str(child.holder.path) == str(project.path):
            # the child died holding the lock: write under it, with the state on disk now
            child.holder.state = project.state
            project = child.holder
        elif not project.lock_is_free():  # another pdctl has it: its state is not ours
            return rc if died is None else 1
        st = project.stage(stage)
        unfinished = st.get("status") == "running"
    except Exception as e:  # the run directory is gone or unreadable: say so, write nothing
        if died is None:
            return rc
        _say(f"{stage}: the process {how}; its state could not be read ({e})")
        return 1
    if not unfinished:
        if died is None:
            return rc
        if child.said is not None:  # it had said why it ends, then died on its way out
            return child.said
        _say(f"{stage}: the process {how} after it had recorded its state ({st.get('status')})")
        return 3 if st.get("status") == "interrupted" else 1
    cli = info.get("cli", stage)
    latest = latest_checkpoint(project, stage, st)
    why = f" ({_WHY.get(died, 'a fatal signal')})" if died else ""
    if stop is not None:
        name = signal.Signals(stop).name
        kept = (
            f"the last checkpoint, step {latest}, is kept; continue with `pdctl resume`"
            if latest is not None
            else "no checkpoint of this run was saved; `pdctl resume` starts it over"
        )
        line = f"{stage}: stopped by {name}, and the process then {how}{why}; {kept}"
        fields: dict[str, Any] = {"status": "interrupted", "checkpoint": latest}
        code = 3
    elif child.lost is not None:  # it saw another process die, then died before saying so
        kept = (
            f"the last checkpoint is step {latest}; continue with `pdctl resume`"
            if latest is not None
            else "no checkpoint of this run was saved; `pdctl resume` starts it over"
        )
        line = f"{_gone(child, info)}, and this process then {how}; {kept}"
        line += " (with any number of processes)"
        fields = {"status": "failed", "error": line[:300], "checkpoint": latest,
                  "lost_process": child.lost}  # fmt: skip
        code = 1
        _drop_unfinished(project.checkpoint_dir(stage))
    else:
        kept = (
            f"the last good checkpoint is step {latest} (continue with `pdctl {cli} --resume`)"
            if latest is not None
            else "no checkpoint of this run was saved"
        )
        line = f"{stage}: the process {how}{why}; {kept}"
        fields = {"status": "failed", "error": line[:300], "checkpoint": latest}
        code = 1
    try:
        with project.locked():
            project.update_stage(stage, **fields)
    except Exception as e:
        line += f" (its state could not be written: {e})"
    _say(line + ".")
    return code


def latest_checkpoint(project: Any, stage: str, st: dict[str, Any]) -> int | None:
    """The newest complete checkpoint of the stage's current run: the one its state names, or
    a newer one whose save completed after that state was written (orbax writes
    `_CHECKPOINT_METADATA` last; the meta names the run). Read without orbax or JAX."""
    latest = st.get("checkpoint")
    directory = project.checkpoint_dir(stage)
    try:
        names = [p for p in directory.iterdir() if p.name.isdigit() and not p.is_symlink()]
    except OSError:
        return latest
    for p in sorted(names, key=lambda p: int(p.name), reverse=True):
        step = int(p.name)
        if latest is not None and step <= latest:
            break
        if not (p / "_CHECKPOINT_METADATA").is_file():
            continue
        try:
            meta = json.loads((p / "meta" / "metadata").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("run_id") == st.get("run_id"):
            return step
    return latest


def _gone(child: _Child, info: dict[str, Any]) -> str:
    """'<stage>: process K of N is gone (...)', as the child would have said it."""
    n = info.get("processes", "the run")
    return (
        f"{info['stage']}: process {child.lost} of {n} is gone (killed, or crashed: see its output)"
    )


def _drop_unfinished(directory: Path) -> None:
    """Delete the temporary directories of saves in progress when the child died (orbax's
    suffix; read without orbax), so that nothing partial stays."""
    import shutil

    with contextlib.suppress(OSError):
        for p in directory.iterdir():
            if ".orbax-checkpoint-tmp" in p.name and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)


def _say(line: str) -> None:
    sys.stdout.flush()
    print(f"error: {line}", file=sys.stderr, flush=True)
