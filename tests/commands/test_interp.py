"""`pdctl interp export / import / score` on the closed-form harvest of test_harvest (no JAX
work: the database is written from hand-computed CI), the `--endpoint` path against a stub
OpenAI-compatible server on 127.0.0.1, and the labels in `pdctl browse`."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from typing import ClassVar

import pytest
from helpers import cli_fails, cli_ok, harvest_labels
from test_harvest import _get, _serving

from pdctl.harvest import db

LABELS = {  # what a labeller might write: unicode, quotes, newlines, awkward floats
    ("a", 0): {"label": "token ⟨0⟩ — \"zero\"", "reasoning": "fires on 0\nand only 0",
               "confidence": 0.1, "detection": 1 / 3, "fuzzing": None, "source": "me"},
    ("a", 2): {"label": "token 2", "reasoning": None, "confidence": None, "detection": None,
               "fuzzing": 0.7000000000000001, "source": None},
    ("b", 0): {"label": "tokens 0 and 3", "reasoning": "", "confidence": 1.0,
               "detection": 0.0, "fuzzing": 1.0, "source": "gpt-x"},
}  # fmt: skip


def _closed_form(tmp_path: Path, n_samples: int) -> Path:
    """test_harvest's closed-form harvest (`_closed_form_run`: n_samples 2) in a tms run
    directory, from the host reference accumulator (the same database, no compile)."""
    from helpers import make_run
    from test_harvest import TOKENS, VOCAB, closed_form_ci

    from pdctl.harvest import reference

    run = make_run(tmp_path, "tms", "r")
    (run / "harvest").mkdir()
    h = reference.Harvest({"a": 3, "b": 2}, 0.1, top_k=3, n_samples=n_samples, window=1,
                          vocab=VOCAB)  # fmt: skip
    h.add(closed_form_ci(TOKENS), TOKENS, start=0)
    meta = {"stage": "train", "kind": "lm-test", "split": "eval", "step": 1, "vocab": VOCAB}
    db.write(run / "harvest" / "harvest.db", h, meta)
    return run


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return _closed_form(tmp_path, 2)


@pytest.fixture
def rich(tmp_path: Path) -> Path:
    """Keeping 4 sampled examples: enough to hold 2 out."""
    return _closed_form(tmp_path, 4)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _write_jsonl(path: Path, objs: list) -> Path:
    path.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs), "utf-8")
    return path


def test_export_records_hold_the_harvest_and_a_prompt(run: Path):
    r = cli_ok("--project", run, "interp", "export", "--held-out", "1")
    assert "wrote 4 components (0 labelled)" in " ".join(r.stdout.split())
    recs = {r["key"]: r for r in _records(run / "interp" / "components.jsonl")}
    assert list(recs) == ["a:0", "a:1", "a:2", "b:0"]  # b:1 never fires: left out
    a0 = recs["a:0"]
    assert a0["stats"]["count"] == 4 and a0["stats"]["max_ci"] == 1.0
    # a0's samples are positions {0, 3, 7, 8} in a seeded order; the last one is held out,
    # and neither it nor a top example at its position is in the record's prompt lists
    held = [e["position"] for e in a0["held_out"]]
    assert len(held) == 1
    shown = [e["position"] for e in a0["top"] + a0["sample"]]
    assert held[0] not in shown
    ex = {e["position"]: e for e in a0["top"] + a0["sample"] + a0["held_out"]}
    # window +-1 around position 3 (tokens 2, 0, 3), the firing token marked; ids shown as ⟨id⟩
    assert ex[3]["ids"] == [2, 0, 3] and ex[3]["text"] == "⟨2⟩<<⟨0⟩>>⟨3⟩"
    assert ex[0]["text"] == "<<⟨0⟩>>⟨1⟩"  # the token before the sequence is left out
    assert a0["input_tokens"]["pmi"][0] == {"token": "⟨0⟩", "id": 0, "count": 4,
                                            "pmi": pytest.approx(1.0986123)}  # fmt: skip
    assert a0["template"] == "pdctl-label-v1" and a0["label"] is None
    p = a0["prompt"]
    assert "Component a:0" in p and "'⟨0⟩' PMI 1.1 (count 4)" in p
    assert ex[3]["text"] in p if 3 not in held else ex[3]["text"] not in p
    for e in a0["held_out"]:
        assert f"] {e['text']}\n" not in p
    assert (run / "interp" / "trials.jsonl").read_text() == ""  # nothing labelled yet


def test_round_trip_export_labels_import_is_exact(run: Path, tmp_path: Path):
    cli_ok("--project", run, "interp", "export")
    recs = _records(run / "interp" / "components.jsonl")
    # the labeller fills the exported records' label fields (unlabelled ones stay null)
    for r in recs:
        r.update(LABELS.get((r["site"], r["component"]), {}))
    filled = _write_jsonl(tmp_path / "filled.jsonl", recs)
    r = cli_ok("--project", run, "interp", "import", filled)
    assert "imported 3 labels" in r.stdout
    assert harvest_labels(run) == LABELS
    # export again: the same records, label fields as the labeller wrote them, bit for bit
    cli_ok("--project", run, "interp", "export")
    again = _records(run / "interp" / "components.jsonl")
    assert again == recs
    # and importing that export changes nothing (a fixed point)
    before = (run / "harvest" / "harvest.db").read_bytes()
    cli_ok("--project", run, "interp", "import", run / "interp" / "components.jsonl")
    assert harvest_labels(run) == LABELS
    con = db.open_readonly(run / "harvest" / "harvest.db")
    assert con.execute("SELECT count(*) FROM components").fetchone()[0] == 5  # all kept
    con.close()
    assert len((run / "harvest" / "harvest.db").read_bytes()) == len(before)
    # a small file by key replaces one label (a new label drops the old scores) and keeps
    # the others
    one = _write_jsonl(tmp_path / "one.jsonl", [{"key": "b:0", "label": "zero or three"}])
    cli_ok("--project", run, "interp", "import", one)
    got = harvest_labels(run)
    assert got[("b", 0)] == {"label": "zero or three", "reasoning": None, "confidence": None,
                             "detection": None, "fuzzing": None, "source": None}  # fmt: skip
    assert got[("a", 0)] == LABELS[("a", 0)]
    assert sorted(p.name for p in (run / "harvest").iterdir()) == ["harvest.db"]


def _trial(task, site, c, label, fires, preds, trial=0):
    return {"task": task, "site": site, "component": c, "trial": trial, "label": label,
            "fires": fires, "predictions": preds}  # fmt: skip


def test_scores_equal_the_hand_computed_values(run: Path, tmp_path: Path):
    labels = _write_jsonl(
        tmp_path / "l.jsonl",
        [
            {"site": "a", "component": 0, "label": "zero"},
            {"site": "a", "component": 1, "label": "one"},
        ],
    )
    cli_ok("--project", run, "interp", "import", labels)
    trials = _write_jsonl(tmp_path / "t.jsonl", [
        # detection a:0: trial 0 TPR 1/2, TNR 1/2 -> 0.5; trial 1 TPR 1, TNR 1 -> 1; mean 0.75
        _trial("detection", "a", 0, "zero", [True, True, False, False],
               ["yes", "no", "no", "yes"]),
        _trial("detection", "a", 0, "zero", [True, False], [True, False], trial=1),
        # fuzzing a:0, pooled: TP 1 + 1 of 1 + 2 positives, TN 0 + 1 of 1 + 1 negatives:
        # TPR 2/3, TNR 1/2 -> 7/12
        _trial("fuzzing", "a", 0, "zero", [True, False], ["yes", "yes"]),
        _trial("fuzzing", "a", 0, "zero", [True, True, False], ["no", " Yes ", "no"], trial=1),
        # detection a:1: a trial without negatives: TPR 1, TNR counts 0 -> 0.5
        _trial("detection", "a", 1, "one", [True, True], ["yes", "yes"]),
        # fuzzing a:1 without any randomly marked example: 0 (as the anchors define it)
        _trial("fuzzing", "a", 1, "one", [True], ["yes"]),
        _trial("fuzzing", "a", 1, "one", [True, False], None),  # unfilled: skipped
    ])  # fmt: skip
    r = cli_ok("--project", run, "interp", "score", trials)
    out = " ".join(r.stdout.split())
    assert "1 trials without predictions were skipped" in out, out
    assert f"mean detection: {(0.75 + 0.5) / 2:.3f}" in out, out
    got = harvest_labels(run)
    assert got[("a", 0)]["detection"] == (0.5 + 1.0) / 2
    assert got[("a", 0)]["fuzzing"] == (2 / 3 + 1 / 2) / 2
    assert got[("a", 1)]["detection"] == (1.0 + 0.0) / 2
    assert got[("a", 1)]["fuzzing"] == 0.0
    assert got[("a", 0)]["label"] == "zero"  # the labels themselves untouched


def test_exported_trials_mark_what_they_say(rich: Path, tmp_path: Path):
    """Trials from a real export: detection's firing examples are exactly the held-out ones
    (centre marked), its non-firing ones other components' examples at other positions;
    fuzzing's correct examples mark every firing token of the window. A labeller who answers
    with the truth scores 1 on both."""
    run = rich
    cli_ok("--project", run, "interp", "export", "--held-out", "2")
    recs = {r["key"]: r for r in _records(run / "interp" / "components.jsonl")}
    lab = _write_jsonl(tmp_path / "l.jsonl", [{"key": "a:0", "label": "zero"}])
    cli_ok("--project", run, "interp", "import", lab)
    cli_ok("--project", run, "interp", "export", "--held-out", "2", "--trials", "2")
    trials = _records(run / "interp" / "trials.jsonl")
    assert [(t["task"], t["key"], t["trial"]) for t in trials] == [
        ("detection", "a:0", 0), ("fuzzing", "a:0", 0),
        ("detection", "a:0", 1), ("fuzzing", "a:0", 1)]  # fmt: skip
    held = recs["a:0"]["held_out"]
    det = trials[0]
    firing = sorted(x for x, f in zip(det["examples"], det["fires"], strict=True) if f)
    assert firing == sorted(e["text"] for e in held)
    others = {e["text"] for k, r in recs.items() if k != "a:0"
              for e in r["top"] + r["sample"] + r["held_out"]}  # fmt: skip
    assert all(x in others for x, f in zip(det["examples"], det["fires"], strict=True) if not f)
    assert det["prompt"].count("Example ") == len(det["examples"]) and "zero" in det["prompt"]
    from pdctl.interp.prompt import trial_prompt

    # the prompt is made of the label and the texts alone: the truth cannot leak into it
    assert det["prompt"] == trial_prompt("detection", "zero", det["examples"])
    fuzz = trials[1]
    for x, f in zip(fuzz["examples"], fuzz["fires"], strict=True):
        e = next(e for e in held if e["text"].replace("<<", "").replace(">>", "")
                 == x.replace("<<", "").replace(">>", ""))  # fmt: skip
        want = "".join(f"<<{t}>>" if c >= 0.1 else t
                       for t, c, i in zip(e["tokens"], e["cis"], e["ids"], strict=True)
                       if i >= 0)  # fmt: skip
        assert (x == want) == f, (x, want, f)
    for t in trials:
        t["predictions"] = ["yes" if f else "no" for f in t["fires"]]
    cli_ok("--project", run, "interp", "score", _write_jsonl(tmp_path / "t.jsonl", trials))
    assert harvest_labels(run)[("a", 0)]["detection"] == 1.0
    assert harvest_labels(run)[("a", 0)]["fuzzing"] == 1.0


def test_bad_input_is_one_line_and_writes_nothing(run: Path, tmp_path: Path):
    path = run / "harvest" / "harvest.db"
    before = path.read_bytes()

    def fails(*args) -> str:
        line = cli_fails(2, "--project", run, "interp", *args)
        assert path.read_bytes() == before, args
        assert sorted(p.name for p in (run / "harvest").iterdir()) == ["harvest.db"], args
        return line

    bad = tmp_path / "bad.jsonl"
    for text, want in [
        ('{"site": "a", "component": 0, "label": "x"}\nnot json\n', "bad.jsonl line 2: not JSON"),
        ('{"site": "z", "component": 0, "label": "x"}\n', "line 1: site: no site 'z'"),
        ('{"site": "a", "component": 3, "label": "x"}\n', "component: 3 is not in [0, 3)"),
        ('{"site": "a", "component": "0", "label": "x"}\n', "component: must be an integer"),
        ('{"site": "a", "component": 0, "label": 7}\n', "label: must be a non-empty string"),
        ('{"key": "a:0", "label": "x"}\n{"key": "a:0", "label": "y"}\n',
         "line 2: a:0 is labelled twice"),
        ('{"key": "a:0", "label": "x", "detection": 1.5}\n', "detection: must be in [0, 1]"),
        ('{"key": "a:0", "label": null}\n', "no labels in it"),
        ("[1, 2]\n", "line 1: expected a JSON object, got list"),
    ]:  # fmt: skip
        bad.write_text(text)
        line = fails("import", bad)
        assert want in line, (text, line)
    assert "no such file" in fails("import", tmp_path / "nope.jsonl")
    assert "--top: must be an integer, got 'ten'" in fails("export", "--top", "ten")
    assert "--held-out: must be >= 0, got -1" in fails("export", "--held-out", "-1")
    assert "--site: no site 'q'" in fails("export", "--site", "q")
    assert "--model: required with --endpoint" in fails("export", "--endpoint", "http://x/v1")
    assert "--endpoint: must be an http" in fails("export", "--endpoint", "ftp://x", "--model", "m")
    assert "--rpm: must be a number > 0" in fails("export", "--endpoint", "http://127.0.0.1:9",
                                                  "--model", "m", "--rpm", "0")  # fmt: skip
    assert not (run / "interp").exists()  # the export refused before writing anything
    cli_ok("--project", run, "interp", "import",
           _write_jsonl(tmp_path / "l.jsonl", [{"key": "a:0", "label": "zero"}]))  # fmt: skip
    before = path.read_bytes()
    for trial, want in [
        (_trial("detection", "a", 0, "zero", [True, False], ["yes"]), "1 answers for 2"),
        (_trial("detection", "a", 0, "zero", [True], ["maybe"]), "got 'maybe'"),
        (_trial("guess", "a", 0, "zero", [True], ["yes"]), "task: must be detection or fuzzing"),
        (_trial("detection", "a", 0, "zero", "yes", ["yes"]), "fires: must be a list"),
        (_trial("detection", "a", 0, "one", [True], ["yes"]),
         "made for label 'one', the database holds 'zero'"),
        (_trial("detection", "a", 0, "zero", [True], None), "no trial has its predictions"),
    ]:  # fmt: skip
        line = fails("score", _write_jsonl(tmp_path / "t.jsonl", [trial]))
        assert want in line, (trial, line)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    from helpers import make_run

    empty = make_run(fresh, "tms", "e")
    line = cli_fails(2, "--project", empty, "interp", "export")
    assert "no harvest here (run `pdctl harvest` first)" in line


# ---- --endpoint against a stub server ------------------------------------------------------


class _Stub(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible chat-completions stub: the first request gets a 500; labels are
    "label of <key>"; trial prompts get the yes / no list the server was given."""

    seen: ClassVar[list] = []
    fail_first = True
    answers: ClassVar[dict] = {}

    def log_message(self, *a):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Stub.seen.append((self.path, self.headers.get("Authorization"), body))
        if _Stub.fail_first:
            _Stub.fail_first = False
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"overloaded")
            return
        prompt = body["messages"][0]["content"]
        if prompt.startswith("You are labelling"):
            key = prompt.split("Component ", 1)[1].split(" ", 1)[0]
            content = "```json\n" + json.dumps({"label": f"label of {key}",
                                                "reasoning": "stub"}) + "\n```"  # fmt: skip
        else:
            content = json.dumps({"predictions": _Stub.answers[prompt]})
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(out.encode())


@pytest.fixture
def stub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    _Stub.seen, _Stub.fail_first, _Stub.answers = [], True, {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_endpoint_labels_and_scores_with_a_retry_after_a_500(rich, stub, monkeypatch):
    from pdctl.interp import endpoint as ep

    run = rich
    monkeypatch.setattr(ep, "BACKOFF_S", 0.01)
    monkeypatch.setenv("STUB_KEY", "sekrit")
    args = ("--project", run, "interp", "export", "--endpoint", stub, "--model", "stub-1",
            "--api-key-env", "STUB_KEY", "--rpm", "60000", "--held-out", "2")  # fmt: skip
    r = cli_ok(*args)
    out = " ".join(r.stdout.split())
    assert "4 labels from" in out and "4 components labelled" in out, out
    # 1 failed + 4 answered; the 500 was retried; the key sent as a bearer token
    assert len(_Stub.seen) == 5
    assert all(p == "/v1/chat/completions" and a == "Bearer sekrit" for p, a, _ in _Stub.seen)
    assert _Stub.seen[0][2] == _Stub.seen[1][2]  # the same request, again
    assert _Stub.seen[1][2]["model"] == "stub-1" and _Stub.seen[1][2]["temperature"] == 0
    labels = harvest_labels(run)
    assert labels[("a", 0)] == {"label": "label of a:0", "reasoning": "stub", "confidence": None,
                                "detection": None, "fuzzing": None, "source": "stub-1"}  # fmt: skip
    assert "sekrit" not in (run / "interp" / "labels.jsonl").read_text()
    # resumable: a second run asks nothing (every component labelled)
    cli_ok(*args)
    assert len(_Stub.seen) == 5
    # the trials of that export (it ran after the labels came in: export again) go to the stub,
    # which answers the truth of detection and the opposite of the truth of fuzzing
    cli_ok("--project", run, "interp", "export", "--held-out", "2")
    trials = _records(run / "interp" / "trials.jsonl")
    assert {t["task"] for t in trials} == {"detection", "fuzzing"}
    for t in trials:
        flip = t["task"] == "fuzzing"
        _Stub.answers[t["prompt"]] = ["yes" if f != flip else "no" for f in t["fires"]]
    _Stub.fail_first = True
    r = cli_ok("--project", run, "interp", "score", run / "interp" / "trials.jsonl",
               "--endpoint", stub, "--model", "stub-1", "--rpm", "60000")  # fmt: skip
    assert f"{len(trials)} trials answered" in " ".join(r.stdout.split())
    got = harvest_labels(run)
    fuzzed = {(t["site"], t["component"]) for t in trials if t["task"] == "fuzzing"}
    for key, row in got.items():
        assert row["detection"] == 1.0, key
        if key in fuzzed:
            assert row["fuzzing"] == 0.0, key
    n = len(_Stub.seen)
    cli_ok("--project", run, "interp", "score", run / "interp" / "trials.jsonl",
           "--endpoint", stub, "--model", "stub-1", "--rpm", "60000")  # fmt: skip
    assert len(_Stub.seen) == n  # answered trials are not asked again


def test_endpoint_rate_limit_retry_after_and_a_4xx(monkeypatch):
    """The client's pacing and retry policy with the clock's sleep recorded, no server."""
    import httpx

    from pdctl.interp import endpoint as ep

    slept: list[float] = []
    clock = [100.0]

    def sleep(s: float) -> None:  # a clock that moves only when the client sleeps
        slept.append(s)
        clock[0] += s

    codes = iter([429, 503, 200, 404])

    def handler(request):
        code = next(codes)
        if code == 200:
            return httpx.Response(200, json={"choices": [{"message": {"content": "hi"}}]})
        return httpx.Response(code, headers={"Retry-After": "7"} if code == 429 else {})

    c = ep.Client("http://s/chat/completions", "m", rpm=30, retries=3, sleep=sleep)
    c._http = httpx.Client(transport=httpx.MockTransport(handler))
    monkeypatch.setattr(ep.time, "monotonic", lambda: clock[0])
    assert c.chat("x") == "hi"
    # the backoff after the 429 honours its Retry-After (7 s), after the 503 it is
    # 2 * BACKOFF_S; the requests were >= 60 / 30 = 2 s apart already
    assert slept == [7.0, 2.0], slept
    with pytest.raises(ep.EndpointError, match="answered HTTP 404"):
        c.chat("y")  # at once: its turn comes 2 s after the last request; a 404 is not retried
    assert slept == [7.0, 2.0, 2.0], slept
    assert next(codes, None) is None  # four requests in all


# ---- browse ----------------------------------------------------------------------------------


def test_browse_api_gives_the_labels(run: Path, tmp_path: Path):
    with _serving(run) as base:
        assert json.loads(_get(f"{base}/api/labels")[1]) == {"rows": []}
        rows = [{"site": s, "component": c, **v} for (s, c), v in LABELS.items()]
        cli_ok("--project", run, "interp", "import", _write_jsonl(tmp_path / "l.jsonl", rows))
        got = json.loads(_get(f"{base}/api/labels?site=a&component=0")[1])
        assert got == {"rows": [rows[0]]}
        assert len(json.loads(_get(f"{base}/api/labels?site=a")[1])["rows"]) == 2
        assert _get(f"{base}/api/labels?component=x")[0] == 400


@pytest.mark.slow  # headless Chromium: ~6 s
def test_browse_shows_labels_in_headless_chromium(run: Path, tmp_path: Path):
    import time

    from test_report import need_chromium

    from pdctl.testing.browser import Browser

    need_chromium()
    hostile = "<img src=x onerror=\"document.title='pwned'\">"
    rows = [{"site": "a", "component": 0, "label": "zeros", "detection": 0.75,
             "reasoning": hostile},
            {"site": "a", "component": 2, "label": hostile}]  # fmt: skip
    cli_ok("--project", run, "interp", "import", _write_jsonl(tmp_path / "l.jsonl", rows))
    browser = Browser(tmp_path / "profile")

    js = browser.js

    def goto(route: str) -> None:
        js(f"location.hash = '{route}'")
        deadline = time.monotonic() + 20
        while js("document.body.dataset.ready") != route:
            assert time.monotonic() < deadline, (route, js("document.body.innerHTML"))
            time.sleep(0.05)

    try:
        with _serving(run) as base:
            errors, _, _ = browser.load(f"{base}/")
            assert errors == [], errors
            goto("#/site/a")
            cells = js("Array.from(document.querySelectorAll('main table tr'))"
                       ".map(tr => tr.lastElementChild.textContent)")  # fmt: skip
            assert cells[0] == "label", cells
            links = js("Array.from(document.querySelectorAll('main a.component'))"
                       ".map(a => a.textContent)")  # fmt: skip
            by = dict(zip(links, cells[1:], strict=True))
            assert by == {"a #0": "zeros", "a #1": "", "a #2": hostile}, by
            goto("#/c/a/0")
            text = js("document.getElementById('label').textContent")
            assert text == "label: zeros; detection 0.75", text
            assert hostile in js("document.getElementById('main').textContent")  # as text
            time.sleep(0.2)  # an <img src=x> would have failed to load by now
            assert js("document.querySelectorAll('main img').length") == 0
            assert js("document.title") == "pdctl browse"  # no script ran
            goto("#/c/a/1")
            assert js("document.getElementById('label')") is None  # unlabelled: no section
            page_errors = [m for m in browser.seen if m.get("method") == "Runtime.exceptionThrown"]
            assert page_errors == []
    finally:
        browser.close()
