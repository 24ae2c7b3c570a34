"""A stage's log off a terminal (issue 52 item 1): under nohup, tmux logging or a scheduler,
stdout is a file or a pipe, and the run must say when it compiles, each logging step, each
evaluation and its end; `--log-format json` gives the same records as JSON lines."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import cli, cli_fails, cli_ok, make_run, pdctl_argv, pdctl_env

from pdctl.engine import runtime

TRAIN = {
    "warmup": {"steps": 2, "log_every": 2},
    "train": {"steps": 4, "batch_size": 64, "log_every": 2, "eval_every": 4},
}


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> Path:
    run = make_run(tmp_path_factory.mktemp("log"), "tms", **TRAIN)
    for stage in ("init-weights", "pretrain", "warmup"):
        cli_ok("--project", run, stage)
    return run


@pytest.fixture
def no_format(monkeypatch):
    """`--log-format` sets $PDCTL_LOG_FORMAT for the stage's process: put it back after."""
    monkeypatch.setenv(runtime.LOG_FORMAT_ENV, "auto")


@pytest.mark.slow  # a pdctl process of its own (~15-30 s on 2 cores)
def test_train_with_stdout_a_pipe_says_what_it_does(warmed: Path) -> None:
    """The real entry point, stdout a pipe: a line when the step compiles and when it has,
    one per logging step (step / total, loss, terms, L0, ms a step, ETA), one per evaluation,
    and the stage's end line."""
    r = subprocess.run(
        pdctl_argv("train", project=warmed),
        env=pdctl_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()

    def find(prefix: str) -> list[str]:
        return [x for x in lines if x.startswith(prefix)]

    assert find("train: compiling the step"), lines
    assert find("train: step compiled in "), lines  # no cache in a test's child: compiled
    steps = find("train: step 2/4  loss ") + find("train: step 4/4  loss ")
    assert len(steps) == 2, lines
    for line in steps:
        for part in ("importance_minimality", "L0 ", " ms/step", "ETA 0:"):
            assert part in line, line
    assert len(find("train: evaluation at step 4: ")) == 1, lines
    assert "mmcs" in find("train: evaluation at step 4: ")[0]
    assert find("train: done"), lines
    order = [lines.index(find(p)[0]) for p in ("train: compiling", "train: step 2/4",
                                               "train: evaluation", "train: done")]  # fmt: skip
    assert order == sorted(order), lines


@pytest.mark.slow  # ~7 s: stages in fresh processes
def test_json_lines_parse_one_by_one(warmed: Path, tmp_path: Path, no_format) -> None:
    """`--log-format json`: every record the loop prints is one JSON object a line (the
    command's own end line stays text)."""
    import shutil

    run = tmp_path / "r"
    shutil.copytree(warmed, run)
    r = cli("--log-format", "json", "--project", run, "train", "--fresh")
    assert r.exit_code == 0, r.output
    records = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    events = [x["event"] for x in records]
    assert events[:2] == ["compile", "compiled"], events
    assert isinstance(records[1]["cache_hit"], bool), records[1]
    assert events.count("step") == 2 and events.count("eval") == 1, events
    step = next(x for x in records if x["event"] == "step")
    assert step["stage"] == "train" and step["step"] == 2 and step["steps"] == 4
    assert {"loss", "step_ms", "eta_s", "l0_mean"} <= set(step), step
    ev = next(x for x in records if x["event"] == "eval")
    assert ev["step"] == 4 and any(k.startswith("eval/") for k in ev), ev
    text = [x for x in r.stdout.splitlines() if x and not x.startswith("{")]
    assert text and text[0].startswith("train: done"), text  # the command's own end lines
    # again: the step now comes from the compile cache (the tests' session cache), and says so
    again = cli("--log-format", "json", "--project", run, "train", "--fresh")
    assert again.exit_code == 0, again.output
    compiled = [json.loads(x) for x in again.stdout.splitlines() if '"compiled"' in x]
    assert compiled and compiled[0]["cache_hit"] is True, compiled


def test_a_bad_log_format_is_one_line(warmed: Path, no_format) -> None:
    line = cli_fails(2, "--log-format", "yaml", "--project", warmed, "status")
    assert "--log-format: must be one of auto, text, json, got 'yaml'" in line
