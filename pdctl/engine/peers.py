"""Knowing within a second that another process of a multi-process run is gone.

JAX's coordination service (hosted by process 0) learns that a process died only once its
heartbeats have been missing for `[distributed] heartbeat_timeout_s` (100 s by default). Until
then a survivor waits in whatever barrier or collective it is in (an orbax save waits in one),
and then JAX's agent aborts it (SIGABRT). JAX's own hooks do not help: the client's
`get_live_nodes` is itself a barrier that waits out the same timeout, and its error callback
(`missed_heartbeat_callback`) aborts the process with std::bad_cast when set from Python
(jaxlib 0.10.2). Process 0's death, by contrast, is seen at once: the agents of the others lose
their connection to the service and abort them within a second.

A process that dies, by any signal (kill -9 included), has its sockets closed by the kernel at
once. So every process other than 0 keeps one TCP connection to process 0 (`start`, right
after jax.distributed starts: process 0 listens on a free port and publishes it, with a token,
in the coordination service's key-value store). A connection that closes without the `bye`
each process sends as it exits (`say_bye`, at exit) is a lost process; process 0 tells the
others which one before it acts, and its own death closes every connection.

What a loss does is the caller's: while `watch(handler)` is in force (a stage runs), the first
loss calls `handler(process_id)` once, on this module's thread or on the thread that calls
`settle`; the handler may end the process. Outside `watch` a loss is only remembered (`lost`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import secrets
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("pdctl")

KEY = "pdctl/peers"  # the key-value entry: "<port> <token>" of process 0's listener
CONNECT_TIMEOUT_S = 30.0  # for process 0's port in the key-value store, then to connect

_lost: int | None = None  # the first process seen gone
_seen = threading.Event()
_handler: Callable[[int], None] | None = None
_acting = threading.Lock()  # held by the one thread that runs the handler
_acted: Callable[[int], None] | None = None  # the handler that ran
_conns: dict[int, socket.socket] = {}  # process 0: the others' connections; others: {0: ...}
_send = threading.Lock()
_started = False
# Told of each connection made (process id, socket) and of each `bye` (process id): the
# supervising parent keeps copies (`pdctl.supervisor.share_peer`), see `report_to`.
_on_connect: Callable[[int, socket.socket], None] | None = None
_on_bye: Callable[[int], None] | None = None


def report_to(on_connect: Callable[[int, socket.socket], None], on_bye: Callable[[int], None]):
    """Call `on_connect(process_id, socket)` for each connection to another process, and
    `on_bye(process_id)` when one says it leaves on purpose (set before `start`)."""
    global _on_connect, _on_bye
    _on_connect, _on_bye = on_connect, on_bye


def _tell(fn, *args) -> None:
    if fn is not None:
        with contextlib.suppress(Exception):
            fn(*args)


def _client():
    mod = sys.modules.get("jax._src.distributed")
    return getattr(getattr(mod, "global_state", None), "client", None)


def start(process_id: int, num_processes: int, coordinator: str) -> None:
    """Open the connections (no-op for one process). Any failure is a warning: the run then
    goes on with JAX's heartbeat as its only check."""
    global _started
    if _started or num_processes < 2:
        return
    client = _client()
    if client is None:
        return
    try:
        if process_id == 0:
            try:
                _listen(client, num_processes)
            except Exception:
                with contextlib.suppress(Exception):  # the others need not wait for it
                    client.key_value_set(KEY, "none")
                raise
        else:
            _connect(client, process_id, coordinator)
    except Exception as e:  # no route, a firewall, a key that never came
        log.warning("pdctl: no liveness connection to the other processes (%s); a process that "
                    "dies is noticed only after [distributed] heartbeat_timeout_s", e)  # fmt: skip
        return
    _started = True
    atexit.register(say_bye)


def _listen(client, num_processes: int) -> None:
    if socket.has_dualstack_ipv6():
        server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        server = socket.create_server(("", 0))
    token = secrets.token_hex(16)
    client.key_value_set(KEY, f"{server.getsockname()[1]} {token}")
    threading.Thread(
        target=_serve, args=(server, token, num_processes), name="pdctl: peers", daemon=True
    ).start()


def _connect(client, process_id: int, coordinator: str) -> None:
    value = client.blocking_key_value_get(KEY, int(CONNECT_TIMEOUT_S * 1000))
    if value == "none":
        raise RuntimeError("process 0 could not listen")
    port, token = value.split()
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    conn = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    conn.settimeout(None)
    conn.sendall(f"hello {process_id} {token}\n".encode())
    _conns[0] = conn
    _tell(_on_connect, 0, conn)
    threading.Thread(target=_follow, args=(conn,), name="pdctl: peers", daemon=True).start()


def _serve(server: socket.socket, token: str, num_processes: int) -> None:
    """Process 0: accept the others' connections; one that closes without `bye` is a loss."""
    pending: dict[socket.socket, bytes] = {}  # accepted, not yet said who they are
    ids: dict[socket.socket, int] = {}
    left: set[int] = set()  # said bye
    while True:
        try:
            ready, _, _ = select.select([server, *pending, *ids], [], [], 1.0)
        except (OSError, ValueError):
            time.sleep(1.0)
            continue
        for s in ready:
            if s is server:
                with contextlib.suppress(OSError):
                    pending[server.accept()[0]] = b""
                continue
            try:
                data = s.recv(256)
            except OSError:
                data = b""
            if s in pending:
                _introduce(s, pending, ids, data, token, num_processes)
                continue
            pid = ids[s]
            if data.startswith(b"bye"):
                left.add(pid)
                _tell(_on_bye, pid)
            if not data:  # closed: after its bye, or it died
                del ids[s]
                with _send:
                    _conns.pop(pid, None)
                s.close()
                if pid not in left:
                    _tell_others(f"lost {pid}\n")
                    _found(pid)


def _introduce(s, pending, ids, data: bytes, token: str, num_processes: int) -> None:
    """A new connection's first line: `hello <process id> <token>`, or it is dropped."""
    buf = pending.pop(s) + data
    if b"\n" not in buf:
        if data and len(buf) < 256:
            pending[s] = buf
        else:
            s.close()
        return
    words = buf.split(b"\n", 1)[0].decode(errors="replace").split()
    if (
        len(words) == 3
        and words[0] == "hello"
        and secrets.compare_digest(words[2], token)
        and words[1].isdigit()
        and 0 < int(words[1]) < num_processes
    ):
        ids[s] = int(words[1])
        with _send:
            _conns[ids[s]] = s
        _tell(_on_connect, ids[s], s)
    else:
        s.close()


def _follow(conn: socket.socket) -> None:
    """Process > 0: process 0 says which process it lost; its connection closing without
    `bye` is process 0 lost."""
    buf = b""
    while True:
        try:
            data = conn.recv(256)
        except OSError:
            data = b""
        if not data:
            _found(0)
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            words = line.decode(errors="replace").split()
            if words[:1] == ["bye"]:
                _tell(_on_bye, 0)
                return
            if len(words) == 2 and words[0] == "lost" and words[1].isdigit():
                _found(int(words[1]))
                return


def _tell_others(msg: str) -> None:
    with _send:
        for conn in list(_conns.values()):
            with contextlib.suppress(OSError):
                conn.sendall(msg.encode())


def _found(pid: int) -> None:
    global _lost
    if _lost is None:
        _lost = pid
    _seen.set()
    if _handler is not None:
        _act()


def _act() -> None:
    """Run the handler once for the loss (each `watch` its own); a second thread that gets here
    waits for the first (whose handler ends the process, or returns)."""
    global _acted
    handler = _handler
    if handler is None or _lost is None:
        return
    with _acting:
        if _acted is handler:
            return
        _acted = handler
        handler(_lost)


def lost() -> int | None:
    """The process of this run seen gone (its connection closed without `bye`), or None."""
    return _lost


@contextlib.contextmanager
def watch(handler: Callable[[int], None]) -> Iterator[None]:
    """While inside, the first loss calls `handler(process_id)`; a loss already seen calls it
    now. No-op without the connections (one process, or they could not be opened)."""
    global _handler
    if not _started:
        yield
        return
    before, _handler = _handler, handler
    try:
        if _lost is not None:
            _act()
        yield
    finally:
        _handler = before


def settle(wait_s: float = 1.0) -> None:
    """For a failure path under `watch`: when the failure is a process that died (a collective
    whose peer closed its connection fails at once, as the peer's death closes ours), give
    this module `wait_s` to see it and run the handler here, so that the loss, not the failed
    collective, is what the stage records. Returns when no process is lost, or when the
    handler returned."""
    if not _started or _handler is None:
        return
    if _lost is None:
        _seen.wait(wait_s)
    if _lost is not None:
        _act()


def say_bye() -> None:
    """Tell the other processes that this one leaves on purpose (at exit, and before an
    os._exit): its connection closing is then not a loss."""
    _tell_others("bye\n")
