"""engine.peers, process 0's side, in this process: the connections of the other processes, as
they would open them, to its listener (the end-to-end case, `kill -9` of a process of a real
2-process run, is tests/faults/test_signals.py::
test_7_two_processes_one_killed_the_other_ends_failed).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pdctl.engine import peers


class _KeyValue:
    """The coordination service's key-value store, as process 0 uses it."""

    def __init__(self) -> None:
        self.kv: dict[str, str] = {}

    def key_value_set(self, key: str, value: str) -> None:
        self.kv[key] = value


@pytest.fixture
def listener(monkeypatch):
    """Process 0 of a 3-process run listening: (port, token)."""
    monkeypatch.setattr(peers, "_lost", None)
    monkeypatch.setattr(peers, "_seen", threading.Event())
    monkeypatch.setattr(peers, "_conns", {})
    monkeypatch.setattr(peers, "_handler", None)
    client = _KeyValue()
    peers._listen(client, 3)
    port, token = client.kv[peers.KEY].split()
    return int(port), token


def _join(port: int, line: str) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn.sendall(line.encode())
    return conn


def _registered(n: int) -> None:
    t0 = time.monotonic()
    while len(peers._conns) < n:
        assert time.monotonic() - t0 < 5, peers._conns
        time.sleep(0.01)


def test_a_process_that_vanishes_is_lost_and_the_others_are_told(listener) -> None:
    port, token = listener
    one = _join(port, f"hello 1 {token}\n")
    two = _join(port, f"hello 2 {token}\n")
    _registered(2)
    one.close()  # as the kernel closes it when process 1 dies
    assert peers._seen.wait(5) and peers.lost() == 1
    two.settimeout(5)
    assert two.recv(64) == b"lost 1\n"
    two.sendall(b"bye\n")  # leaves nothing for the listener's thread to act on later
    two.close()


def test_a_bye_a_wrong_token_or_a_stranger_is_not_a_loss(listener) -> None:
    port, token = listener
    strangers = [
        _join(port, "hello 1 0123456789abcdef\n"),  # not the token
        _join(port, f"hello 3 {token}\n"),  # no such process
        _join(port, "GET / HTTP/1.1\r\n\r\n"),
    ]
    one = _join(port, f"hello 1 {token}\n")
    _registered(1)
    for s in strangers:
        s.close()
    one.sendall(b"bye\n")
    one.close()
    assert not peers._seen.wait(1.0) and peers.lost() is None
