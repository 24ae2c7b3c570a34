"""`pdctl interp` under faults and hostile input (issue 53): an LLM server that dribbles, echoes
the key, answers too much or answers invalid Unicode; FIFOs and devices where a JSONL file
should be; a labels file cut short by a crash; hostile JSON and harvest databases; a bad
`--endpoint` port. Each is one line (exit 2) with nothing written, or goes on as documented."""

from __future__ import annotations

import contextlib
import errno
import http.server
import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
from helpers import cli_fails, cli_ok, harvest_labels
from test_interp import _closed_form, _write_jsonl


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return _closed_form(tmp_path, 2)


class _Server(http.server.BaseHTTPRequestHandler):
    """A chat-completions server whose answer is `mode`: "label" (a label per key, content
    `content` when set), "dribble" (headers, then a byte every 0.2 s), "401" (an error whose
    body echoes the key), "huge" (a 2 MiB reply)."""

    mode = "label"
    content: str | None = None
    seen: ClassVar[list] = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Server.seen.append(body)
        with contextlib.suppress(OSError):  # the client went away
            self._answer(body["messages"][0]["content"])

    def _answer(self, prompt: str) -> None:
        if _Server.mode == "dribble":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(150):  # 30 s at most
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.2)
            return
        if _Server.mode == "401":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b"bad key: Bearer sekrit-key")
            return
        if _Server.mode == "huge":
            content = "x" * (2 << 20)
        else:
            key = prompt.split("Component ", 1)[1].split(" ", 1)[0]
            content = _Server.content or json.dumps({"label": f"label of {key}"})
        out = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    srv.daemon_threads = True
    _Server.mode, _Server.content, _Server.seen = "label", None, []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    finally:
        srv.shutdown()
        srv.server_close()


def _export(run: Path, url: str, *more: str) -> tuple:
    return ("--project", run, "interp", "export", "--endpoint", url, "--model", "m",
            "--rpm", "60000", *more)  # fmt: skip


def _unblock_later(fifo: Path) -> threading.Timer:
    """Should pdctl block reading the FIFO (the fault), give it an end of file after 10 s, so
    the test fails instead of hanging."""

    def writer() -> None:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    t = threading.Timer(10, writer)
    t.daemon = True
    t.start()
    return t


# ---- 1: one deadline per request ------------------------------------------------------------


def test_a_dribbling_server_is_cut_off_at_the_request_deadline(run, server, monkeypatch):
    from pdctl.interp import endpoint as ep

    monkeypatch.setattr(ep, "TIMEOUT_S", 1.0, raising=False)  # (before the fix: none)
    _Server.mode = "dribble"
    t0 = time.monotonic()
    line = cli_fails(2, *_export(run, server, "--retries", "0"))
    assert time.monotonic() - t0 < 6, line  # a byte every 0.2 s kept it going 30 s before
    assert "no whole reply within 1 s after 0 retries" in line, line
    assert len(_Server.seen) == 1


# ---- decided: no error body shown, a 1 MiB reply cap ----------------------------------------


def test_an_error_body_is_not_shown_and_a_huge_reply_is_refused(run, server):
    _Server.mode = "401"
    line = cli_fails(2, *_export(run, server))
    assert "answered HTTP 401 Unauthorized (body not shown)" in line, line
    assert "sekrit" not in line
    _Server.mode = "huge"
    line = cli_fails(2, *_export(run, server))
    assert "a reply larger than 1 MiB, refused" in line, line
    assert len(_Server.seen) == 2  # neither retried
    assert not (run / "interp" / "labels.jsonl").read_text()


# ---- 3: FIFOs and devices -------------------------------------------------------------------


def test_special_files_are_refused_before_anything_is_read_or_written(run, tmp_path, monkeypatch):
    from pdctl.interp import labels as lb

    interp = run / "interp"
    interp.mkdir()
    fifo = interp / "labels.jsonl"
    os.mkfifo(fifo)
    _unblock_later(fifo)
    line = cli_fails(2, *_export(run, "http://127.0.0.1:9/v1"))
    assert "labels.jsonl: is not a regular file" in line, line
    assert sorted(p.name for p in interp.iterdir()) == ["labels.jsonl"]  # nothing written
    # score --endpoint: its answers file a FIFO
    cli_ok("--project", run, "interp", "import",
           _write_jsonl(tmp_path / "l.jsonl", [{"key": "a:0", "label": "zero"}]))  # fmt: skip
    trials = _write_jsonl(tmp_path / "trials.jsonl", [{
        "task": "detection", "key": "a:0", "site": "a", "component": 0, "trial": 0,
        "label": "zero", "prompt": "p", "examples": ["x", "y"], "fires": [True, False],
        "predictions": None}])  # fmt: skip
    answers = tmp_path / "trials.answers.jsonl"
    os.mkfifo(answers)
    _unblock_later(answers)
    line = cli_fails(2, "--project", run, "interp", "score", trials,
                     "--endpoint", "http://127.0.0.1:9/v1", "--model", "m")  # fmt: skip
    assert "trials.answers.jsonl: is not a regular file" in line, line
    # import: a device, a FIFO, a file over the cap
    line = cli_fails(2, "--project", run, "interp", "import", "/dev/zero")
    assert "/dev/zero: is not a regular file" in line, line
    other = tmp_path / "fifo.jsonl"
    os.mkfifo(other)
    _unblock_later(other)
    assert "is not a regular file" in cli_fails(2, "--project", run, "interp", "import", other)
    monkeypatch.setattr(lb, "MAX_FILE_BYTES", 100)
    big = _write_jsonl(tmp_path / "big.jsonl", [{"key": "a:0", "label": "z" * 200}])
    assert "big.jsonl: 2" in cli_fails(2, "--project", run, "interp", "import", big)


# ---- 4: a labels file cut short by a crash --------------------------------------------------


def test_a_cut_last_line_is_dropped_and_asked_again(run, server):
    interp = run / "interp"
    interp.mkdir()
    answers = interp / "labels.jsonl"
    whole = json.dumps({"key": "a:0", "site": "a", "component": 0, "label": "zero"})
    answers.write_text(whole + "\n" + '{"key": "a:1", "site": "a", "compo')
    r = cli_ok(*_export(run, server))
    out = " ".join(r.stdout.split())
    assert "dropped its last line" in out, out
    assert len(_Server.seen) == 3  # a:1, a:2, b:0
    labels = harvest_labels(run)
    assert labels[("a", 0)]["label"] == "zero" and labels[("a", 1)]["label"] == "label of a:1"
    # a last line that is whole but lost its newline keeps its label, and the file stays JSONL
    text = answers.read_text().splitlines()
    answers.write_text("\n".join(text))
    cli_ok(*_export(run, server))
    assert len(_Server.seen) == 3
    cli_ok("--project", run, "interp", "import", answers)
    assert len(answers.read_text().splitlines()) == len(text)


# ---- 5: one line, never a traceback ---------------------------------------------------------


def test_a_lone_surrogate_from_the_server_becomes_a_replacement_character(run, server):
    _Server.content = '{"label": "x\\ud800y"}'
    cli_ok(*_export(run, server))
    assert harvest_labels(run)[("a", 0)]["label"] == "x\ufffdy"
    assert "x\ufffdy" in (run / "interp" / "labels.jsonl").read_text(encoding="utf-8")


def test_a_lone_surrogate_in_an_imported_label_is_one_line(run, tmp_path):
    path = run / "harvest" / "harvest.db"
    before = path.read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "a:0", "label": "x\\ud800"}\n')
    line = cli_fails(2, "--project", run, "interp", "import", bad)
    assert "bad.jsonl line 1: label: not valid Unicode" in line, line
    bad.write_text('{"key": "a:0", "label": "x", "source": "\\udfff"}\n')
    assert "line 1: source: not valid Unicode" in cli_fails(
        2, "--project", run, "interp", "import", bad
    )
    assert path.read_bytes() == before


def test_a_json_line_nested_too_deep_is_one_line(run, tmp_path, server):
    path = run / "harvest" / "harvest.db"
    before = path.read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    line = cli_fails(2, "--project", run, "interp", "import", bad)
    assert "bad.jsonl line 1: not JSON (nested too deeply)" in line, line
    assert path.read_bytes() == before
    # in a reply (no label in it: asked again on a rerun) and in the answers file (skipped)
    _Server.content = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = cli_ok(*_export(run, server))
    assert "4 replies held no label" in " ".join(r.stdout.split())
    (run / "interp" / "labels.jsonl").write_text("[" * 200_000 + "]" * 200_000 + "\n")
    _Server.content = None
    line = cli_fails(2, *_export(run, server))  # asked, then the import names the deep line
    assert "labels.jsonl line 1: not JSON (nested too deeply)" in line, line
    assert len(_Server.seen) == 8


@pytest.mark.parametrize(
    ("sql", "want"),
    [
        ("UPDATE components SET mean_ci = 'NaN' WHERE site = 'a' AND component = 0",
         "components.mean_ci of a:0: not a finite number ('NaN')"),
        ("UPDATE examples SET tokens = 'not json' WHERE site = 'a' AND component = 0",
         "examples of a:0: tokens: not a JSON list"),
        ("UPDATE meta SET value = '\"abc\"' WHERE key = 'threshold'",
         "meta.threshold: not a number ('abc')"),
    ],
)  # fmt: skip
def test_a_hostile_harvest_db_is_one_line(run, sql, want):
    path = run / "harvest" / "harvest.db"
    con = sqlite3.connect(path)
    with con:
        assert con.execute(sql).rowcount >= 1
    con.close()
    line = cli_fails(2, "--project", run, "interp", "export")
    assert want in line, line
    assert not (run / "interp").exists()


def test_export_into_a_run_directory_it_cannot_write_is_one_line(run, monkeypatch):
    import pdctl.files

    def read_only(path, data):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(pdctl.files, "atomic_write", read_only)
    line = cli_fails(2, "--project", run, "interp", "export")
    assert "cannot write" in line and "Read-only file system" in line, line


# ---- 7: the URL is checked first ------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/", "http://127.0.0.1:0/v1"])
def test_an_endpoint_port_out_of_range_is_refused_first(run, url):
    line = cli_fails(2, *_export(run, url))
    assert "--endpoint: port must be 1 to 65535" in line, line
    assert not (run / "interp").exists()
