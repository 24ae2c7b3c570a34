"""kill -9 chaos: SIGKILL `pdctl train` at random moments, resume, repeat; the run still ends
bit-identical to an uninterrupted one.

The SUB train table of test_resume.py (100 steps, a checkpoint every 5, metrics every step) on
1 device, from the session's shared TMS base. Checkpoints are written asynchronously and a
save of this tiny state costs far more than a step, so most of a run's wall time is spent with
a save in flight and random kills land inside saves; the test counts how many left an
unfinished save behind.

What comes next after a kill is decided from the state, as a user would: `[state.train]` names
a checkpoint → `pdctl resume`; it names none (killed before the first checkpoint was recorded)
→ `pdctl train --fresh` (a checkpoint may exist on disk, unrecorded; starting over is still
correct, and exercises the fresh start over a killed run).
"""

from __future__ import annotations

import random
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from helpers import pdctl_argv, pdctl_env
from test_resume import (
    SUB,
    SUB_STEPS,
    assert_trees_equal,
    checkpoint_arrays,
    exported,
    metric_lines,
    sub_run,
    tms_base,
    tms_reference,
)

from pdctl.project import Project

SEED = 20261130
# Each kill costs a process start (imports, restore, a cache-hit compile): 6 kills, 12 before.
# Still kills in start-up, mid-save and after checkpoints, resumes and fresh starts, and at
# least one kill with a save in flight is asserted below; the seed picks the same moments.
MIN_KILLS = 6
EVERY = SUB["checkpoint"]["every"]


def _train_state(run: Path) -> dict[str, Any]:
    """[state.train] after a kill: pdctl.toml must still parse, and as a valid project."""
    text = (run / "pdctl.toml").read_text(encoding="utf-8")
    raw = tomllib.loads(text)
    Project.load(run / "pdctl.toml")
    return raw.get("state", {}).get("train", {})


def _finished_steps(ckpt_dir: Path) -> list[int]:
    """Complete checkpoints, by directory name (orbax writes `<step>.orbax-checkpoint-tmp*`
    and renames it to `<step>` when the save is complete). Listing only: creating a
    CheckpointManager here would clean up what a kill left behind."""
    if not ckpt_dir.exists():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())


def _unfinished_saves(ckpt_dir: Path) -> list[str]:
    if not ckpt_dir.exists():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if "tmp" in p.name)


def _wait(proc: subprocess.Popen, cond, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while proc.poll() is None and not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out")
        time.sleep(0.002)


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_ends_bit_exact(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    reference = tms_reference(tmp_path_factory)
    run = sub_run(tms_base(tmp_path_factory), tmp_path / "run", tmp_path_factory)
    ckpt_dir = run / "checkpoints" / "train"
    rng = random.Random(SEED)
    kills = resumes = fresh_starts = during_save = 0
    log: list[str] = []
    t0 = time.monotonic()

    for cycle in range(4 * MIN_KILLS):
        st = _train_state(run)
        if st.get("status") == "done":
            break
        if st.get("checkpoint") is not None:
            args, resumes = ["resume"], resumes + 1
        else:
            args, fresh_starts = ["train", "--fresh"], fresh_starts + 1
        start = max(_finished_steps(ckpt_dir), default=0)
        stderr = open(tmp_path / f"stderr-{cycle}.txt", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            pdctl_argv(*args, project=run),
            env=pdctl_env(1),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        how = "to the end"
        try:
            if kills < MIN_KILLS:

                def saving(start=start) -> bool:
                    """This process has started a save (or finished one)."""
                    return max(_finished_steps(ckpt_dir), default=0) > start or any(
                        int(n.split(".")[0]) > start for n in _unfinished_saves(ckpt_dir)
                    )

                if rng.random() < 0.2:
                    # Anywhere in start-up (imports, restore, compile) and the first steps;
                    # at the latest when its first save starts, so that it never gets away.
                    delay = rng.uniform(0.5, 5.0)
                    how = f"{delay:.2f} s after start"
                    t_spawn = time.monotonic()
                    _wait(proc, lambda d=delay, t=t_spawn: time.monotonic() - t > d or saving())
                else:
                    # 0-300 ms after this process completed its k-th checkpoint (k = 0: after
                    # its first save started); k leaves enough saves for the kills to come.
                    saves_ahead = (SUB_STEPS - start) // EVERY
                    k = rng.randint(0, min(3, max(0, (saves_ahead - 1) // (MIN_KILLS - kills))))
                    delay = rng.uniform(0.0, 0.3)
                    if k == 0:
                        how = f"{delay * 1e3:.0f} ms after its first save started"
                        _wait(proc, saving)
                    else:
                        target = start + k * EVERY
                        how = f"{delay * 1e3:.0f} ms after checkpoint {target}"
                        _wait(proc, lambda t=target: max(_finished_steps(ckpt_dir), default=0) >= t)
                    time.sleep(delay)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    kills += 1
                    unfinished = _unfinished_saves(ckpt_dir)
                    during_save += bool(unfinished)
                    how = f"KILLED {how}" + (f", mid-save {unfinished}" if unfinished else "")
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            stderr.close()
        assert rc in (0, -9), (args, rc, (tmp_path / f"stderr-{cycle}.txt").read_text()[-3000:])

        # After every kill: pdctl.toml parses, and the checkpoint it names is complete on disk.
        st = _train_state(run)
        ckpt = st.get("checkpoint")
        if ckpt is not None:
            assert ckpt in _finished_steps(ckpt_dir), (
                ckpt,
                sorted(p.name for p in ckpt_dir.iterdir()),
            )
            assert (ckpt_dir / str(ckpt) / "_CHECKPOINT_METADATA").is_file()
        log.append(
            f"{cycle:2d} {' '.join(args):13s} (disk at {start:3d}): {how}; "
            f"state {st.get('status')} step {st.get('step')} checkpoint {ckpt}"
        )
    elapsed = time.monotonic() - t0
    summary = (
        f"kill -9 chaos: {kills} kills ({during_save} with a save in flight), {resumes} resumes, "
        f"{fresh_starts} fresh starts, {len(log)} processes, {elapsed:.1f} s"
    )
    print("\n".join([*log, summary]))

    assert _train_state(run)["status"] == "done", "\n".join(log)
    assert kills >= MIN_KILLS, summary
    assert during_save >= 1, summary
    _, final = checkpoint_arrays(run, "train")
    assert final["loop.step"] == SUB_STEPS
    assert_trees_equal(checkpoint_arrays(reference, "train")[1], final)
    assert_trees_equal(exported(reference, tmp_path / "a.npz"), exported(run, tmp_path / "b.npz"))
    # The metrics history survived every kill: each step once, as the straight run logged it.
    assert metric_lines(run, "train") == metric_lines(reference, "train")
