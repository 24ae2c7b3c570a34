"""Headless Chromium driven over the DevTools protocol, for the tests and benchmarks that load
pdctl's pages (the report's index.html, `pdctl browse`) the way a user's browser does: console
errors, images that did not load, values read from the page.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium", path="/usr/bin")
BASH = shutil.which("bash") or "/bin/bash"


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    NUL-separated JSON on fds 3 and 4, no port, no websocket library)."""

    def __init__(self, profile: Path):
        cmd_r, self._cmd_w = os.pipe()
        self._evt_r, evt_w = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4. bash puts the pipes there
        # (no preexec_fn: forking Python code in a multithreaded JAX process can hang), from
        # fds >= 10 (dash takes single-digit fds only) so neither redirection overwrites the
        # other's source.
        hi_cmd, hi_evt = (
            fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10),
            fcntl.fcntl(evt_w, fcntl.F_DUPFD, 10),
        )
        os.close(cmd_r)
        os.close(evt_w)
        redirect = f'exec "$0" "$@" 3<&{hi_cmd} 4>&{hi_evt}'
        self.proc = subprocess.Popen(
            [
                BASH, "-c", redirect,
                str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                "--remote-debugging-pipe", "about:blank",
            ],
            pass_fds=(hi_cmd, hi_evt),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(hi_cmd)
        os.close(hi_evt)
        self._events: queue.Queue = queue.Queue()
        self._next = 0
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self.session = attached["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            self.call(f"{domain}.enable", session=self.session)

    def js(self, expr: str, await_promise: bool = False):
        """`expr` evaluated in the page: its value (a promise's, with `await_promise`)."""
        params = {"expression": expr, "returnByValue": True}
        if await_promise:
            params["awaitPromise"] = True
        out = self.call("Runtime.evaluate", params, self.session)
        return out["result"].get("value")

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self._evt_r, 1 << 16):
            buf += chunk
            *msgs, buf = buf.split(b"\0")
            for m in msgs:
                self._events.put(json.loads(m))
        self._events.put(None)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self._get(30)
            if m.get("id") == self._next:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m["result"]
            self.seen.append(m)

    def _get(self, timeout: float) -> dict:
        m = self._events.get(timeout=timeout)
        if m is None:
            raise RuntimeError("chromium closed the DevTools pipe")
        return m

    def load(self, url: str, settle_s: float = 0.5) -> tuple[list[str], list[str], int]:
        """Navigate; (console and log errors, images that did not load, number of images)."""
        self.seen = []
        nav = self.call("Page.navigate", {"url": url}, self.session)
        assert "errorText" not in nav, nav
        deadline = time.monotonic() + 30
        while not any(m.get("method") == "Page.loadEventFired" for m in self.seen):
            self.seen.append(self._get(max(0.1, deadline - time.monotonic())))
        end = time.monotonic() + settle_s
        while time.monotonic() < end:
            try:
                self.seen.append(self._get(end - time.monotonic()))
            except queue.Empty:
                break
        expr = (
            "JSON.stringify(Array.from(document.images).map(i => "
            "[i.getAttribute('src'), i.complete && i.naturalWidth > 0]))"
        )
        value = self.call(
            "Runtime.evaluate", {"expression": expr, "returnByValue": True}, self.session
        )
        images = json.loads(value["result"]["value"])
        errors = []
        for m in self.seen:
            p, method = m.get("params", {}), m.get("method")
            if method == "Runtime.exceptionThrown":
                errors.append("exception: " + json.dumps(p["exceptionDetails"])[:300])
            elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append("console: " + json.dumps(p.get("args"))[:300])
            elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
                errors.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif method == "Network.loadingFailed":
                errors.append(f"network: {p.get('errorText')}")
        return errors, [src for src, ok in images if not ok], len(images)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError, queue.Empty):
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
