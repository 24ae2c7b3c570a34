"""`pdctl run` is one process that fits what each stage fits (issue 49): after a stage nothing
of it stays on the devices (its state, the arrays its result carries, its compiled programs),
and a stage with nothing to do compiles no step program."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import cli_ok, make_run, pdctl_env, state

from pdctl.engine.loop import Loop
from pdctl.stages import pipeline

SHORT = {"train": {"steps": 4, "batch_size": 64, "log_every": 2, "eval_every": 4}}


def _live() -> tuple[int, int]:
    arrays = [x for x in jax.live_arrays() if not x.is_deleted()]
    return len(arrays), sum(x.nbytes for x in arrays)


@pytest.mark.slow  # ~16 s: a whole `pdctl run` in process
def test_pdctl_run_leaves_nothing_of_a_stage_on_the_devices(tmp_path: Path, monkeypatch) -> None:
    """The live device buffers as each stage of `pdctl run` starts, and after the run, are
    what they were before the first stage: init-weights' arrays and warmup's final state
    (components and AdamW moments) are not held while train runs. Without the release, the
    train stage starts with init-weights' items and warmup's state still alive."""
    run = make_run(tmp_path, "tms", warmup={"steps": 2, "log_every": 2}, **SHORT)
    at_start: dict[str, tuple[int, int]] = {}
    original = pipeline.run_stage

    def spy(project, stage, **kwargs):
        at_start[stage] = _live()
        return original(project, stage, **kwargs)

    monkeypatch.setattr(pipeline, "run_stage", spy)
    jax.clear_caches()
    # an earlier test's arrays left in reference cycles (this worker's process ran other test
    # files first) would be freed by the stages' own collection and read as a difference
    gc.collect()
    before = _live()
    cli_ok("--project", run, "run")
    after = _live()
    assert list(at_start) == ["init_weights", "pretrain", "warmup", "train"]
    assert state(run, "train")["status"] == "done"
    for stage, live in at_start.items():
        assert live == before, (stage, live, before)
    assert after == before, (after, before)


@pytest.mark.slow  # ~9 s: three stages in process
def test_a_stage_with_no_steps_compiles_no_step(tmp_path: Path, monkeypatch) -> None:
    """warmup at `steps = 0` (the aligned init's templates) is done without compiling its step
    (52.7 s and 6.4 GiB for every MLP of SmolLM2 on a v5e), and saves nothing: train builds
    its components from init-weights' (tests/stages/test_warmup_idle.py)."""
    run = make_run(tmp_path, "tms", warmup={"steps": 0}, **SHORT)
    compiled: list[str] = []
    original = Loop.compile

    def spy(self, *args, **kwargs):
        compiled.append(self.stage)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Loop, "compile", spy)
    cli_ok("--project", run, "run")
    assert compiled == ["pretrain", "train"], compiled
    warm = state(run, "warmup")
    assert warm["status"] == "done" and warm["step"] == 0 and "checkpoint" not in warm, warm
    assert warm.get("components_from") == "init_weights", warm
    assert not (run / "checkpoints" / "warmup").exists()
    assert state(run, "train")["status"] == "done"


@pytest.mark.slow  # ~22 s: a whole `pdctl run` in process
def test_pdctl_run_compiles_the_later_steps_ahead(tmp_path: Path, monkeypatch) -> None:
    """`[compile] ahead = true`: while init-weights runs, a host thread compiles pretrain's,
    warmup's and train's steps into the compile cache (a fresh one), so each of those stages
    finds its step there: its own compile of it (on its thread, while it restores) writes no
    new step entry. Without `pdctl run`'s thread, each would compile and write one."""
    from pdctl.stages import runner

    cache = tmp_path / "cc"
    written: dict[str, list[str]] = {}
    original = runner._compile_step

    def steps() -> set[str]:
        return {p.name for p in cache.glob("jit_step-*")}

    def spy(prog):  # runs after `pdctl run`'s compile of the same stage's step (its queue)
        before = steps()
        original(prog)
        written[prog.stage] = sorted(steps() - before)

    monkeypatch.setattr(runner, "_compile_step", spy)
    run = make_run(
        tmp_path, "tms", warmup={"steps": 2, "log_every": 2},
        compile={"cache_dir": str(cache), "ahead": True}, **SHORT,
    )  # fmt: skip
    cli_ok("--project", run, "run")
    assert state(run, "train")["status"] == "done"
    assert written == {"pretrain": [], "warmup": [], "train": []}, written
    assert len(steps()) == 3, steps()  # one entry each, written by `pdctl run`'s thread


_COUNT_EVAL = """
import json, sys
from pdctl.engine.loop import cache_events
from pdctl.stages import train
original, OUT = train.make_eval, sys.argv[2]
def spy(*args, **kwargs):
    fn = original(*args, **kwargs)
    def counted(state):
        with cache_events() as counts:
            out = fn(state)
        with open(OUT, "a") as f:
            f.write(json.dumps(counts) + "\\n")
        return out
    return counted
train.make_eval = spy
from pdctl.cli import main
sys.argv = ["pdctl", "--project", sys.argv[1], *sys.argv[3:]]
main()
"""


@pytest.mark.slow  # three runs of a tiny LM in processes of their own (one device)
def test_the_evaluation_is_compiled_ahead(tmp_path: Path) -> None:
    """With `[compile] ahead = true`, train's evaluation programs (the CI program and an LM's
    masked forwards) are compiled on the host thread while train's steps run (in `pdctl run`
    and in `pdctl train` alone, as a resume runs it), so the first evaluation compiles neither.
    A fresh cache each. One device: several CPU devices evaluate replicated, which nothing
    compiles ahead."""
    seen = {}
    for name, ahead, command in (("off", False, "run"), ("run", True, "run"),
                                 ("train", True, "train")):  # fmt: skip
        run = make_run(
            tmp_path, "llama-mlp", name,
            compile={"cache_dir": str(tmp_path / f"cc-{name}"), "ahead": ahead},
            train={"steps": 2, "batch_size": 8, "log_every": 1, "eval_every": 2},
        )  # fmt: skip
        if command == "train":
            for stage in ("init-weights", "pretrain", "warmup"):
                cli_ok("--project", run, stage)
        counts = tmp_path / f"counts-{name}.jsonl"
        done = subprocess.run(
            [sys.executable, "-c", _COUNT_EVAL, str(run), str(counts), command],
            env=pdctl_env(1, PDCTL_SUPERVISOR="0"), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        seen[name] = [json.loads(line) for line in counts.read_text().splitlines()]
    assert all(len(v) == 1 for v in seen.values()), seen
    off, run_, train_ = (seen[k][0] for k in ("off", "run", "train"))
    assert off.get("hits", 0) == 0, seen  # without: every program compiled at the evaluation
    # with: the CI and masked-forwards programs are neither compiled nor looked up there (the
    # stage's thread had them in process)
    for counts in (run_, train_):
        assert counts.get("hits", 0) == 0 and counts["misses"] <= off["misses"] - 2, seen


@pytest.mark.slow  # eight stage commands in process, ~18 s: the slow tier
def test_a_stage_alone_compiles_its_step_while_it_restores(tmp_path: Path, monkeypatch) -> None:
    """`pdctl train` alone (as a resume runs it) with `[compile] ahead = true`: the step compiles
    on a host thread while the stage restores its inputs, and the loop's compile finds it in
    process: no compile-cache lookup at all (a fresh cache: without the thread, a miss)."""
    from pdctl.engine.loop import cache_events

    events: dict[str, dict[str, int]] = {}
    original = Loop.compile

    def spy(self, *args, **kwargs):
        if self.compiled_ahead is not None:  # the thread's own compile: before counting
            self.compiled_ahead.wait()
        with cache_events() as counts:
            out = original(self, *args, **kwargs)
        events[self.stage] = dict(counts)
        return out

    monkeypatch.setattr(Loop, "compile", spy)
    for ahead in (False, True):
        run = make_run(
            tmp_path, "tms", f"tms-{ahead}", warmup={"steps": 2, "log_every": 2},
            compile={"cache_dir": str(tmp_path / f"cc-{ahead}"), "ahead": ahead}, **SHORT,
        )  # fmt: skip
        for stage in ("init-weights", "pretrain", "warmup", "train"):
            cli_ok("--project", run, stage)
        assert state(run, "train")["status"] == "done"
        assert events["train"].get("misses", 0) == (0 if ahead else 1), (ahead, events)
        assert events["train"].get("hits", 0) == 0, (ahead, events)


@pytest.mark.slow  # two pipelines' worth of stages in process, ~11 s: the slow tier
def test_the_first_stage_compiles_its_own_step_first(tmp_path: Path, monkeypatch) -> None:
    """`pdctl run` with init-weights done: pretrain runs first, and its own step compiles before
    the later stages' steps that `pdctl run` queued (held back until pretrain queued its own: a
    compile already started would hold pretrain up for a later stage)."""
    from pdctl.stages import runner

    order: list[str] = []
    mine, theirs = runner._compile_step, pipeline._compile_step

    def spy_mine(prog):
        order.append(f"{prog.stage} (its own)")
        return mine(prog)

    def spy_theirs(project, spec):
        order.append(f"{spec.name} (pdctl run)")
        return theirs(project, spec)

    monkeypatch.setattr(runner, "_compile_step", spy_mine)
    monkeypatch.setattr(pipeline, "_compile_step", spy_theirs)
    run = make_run(
        tmp_path, "tms", warmup={"steps": 2, "log_every": 2},
        compile={"cache_dir": str(tmp_path / "cc"), "ahead": True}, **SHORT,
    )  # fmt: skip
    cli_ok("--project", run, "init-weights")
    cli_ok("--project", run, "run")
    assert order[:3] == ["pretrain (its own)", "warmup (pdctl run)", "train (pdctl run)"], order
