"""Several processes: `jax.distributed` on localhost, 2 processes x 2 simulated CPU devices each,
gloo collectives, against a single process with 4 devices.

- the 2-process `pdctl train` ends with the single-process run's losses;
- a checkpoint written by the 2-process run resumes in one process;
- killing one process makes the other exit with an error within a bounded time.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, make_run, pdctl_argv, pdctl_env, pdctl_process

pytestmark = pytest.mark.slow

SMALL = {
    "pretrain": {"steps": 10, "batch_size": 64, "log_every": 5},
    "warmup": {"steps": 5, "log_every": 5},
    "train": {"steps": 20, "batch_size": 64, "log_every": 5, "eval_every": 20},
    "checkpoint": {"every": 10, "keep": 2},
    "decomp": {"ci_fn": {"hidden": [4]}},
    "distributed": {"heartbeat_timeout_s": 10, "init_timeout_s": 60},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(run: Path, *args: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for pid in (0, 1):
        cmd = pdctl_argv(
            *("--coordinator", f"127.0.0.1:{port}", "--num-processes", 2, "--process-id", pid),
            *args,
            project=run,
        )
        procs.append(
            subprocess.Popen(
                cmd, env=pdctl_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


def _losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics" / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """init-weights → pretrain → warmup, once, in this (4-device) process."""
    root = tmp_path_factory.mktemp("dist")
    run = make_run(root, "tms", "base", tiny=False, **SMALL)
    for stage in ("init-weights", "pretrain", "warmup"):
        assert cli("--project", str(run), stage).exit_code == 0
    return run


def test_two_processes_match_one_and_resume_in_one(prepared: Path, tmp_path: Path):
    single = tmp_path / "single"
    shutil.copytree(prepared, single)
    r = pdctl_process("train", project=single, devices=4, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr

    multi = tmp_path / "multi"
    shutil.copytree(prepared, multi)
    procs = _spawn(multi, "train")
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    a, b = _losses(single), _losses(multi)
    assert sorted(a) == sorted(b) == [5, 10, 15, 20]
    # Same global batch on the same 4-device mesh; only the collectives' reduction order (gloo
    # across processes vs in-process) can differ: float32 rounding.
    np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)], rtol=1e-5)

    # A checkpoint written by the 2-process run (stopped at step 10) resumes in one process.
    half = tmp_path / "half"
    shutil.copytree(prepared, half)
    procs = _spawn(half, "train", "--until", "10")
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert (half / "checkpoints" / "train" / "10").is_dir()
    r = pdctl_process("resume", project=half, devices=4, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    c = _losses(half)
    np.testing.assert_allclose([c[s] for s in sorted(c)], [a[s] for s in sorted(a)], rtol=1e-5)


def test_killing_one_process_stops_the_other(prepared: Path, tmp_path: Path):
    run = tmp_path / "kill"
    shutil.copytree(prepared, run)
    from helpers import edit_config

    edit_config(run, {"train": {"steps": 100000, "log_every": 50, "eval_every": 100000}})
    procs = _spawn(run, "train")
    metrics = run / "metrics" / "train.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, "train never started"
        assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        out = procs[0].communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("process 0 hung after process 1 died")
    waited = time.monotonic() - t0
    assert procs[0].returncode != 0
    assert waited < 120
    print(f"process 0 exited {procs[0].returncode} {waited:.1f} s after process 1 was killed")
    print(out[-2000:])
