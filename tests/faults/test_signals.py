"""Signals in every phase, and processes that die (the items below are a review's numbers,
which the tests' names keep).

- SIGTERM during a compile, a restore, an evaluation or tokenization is acted on within
  seconds: exit 3, status `interrupted`, the last checkpoint kept (item 2);
- huge legal step counts (2**40, 2**63 - 1) stop cleanly at `--until` (item 5);
- a stage whose process dies by a signal (SIGABRT, SIGKILL) ends `failed` with one line,
  the last checkpoint kept, through the supervising parent process (item 7);
- SIGTERM after the last step says the stage is done (exit 0), `pdctl run` says what continues,
  and SIGTERM during `pdctl report` leaves the previous report whole (item 18);
- in a 2-process run, SIGTERM to both processes or to one ends both with a stop checkpoint,
  `interrupted`, exit 3, and SIGKILL of one ends the other `failed` with one line (items 4, 7:
  marked slow).

Phases are made slow by a few lines of Python run before the CLI (`_start`), which make the
call sleep in Python: like a long C++ call, a sleeping call does not return when a signal
arrives (the handler runs, the sleep goes on). One test compiles a genuinely slow program (an
unrolled scan) and signals it mid-compile.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import cli, edit_config, make_run, pdctl_argv, pdctl_env, state

TESTS = Path(__file__).resolve().parents[1]  # tests/: helpers, fixtures
SLOW_CALL_S = 60  # how long an injected slow phase sleeps (the old code waited all of it)
LATENCY_S = 8.0  # signal to exit: the grace (2 s) plus writing the state, with a loaded machine


def _ok(*args: Any) -> Any:
    result = cli(*map(str, args))
    assert result.exit_code == 0, (args, result.stdout, result.stderr, result.exception)
    return result


def _errors(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("error: ")]


# ---- a stage command in a process of its own, with a slow phase planted -----------------------


def _start(run: Path, hook: str, *args: str, mark: Path, supervised: bool = False, devices=1):
    """`pdctl --project RUN ARGS` through the real entry point (`pdctl.cli.main`), in a
    process where `hook` (Python with `os`, `time`, `signal`, `MARK` and `slow(obj, name,
    when=None)` at hand) has run first. `slow` makes `obj.name` touch MARK and sleep
    SLOW_CALL_S before it runs (when `when(*args)` is true). Unsupervised by default (the
    hook must run in the process that runs the stage); the signal tests of the supervisor
    itself use `_spawn`."""
    code = (
        "import os, signal, sys, time\n"
        f"MARK = {str(mark)!r}\n"
        "def slow(obj, name, when=None):\n"
        "    orig = getattr(obj, name)\n"
        "    def hooked(*a, **k):\n"
        "        if when is None or when(*a, **k):\n"
        "            open(MARK, 'w').close()\n"
        f"            time.sleep({SLOW_CALL_S})\n"
        "        return orig(*a, **k)\n"
        "    setattr(obj, name, hooked)\n"
        f"{hook}\n"
        "from pdctl.cli import main\n"
        "sys.argv = ['pdctl', '--project', sys.argv[1], *sys.argv[2:]]\n"
        "main()\n"
    )
    env = pdctl_env(devices)
    if not supervised:
        env["PDCTL_SUPERVISOR"] = "0"
    return subprocess.Popen(
        [sys.executable, "-c", code, str(run), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 240, what: str = "") -> None:
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited {proc.returncode} before {what}:\n{out}\n{err[-3000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _signal_and_time(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 40):
    """Send `sig`, wait for the exit; (exit code, stdout, stderr, seconds from signal to exit)."""
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"no exit {timeout} s after {signal.Signals(sig).name}:\n{err[-3000:]}")
    return proc.returncode, out, err, time.monotonic() - t0


def _stopped_within(proc, mark: Path, latency: float = LATENCY_S) -> tuple[str, float]:
    """Signal `proc` once its slow phase has begun: exit 3 within `latency` s, one error line
    (returned)."""
    _wait_for(mark.exists, proc, what="the slow phase")
    time.sleep(0.3)
    rc, out, err, dt = _signal_and_time(proc)
    print(f"SIGTERM to exit: {dt:.2f} s")
    assert rc == 3, (rc, out, err[-3000:])
    assert dt < latency, f"{dt:.1f} s from SIGTERM to exit\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = _errors(err)
    assert len(lines) == 1, err[-3000:]
    return lines[0], dt


# ---- the runs --------------------------------------------------------------------------------

ISSUE = {
    "checkpoint": {"every": 5},
    "pretrain": {"steps": 20, "batch_size": 64, "log_every": 5},
    "warmup": {"steps": 5, "log_every": 5},
    "train": {"steps": 10, "batch_size": 64, "log_every": 5, "eval_every": 5},
}


def _base(factory: pytest.TempPathFactory, name: str, template: str, commands, **over) -> Path:
    root = factory.getbasetemp() / f"signals-{name}"
    if not (root / "ready").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        run = make_run(root, template, "r", **over)
        for cmd in commands:
            _ok("--project", run, *cmd)
        (root / "ready").touch()
    return root / "r"


@pytest.fixture(scope="module")
def initialized(tmp_path_factory) -> Path:
    return _base(tmp_path_factory, "init", "tms", [["init-weights"]], **ISSUE)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> Path:
    """init-weights, pretrain and warmup done; train not started."""
    return _base(
        tmp_path_factory,
        "warm",
        "tms",
        [["init-weights"], ["pretrain"], ["warmup"]],
        **ISSUE,
    )


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "r"
    shutil.copytree(src, dst)
    return dst


def _ckpts(run: Path, stage: str) -> list[int]:
    d = run / "checkpoints" / stage
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


# ---- item 2: SIGTERM in every phase ----------------------------------------------------------


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_2_sigterm_during_a_real_slow_compile_exits_within_seconds(tmp_path: Path) -> None:
    """The loop compiles a step whose XLA compile takes tens of seconds (an unrolled scan);
    SIGTERM half a second into it ends the process within seconds, `interrupted`, exit 3."""
    mark = tmp_path / "compiling"
    code = f"""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {str(TESTS)!r})
import jax, jax.numpy as jnp
from helpers import make_loop
from pdctl.engine import runtime
from pdctl.engine.loop import Interrupted, loop_counters

orig = jax.stages.Lowered.compile
def compile(self, *a, **k):
    open({str(mark)!r}, "w").close()
    return orig(self, *a, **k)
jax.stages.Lowered.compile = compile

def step(state, batch):
    def body(c, _):
        return jnp.tanh(c @ c.T) * 0.5 + jnp.sin(c), None
    x = jax.lax.scan(body, state["x"], None, length=2000, unroll=2000)[0]
    loop = state["loop"]
    new = {{**loop, "step": loop["step"] + 1}}
    return {{"x": x, "loop": new}}, {{"loss": jnp.sum(x), "max_bad_run": loop["max_bad_run"]}}

state = {{"x": jnp.ones((8, 8)), "loop": loop_counters(jax.random.PRNGKey(0))}}
loop, _, states = make_loop(
    jax.jit(step, donate_argnums=0), state, Path(sys.argv[1]), total=10, log_every=5
)
try:
    loop.run()
    code = 0
except Interrupted as e:
    print("interrupted:", e, file=sys.stderr, flush=True)
    code = 3 if getattr(runtime, "abandoned", lambda: None)() else 4
print(json.dumps(states[-1] if states else {{}}), flush=True)
os._exit(code)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        env=pdctl_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(mark.exists, proc, what="the compile")
    time.sleep(0.5)
    rc, out, err, dt = _signal_and_time(proc, timeout=120)
    print(f"SIGTERM to exit during a real compile: {dt:.2f} s")
    assert rc == 3, (rc, out, err[-2000:])
    assert dt < LATENCY_S, f"{dt:.1f} s"
    assert "while compiling the step (left unfinished)" in err, err[-2000:]
    last = json.loads(out.strip().splitlines()[-1])
    assert last["status"] == "interrupted" and last.get("checkpoint") is None, last


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_2_sigterm_while_compiling_the_stage_step(initialized: Path, tmp_path: Path) -> None:
    run = _copy(initialized, tmp_path)
    mark = tmp_path / "mark"
    hook = "import jax; slow(jax.stages.Lowered, 'compile')"
    line, _ = _stopped_within(_start(run, hook, "pretrain", mark=mark), mark)
    assert "pretrain: stopped by SIGTERM while compiling the step (left unfinished)" in line
    assert "no checkpoint of this run was saved; `pdctl resume` starts it over" in line
    st = state(run, "pretrain")
    assert st["status"] == "interrupted" and st.get("checkpoint") is None, st
    result = _ok("--project", run, "resume")
    assert "starting it over" in result.stderr and "pretrain: done at step 20" in result.stdout


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_2_sigterm_while_a_stage_waits_for_its_step_compiling_ahead(
    initialized: Path, tmp_path: Path
) -> None:
    """`pdctl run` with `[compile] ahead = true`: warmup's step compiles on the host thread
    (made to take a minute) while pretrain runs; SIGTERM once pretrain is done, while warmup
    waits for that compile, ends the run within seconds (exit 3, warmup `interrupted`), the
    thread left running, and `pdctl run` then finishes the run."""
    run = _copy(initialized, tmp_path)
    edit_config(run, {"compile": {"cache_dir": str(tmp_path / "cc"), "ahead": True}})
    mark = tmp_path / "mark"
    hook = (
        "import jax\nfrom pdctl.engine import ahead\n"
        "slow(jax.stages.Lowered, 'compile', when=lambda *a, **k: ahead.current() == 'warmup')"
    )
    proc = _start(run, hook, "run", mark=mark)
    _wait_for(lambda: state(run, "pretrain").get("status") == "done", proc, what="pretrain")
    assert mark.exists()  # the compile ahead is sleeping
    time.sleep(3.0)  # warmup's restores done (~1 s): it waits in its compile
    rc, out, err, dt = _signal_and_time(proc)
    assert rc == 3, (rc, out, err[-3000:])
    assert dt < LATENCY_S, f"{dt:.1f} s from SIGTERM to exit\n{err[-3000:]}"
    assert "warmup: waiting for the step compiling ahead" in out + err, (out, err[-3000:])
    lines = _errors(err)
    assert len(lines) == 1 and "warmup: stopped by SIGTERM while compiling the step" in lines[0]
    assert state(run, "warmup")["status"] == "interrupted"
    _ok("--project", run, "run")
    assert state(run, "train")["status"] == "done"


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_2_sigterm_while_restoring_a_checkpoint(initialized: Path, tmp_path: Path) -> None:
    run = _copy(initialized, tmp_path)
    _ok("--project", run, "pretrain", "--until", "5")
    mark = tmp_path / "mark"
    hook = "import pdctl.engine.checkpoint as c; slow(c.Checkpointer, 'restore')"
    line, _ = _stopped_within(_start(run, hook, "pretrain", "--resume", mark=mark), mark)
    assert "stopped by SIGTERM while restoring checkpoint 5 (left unfinished)" in line, line
    assert "the last checkpoint, step 5, is kept; continue with `pdctl resume`" in line, line
    st = state(run, "pretrain")
    assert st["status"] == "interrupted" and st["checkpoint"] == 5 and st["step"] == 5, st
    assert "pretrain: done at step 20" in _ok("--project", run, "resume").stdout


def _slow_eval_hook(at_step: int) -> str:
    """A hook that makes train's evaluation of step `at_step` slow (see `_start`)."""
    return (
        "import pdctl.stages.train as t\n"
        "make_eval = t.make_eval\n"
        "def slow_eval(*a, **k):\n"
        "    fn = make_eval(*a, **k)\n"
        "    class E: pass\n"
        "    E.fn = staticmethod(fn)\n"
        f"    slow(E, 'fn', when=lambda s: int(s['loop']['step']) == {at_step})\n"
        "    return E.fn\n"
        "t.make_eval = slow_eval\n"
    )


def _evals(run: Path) -> dict[int, dict[str, Any]]:
    """{step: the evaluation's metrics} from metrics/train.jsonl (the last record per step)."""
    out: dict[int, dict[str, Any]] = {}
    for line in (run / "metrics" / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        ev = {k: v for k, v in rec.items() if k.startswith("eval/")}
        if ev:
            out[int(rec["step"])] = ev
    return out


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_2_sigterm_during_the_final_evaluation(warmed: Path, tmp_path: Path) -> None:
    """The issue's case: SIGTERM while train evaluates at its last step. It stops within
    seconds (not when the evaluation ends), saves the step it holds (10) as a checkpoint, and
    `resume` evaluates it and ends done without a step run again."""
    run = _copy(warmed, tmp_path)
    mark = tmp_path / "mark"
    line, _ = _stopped_within(_start(run, _slow_eval_hook(10), "train", mark=mark), mark)
    assert "train: stopped by SIGTERM while evaluating step 10; checkpoint of step 10 saved" in (
        line
    ), line
    st = state(run, "train")
    assert st["status"] == "interrupted" and st["checkpoint"] == 10 and st["step"] == 10, st
    assert _ckpts(run, "train") == [5, 10]
    result = _ok("--project", run, "resume")
    assert "train: done at step 10" in result.stdout
    assert state(run, "train")["eval"]
    assert 10 in _evals(run)


@pytest.mark.slow  # subprocess runs of several seconds: the slow tier
def test_2_sigterm_during_an_evaluation_loses_no_step(warmed: Path, tmp_path: Path) -> None:
    """Issue 51: SIGTERM while train evaluates step 5, before that step's checkpoint: the stage
    saves step 5 (the state is whole: an evaluation donates nothing) and exits 3; `pdctl
    resume` evaluates step 5 first and continues from it, and the run ends exactly as one never
    stopped (CPU: every evaluation equal). Before, nothing of the run was kept."""
    reference = _copy(warmed, tmp_path / "ref")
    _ok("--project", reference, "train")
    run = _copy(warmed, tmp_path / "stopped")
    mark = tmp_path / "mark"
    line, _ = _stopped_within(_start(run, _slow_eval_hook(5), "train", mark=mark), mark)
    assert "while evaluating step 5; checkpoint of step 5 saved" in line, line
    assert "evaluates step 5 first" in line, line
    st = state(run, "train")
    assert st["status"] == "interrupted" and st["checkpoint"] == 5, st
    assert _ckpts(run, "train") == [5]
    assert 5 not in _evals(run)
    result = _ok("--project", run, "resume")
    assert "train: done at step 10" in result.stdout
    assert _evals(run) == _evals(reference)
    assert state(run, "train")["eval"] == state(reference, "train")["eval"]


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_2_sigterm_while_tokenizing(tmp_path_factory, tmp_path: Path) -> None:
    base = _base(tmp_path_factory, "llama", "llama-mlp", [["init-weights"]])
    run = _copy(base, tmp_path)
    mark = tmp_path / "mark"
    hook = "import pdctl.stages.env as c; slow(c, 'corpus_tokens')"
    line, _ = _stopped_within(_start(run, hook, "pretrain", mark=mark), mark)
    assert "stopped by SIGTERM while reading and tokenizing the corpus (left unfinished)" in line
    st = state(run, "pretrain")
    assert st["status"] == "interrupted" and st.get("checkpoint") is None, st


# ---- item 5: huge step counts ----------------------------------------------------------------


@pytest.mark.parametrize("steps", [2**40, 2**63 - 1])
def test_5_huge_step_counts_stop_cleanly_at_until(
    initialized: Path, tmp_path: Path, steps: int
) -> None:
    run = _copy(initialized, tmp_path)
    edit_config(run, {"pretrain": {"steps": steps}})
    result = _ok("--project", run, "pretrain", "--until", "3")
    assert "pretrain: interrupted at step 3" in result.stdout
    st = state(run, "pretrain")
    assert st["status"] == "interrupted" and st["step"] == 3 and st["steps"] == steps


@pytest.mark.slow
def test_5_a_huge_train_step_count_stops_cleanly_at_until(warmed: Path, tmp_path: Path) -> None:
    run = _copy(warmed, tmp_path)
    edit_config(run, {"train": {"steps": 2**40, "eval_every": 2**40}})
    result = _ok("--project", run, "train", "--until", "2")
    assert "train: interrupted at step 2" in result.stdout


@pytest.mark.slow
def test_run_and_resume_until_stop_the_train_stage_there(warmed: Path, tmp_path: Path) -> None:
    """`pdctl run --until N` / `pdctl resume --until N`: the pipeline's train stage stops
    cleanly at step N (the first N steps of a long schedule, on a TPU window)."""
    run = _copy(warmed, tmp_path)
    edit_config(run, {"train": {"steps": 100, "eval_every": 100}})
    result = _ok("--project", run, "run", "--until", "2")
    assert "train: interrupted at step 2" in result.stdout
    st = state(run, "train")
    assert st["status"] == "interrupted" and st["step"] == 2 and st["steps"] == 100, st
    result = _ok("--project", run, "resume", "--until", "4")
    assert "train: interrupted at step 4" in result.stdout
    bad = cli("--project", str(run), "run", "--until", "0")
    assert bad.exit_code == 2 and "--until: must be a step >= 1" in bad.stderr + bad.stdout
    assert state(run, "train")["step"] == 4


# ---- item 18: the edges ----------------------------------------------------------------------

_TERM_AT_LAST_LOG = (
    "import pdctl.engine.loop as L\n"
    "log = L.Loop._log\n"
    "def _log(self, step, *a, **k):\n"
    "    if step == self.total_steps:\n"
    "        os.kill(os.getpid(), signal.SIGTERM)\n"
    "    return log(self, step, *a, **k)\n"
    "L.Loop._log = _log\n"
)


def _run_to_end(run: Path, hook: str, *args: str) -> subprocess.CompletedProcess:
    proc = _start(run, hook, *args, mark=run.parent / "unused")
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_18_sigterm_in_the_last_step_ends_done(initialized: Path, tmp_path: Path) -> None:
    """SIGTERM while the last step runs: the stage finished, so it says done (exit 0), not
    `continue with pdctl resume` about a stage that has nothing left to resume."""
    run = _copy(initialized, tmp_path)
    proc = _run_to_end(run, _TERM_AT_LAST_LOG, "pretrain")
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "pretrain: done at step 20" in proc.stdout
    assert "pdctl resume" not in proc.stderr and not _errors(proc.stderr), proc.stderr
    assert "SIGTERM came after it finished; it is done" in proc.stderr
    assert state(run, "pretrain")["status"] == "done"


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_18_sigterm_in_the_last_step_of_a_pipeline_stage(initialized: Path, tmp_path) -> None:
    """`pdctl run`: pretrain's last step is signalled; pretrain is done, the pipeline stops
    before warmup (exit 3) and says that `pdctl run` continues with it."""
    run = _copy(initialized, tmp_path)
    proc = _run_to_end(run, _TERM_AT_LAST_LOG, "run")
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert _errors(proc.stderr) == [
        "error: run: stopped by SIGTERM after pretrain finished (done); `pdctl run` continues "
        "with warmup"
    ], proc.stderr
    assert state(run, "pretrain")["status"] == "done" and not state(run, "warmup")


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_18_sigterm_during_report_leaves_the_previous_report_whole(
    warmed: Path, tmp_path: Path
) -> None:
    run = _copy(warmed, tmp_path)
    _ok("--project", run, "report", "--stage", "warmup")
    report = run / "report"
    before = {p.name: p.read_bytes() for p in report.iterdir()}
    assert "index.html" in before and len(before) > 5
    hook = (
        "import pdctl.report.figures as F\n"
        "orig = F.plot_component_norms\n"
        "def norms(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return orig(*a, **k)\n"
        "F.plot_component_norms = norms\n"
    )
    proc = _run_to_end(run, hook, "report", "--stage", "warmup")
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert _errors(proc.stderr) == [
        f"error: report: stopped by SIGTERM; {report} is as it was (the new report was not kept)"
    ], proc.stderr
    assert {p.name: p.read_bytes() for p in report.iterdir()} == before
    assert sorted(p.name for p in run.iterdir() if "tmp" in p.name) == []


# ---- item 7: a stage process that dies ---------------------------------------------------------


def _spawn(run: Path, *args: str, devices: int = 1) -> subprocess.Popen:
    """`python -m pdctl --project RUN ARGS`: the supervised entry point, as users run it."""
    return subprocess.Popen(
        pdctl_argv(*args, project=run),
        env=pdctl_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _child(parent: int, timeout: float = 30) -> int:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise AssertionError("the supervised child never started")


def _long_pretrain(initialized: Path, tmp_path: Path) -> Path:
    run = _copy(initialized, tmp_path)
    edit_config(run, {"pretrain": {"steps": 10**7, "log_every": 100}, "checkpoint": {"every": 200}})
    return run


def _recorded_checkpoint(run: Path) -> bool:
    try:
        return bool(state(run, "pretrain").get("checkpoint"))
    except Exception:  # mid-write
        return False


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
@pytest.mark.parametrize("sig", [signal.SIGABRT, signal.SIGKILL])
def test_7_a_stage_process_dying_by_a_signal_ends_failed_with_one_line(
    initialized: Path, tmp_path: Path, sig: int
) -> None:
    """The process running the stage dies by SIGABRT (an abort in XLA or gloo) or SIGKILL
    (the out-of-memory killer) after its first checkpoint: `pdctl` exits 1 with one line,
    `[state.pretrain]` is `failed` (not `running`), the checkpoint is kept and resumable."""
    run = _long_pretrain(initialized, tmp_path)
    proc = _spawn(run, "pretrain")
    _wait_for(lambda: _recorded_checkpoint(run), proc, what="the first checkpoint")
    child = _child(proc.pid)
    os.kill(child, sig)
    _, err = proc.communicate(timeout=60)
    name = signal.Signals(sig).name
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    lines = _errors(err)
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err[-3000:]
    st = state(run, "pretrain")
    latest = max(_ckpts(run, "pretrain"))
    assert lines[0].startswith(f"error: pretrain: the process died by {name} ("), lines
    assert lines[0].endswith(
        f"; the last good checkpoint is step {latest} (continue with `pdctl pretrain --resume`)."
    ), (lines, _ckpts(run, "pretrain"))
    assert st["status"] == "failed" and st["checkpoint"] == latest, st
    assert st["error"].startswith(f"pretrain: the process died by {name}")
    result = _ok("--project", run, "pretrain", "--resume", "--until", latest + 5)
    assert f"pretrain: interrupted at step {latest + 5}" in result.stdout


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_7_kill_9_of_pdctl_takes_the_stage_process_with_it(
    initialized: Path, tmp_path: Path
) -> None:
    """`kill -9` of the pdctl the user started ends the stage process too (it is not left
    training, holding the lock): the stage is `running` with the lock free (crashed), and
    `pdctl resume` continues it."""
    run = _long_pretrain(initialized, tmp_path)
    proc = _spawn(run, "pretrain")
    _wait_for(lambda: _recorded_checkpoint(run), proc, what="the first checkpoint")
    child = _child(proc.pid)
    proc.kill()
    proc.communicate(timeout=30)
    t0 = time.monotonic()
    while Path(f"/proc/{child}").exists() and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists(), "the stage process outlived pdctl"
    report = json.loads(_ok("--project", run, "status", "--json").stdout)["pretrain"]
    assert report["status"] == "running" and report["crashed"] is True


@pytest.mark.slow
def test_7_sigterm_to_pdctl_reaches_the_stage_process(initialized: Path, tmp_path) -> None:
    run = _long_pretrain(initialized, tmp_path)
    proc = _spawn(run, "pretrain")
    _wait_for(lambda: _recorded_checkpoint(run), proc, what="the first checkpoint")
    rc, _, err, dt = _signal_and_time(proc)
    print(f"SIGTERM to exit between steps (supervised): {dt:.2f} s")
    assert rc == 3, (rc, err[-3000:])
    st = state(run, "pretrain")
    assert st["status"] == "interrupted" and st["checkpoint"] == st["step"], st
    assert _errors(err) == [
        f"error: pretrain: stopped by SIGTERM at step {st['step']}; checkpoint saved, continue "
        "with `pdctl resume`"
    ], err[-3000:]


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_the_stage_process_ends_once_its_command_is_over(warmed: Path, tmp_path: Path) -> None:
    """The supervised child of a stage command ends as soon as its state and last line are
    written (os._exit), not when the interpreter's exit is done: a non-daemon thread planted
    in it (a `sitecustomize` that only the child, with PDCTL_SUPERVISED set, acts on) sleeps
    SLOW_CALL_S and would hold a normal exit that long. A v5e run's process once outlived its
    last line by 150 s (docs/performance.md, "The seventh chip session")."""
    run = _copy(warmed, tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, threading, time\n"
        "if os.environ.get('PDCTL_SUPERVISED'):\n"
        f"    threading.Thread(target=time.sleep, args=({SLOW_CALL_S},), daemon=False).start()\n"
    )
    env = pdctl_env(1)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    proc = subprocess.run(
        pdctl_argv("train", project=run), env=env, capture_output=True, text=True, timeout=240
    )
    dt = time.monotonic() - t0
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "train: done at step 10" in proc.stdout, proc.stdout
    assert state(run, "train")["status"] == "done"
    assert dt < SLOW_CALL_S, f"{dt:.1f} s: the child waited for its thread"


# ---- items 4 and 7: two processes ------------------------------------------------------------

DIST = {
    "pretrain": {"steps": 10**7, "batch_size": 64, "log_every": 50},
    "checkpoint": {"every": 100, "keep": 2},
    "distributed": {"heartbeat_timeout_s": 10, "init_timeout_s": 60},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two(run: Path, *args: str) -> list[subprocess.Popen]:
    port = _free_port()
    return [
        subprocess.Popen(
            pdctl_argv(
                *("--coordinator", f"127.0.0.1:{port}", "--num-processes", 2),
                *("--process-id", pid, *args),
                project=run,
            ),
            env=pdctl_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]


@pytest.fixture(scope="module")
def dist_initialized(tmp_path_factory) -> Path:
    return _base(tmp_path_factory, "dist", "tms", [["init-weights"]], **DIST)


def _two_training(dist_initialized: Path, tmp_path: Path) -> tuple[Path, list]:
    run = _copy(dist_initialized, tmp_path)
    procs = _two(run, "pretrain")
    metrics = run / "metrics" / "pretrain.jsonl"

    def started() -> bool:
        return metrics.exists() and bool(metrics.read_text().strip())

    for p in procs:
        _wait_for(started, p, what="the first logged step")
    return run, procs


def _two_held(run: Path, hook: str, tmp_path: Path, what: str) -> list[subprocess.Popen]:
    """`pdctl pretrain` as two processes of one run (2 devices each, unsupervised: the hook
    runs in the stage process), returned once both have touched their MARK (`what`)."""
    port = _free_port()
    marks = [tmp_path / f"held{i}" for i in (0, 1)]
    procs = [
        _start(
            run,
            hook,
            *("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"),
            *("--process-id", str(i), "pretrain"),
            mark=marks[i],
            devices=2,
        )
        for i in (0, 1)
    ]
    for p, m in zip(procs, marks, strict=True):
        _wait_for(m.exists, p, what=what)
    return procs


def _finish(procs: list, timeout: float = 120) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process did not exit")
        out.append((p.returncode, err))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("signalled", [(0, 1), (1,)], ids=["both", "one"])
def test_4_sigterm_stops_a_two_process_run_with_a_checkpoint(
    dist_initialized: Path, tmp_path: Path, signalled: tuple[int, ...]
) -> None:
    run, procs = _two_training(dist_initialized, tmp_path)
    t0 = time.monotonic()
    for i in signalled:
        procs[i].send_signal(signal.SIGTERM)
    results = _finish(procs)
    dt = time.monotonic() - t0
    print(f"2 processes, SIGTERM to {signalled}: both exited {dt:.2f} s later")
    for rc, err in results:
        assert rc == 3, (rc, err[-3000:])
    st = state(run, "pretrain")
    assert st["status"] == "interrupted" and st["checkpoint"] == st["step"], st
    assert st["step"] in _ckpts(run, "pretrain")
    line = _errors(results[0][1])
    assert line == [
        f"error: pretrain: stopped by SIGTERM at step {st['step']}; checkpoint saved, continue "
        "with `pdctl resume`"
    ], results[0][1][-3000:]


# The sync point JAX's preemption service agrees on is one past the last value any process
# passed to `reached_preemption_sync_point`, and orbax's CheckpointManager.save passes the step
# it saves. A notice that came while a checkpoint was written used to fix a sync point the loop
# (counting its own calls, one ahead of the step) had already passed: both processes trained on
# past the SIGTERM, then deadlocked in a collective (CI, 2026-12-02; 4 of 13 tries here). The
# hook holds every process just after its first periodic save returns, and the signal comes
# then: deterministic on the old code.
_AFTER_SAVE = (
    "from pdctl.engine import checkpoint as _ck\n"
    "_save = _ck.Checkpointer.save\n"
    "def _held(self, step, *a, **k):\n"
    "    _save(self, step, *a, **k)\n"
    "    if step > 0 and not os.path.exists(MARK):\n"
    "        open(MARK, 'w').close()\n"
    "        time.sleep(3)\n"
    "_ck.Checkpointer.save = _held\n"
)


@pytest.mark.slow
def test_4_sigterm_during_a_checkpoint_of_a_two_process_run(
    dist_initialized: Path, tmp_path: Path
) -> None:
    run = _copy(dist_initialized, tmp_path)
    procs = _two_held(run, _AFTER_SAVE, tmp_path, "the first periodic checkpoint")
    procs[1].send_signal(signal.SIGTERM)
    results = _finish(procs, timeout=60)
    for rc, err in results:
        assert rc == 3, (rc, err[-3000:])
    st = state(run, "pretrain")
    assert st["status"] == "interrupted" and st["checkpoint"] == st["step"], st
    # the first periodic save is at step 100; the agreed stop is the step after it
    assert st["step"] == DIST["checkpoint"]["every"] + 1, st


@pytest.mark.slow
def test_4_sigterm_to_one_process_while_both_compile(dist_initialized: Path, tmp_path: Path):
    """Before the first step the loop is not there to agree on a step: the other process
    hears of the signal from the coordination service's preemption notice while it waits on
    its compile, and both leave it within the grace, `interrupted` with no checkpoint. Both
    end with os._exit (the compile is left running); before `runtime.leave_together` process
    0, which hosts the coordination service, could leave first and JAX's agent in process 1
    then aborted it (SIGABRT) before its stop line: 4 of 53 runs here, 0 of 50 after."""
    run = _copy(dist_initialized, tmp_path)
    hook = "import jax; slow(jax.stages.Lowered, 'compile')"
    procs = _two_held(run, hook, tmp_path, "the step's compile")
    t0 = time.monotonic()
    procs[1].send_signal(signal.SIGTERM)
    results = _finish(procs, timeout=60)
    dt = time.monotonic() - t0
    print(f"2 processes compiling, SIGTERM to one: both exited {dt:.2f} s later")
    want = (
        "error: pretrain: stopped by SIGTERM while compiling the step (left unfinished); no "
        "checkpoint of this run was saved; `pdctl resume` starts it over"
    )
    for rc, err in results:
        assert rc == 3 and _errors(err) == [want], (rc, err[-3000:])
    assert dt < LATENCY_S + 5, dt  # the grace, the notice's 0.25 s polling, two exits
    st = state(run, "pretrain")
    assert st["status"] == "interrupted" and st.get("checkpoint") is None, st


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0], ids=["process-1", "process-0"])
def test_7_two_processes_one_killed_the_other_ends_failed(
    dist_initialized: Path, tmp_path: Path, killed: int
) -> None:
    """`kill -9` of one process's pdctl in a 2-process run. The survivor
    says within seconds, in one line, that the other process is gone, and ends (exit 1); it
    used to wait in a barrier until JAX's heartbeat timeout (100 s here, as by default) and
    then die by SIGABRT. Process 1 killed: process 0 records `failed` with `lost_process` at
    its last complete checkpoint, leaving no partial save. Process 0 killed: the survivor
    cannot write the state (only process 0 does), and the stage is left `running` with its
    lock free, i.e. crashed. Either way a 1-process `pdctl resume` continues the stage."""
    run = _copy(dist_initialized, tmp_path)
    steps = 3000  # far more than the steps run between the first checkpoint and the kill
    edit_config(run, {"pretrain": {"steps": steps}, "distributed": {"heartbeat_timeout_s": 100}})
    procs = _two(run, "pretrain")
    _wait_for(lambda: _recorded_checkpoint(run), procs[0], what="the first checkpoint")
    t0 = time.monotonic()
    procs[killed].send_signal(signal.SIGKILL)
    [(rc, err)] = _finish([procs[1 - killed]], timeout=60)
    dt = time.monotonic() - t0
    procs[killed].communicate(timeout=30)
    print(f"2 processes, kill -9 of process {killed}: the other exited {dt:.2f} s later")
    assert rc == 1, (rc, err[-3000:])
    assert dt < 20, dt  # seen within a second; the rest is slack for a loaded machine
    lines = _errors(err)
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err[-3000:]
    st = state(run, "pretrain")
    ckpts = _ckpts(run, "pretrain")
    # Said by the survivor itself, or, when XLA or gloo aborted it first (gloo can, on a
    # peer's death; JAX's agent does when process 0's coordination service vanishes), by its
    # pdctl, from the copy of its connection to the other process: "..., and this process
    # then died by SIGABRT; ...". One line either way, naming the lost process.
    assert lines[0].startswith(
        f"error: pretrain: process {killed} of 2 is gone (killed, or crashed: see its output)"
    ), lines
    if killed == 1:
        assert (
            f"the last checkpoint is step {st['checkpoint']}; continue with `pdctl resume` "
            "(with any number of processes)"
        ) in lines[0], lines
        assert st["status"] == "failed" and st["lost_process"] == 1, st
        assert st["checkpoint"] == ckpts[-1], (st, ckpts)
        left = sorted(p.name for p in (run / "checkpoints" / "pretrain").iterdir())
        assert left == sorted(str(c) for c in ckpts), left  # no unfinished save
    else:
        assert st["status"] == "running", st
        report = json.loads(_ok("--project", run, "status", "--json").stdout)["pretrain"]
        assert report["crashed"] is True, report
    result = _ok("--project", run, "resume")  # this process: one process, 4 devices
    assert f"pretrain: done at step {steps}" in result.stdout, result.stdout
    after = state(run, "pretrain")
    assert after["run_id"] == st["run_id"] and "lost_process" not in after, after


def test_7_a_stage_whose_run_lost_a_process_is_resumable(initialized: Path, tmp_path: Path):
    """What process 0 records when its run lost a process (`failed` with `lost_process`) is
    continued by `pdctl resume` and `pdctl run`; a `failed` stage without it is not (its
    cause was the stage's own). A fresh start clears it."""
    from pdctl.project import Project
    from pdctl.stages import pipeline
    from pdctl.stages.policy import how_to_finish, resumable

    run = _copy(initialized, tmp_path)
    proj = Project.load(run / "pdctl.toml")
    fields = {"fingerprint": proj.fingerprint("pretrain"), "run_id": "r1", "step": 7}
    proj.update_stage("pretrain", status="failed", lost_process=1, **fields)
    proj = Project.load(run / "pdctl.toml")
    assert resumable(proj, "pretrain")
    assert ("pretrain", "resume") in pipeline.plan(proj)
    assert "a process of its run was lost" in how_to_finish(proj, "pretrain")
    proj.update_stage("pretrain", lost_process=None)
    assert not resumable(Project.load(run / "pdctl.toml"), "pretrain")
