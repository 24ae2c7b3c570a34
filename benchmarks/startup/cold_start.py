"""Cold start: time from process start to the first completed train step, with an empty versus
a warm persistent compilation cache (`[compile] cache_dir`).

Sets up a run from a template (init-weights, pretrain and warmup with a few steps), then runs
`pdctl train --fresh --until 1` in fresh processes: "cold" with the cache directory emptied
first, "warm" right after (the cache now holds every jit of the train process). Per run it
records the wall time to the first step (the step-1 metrics line appears in
metrics/train.jsonl: the step ran and its metrics reached the host), the process wall time
(that plus the step-1 checkpoint and exit) and `compile_s.step` from pdctl.toml.

    python -m benchmarks.startup.cold_start [--template llama-mlp|tms|resid-mlp] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from benchmarks._harness import machine_line

SMALL = {  # few steps everywhere; sizes are the template's
    "pretrain": {"steps": 2, "log_every": 1},
    "warmup": {"steps": 2, "log_every": 1},
    "train": {"steps": 4, "log_every": 1, "eval_every": 1000},
    "checkpoint": {"every": 1000},
}


def set_keys(text: str, table: str, values: dict) -> str:
    """Set keys of `[table]` (written under its header, the old lines dropped), or append it."""
    body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
    out, cur, found = [], None, False
    for line in text.splitlines(keepends=True):
        m = re.match(r"\s*\[([^\[\]]+)\]", line)
        if m:
            cur = m.group(1).strip()
            out.append(line)
            if cur == table:
                found = True
                out.append(body)
            continue
        k = re.match(r"\s*(\w+)\s*=", line)
        if not (cur == table and k and k.group(1) in values):
            out.append(line)
    return "".join(out) + ("" if found else f"\n[{table}]\n{body}")


def pdctl(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdctl", "--project", str(run), *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )


def timed_train(run: Path) -> dict[str, float]:
    metrics = run / "metrics" / "train.jsonl"
    t0_wall = time.time()
    t0 = time.perf_counter()
    out = pdctl(run, "train", "--fresh", "--until", "1")
    total = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"pdctl train failed ({out.returncode}):\n{out.stderr[-3000:]}")
    state = tomllib.loads((run / "pdctl.toml").read_text())["state"]["train"]
    return {
        "first_step_s": metrics.stat().st_mtime - t0_wall,
        "process_s": total,
        "compile_step_s": float(state["compile_s"]["step"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", default="llama-mlp")
    ap.add_argument("--repeats", type=int, default=2, help="cold/warm pairs (medians reported)")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    args = ap.parse_args()
    print(machine_line())
    work = args.workdir or Path(tempfile.mkdtemp(prefix="pdctl-cold-start-"))
    work.mkdir(parents=True, exist_ok=True)
    run, cache = work / "run", work / "cache"
    shutil.rmtree(run, ignore_errors=True)
    from pdctl.templates import create_run

    create_run(run.name, args.template, work)
    p = run / "pdctl.toml"
    text = p.read_text()
    for table, values in {**SMALL, "compile": {"cache_dir": str(cache)}}.items():
        text = set_keys(text, table, values)
    p.write_text(text)
    t0 = time.perf_counter()
    for stage in ("init-weights", "pretrain", "warmup"):
        out = pdctl(run, stage)
        if out.returncode != 0:
            raise SystemExit(f"pdctl {stage} failed:\n{out.stderr[-3000:]}")
    print(
        f"{args.template}: setup (init-weights, pretrain, warmup) {time.perf_counter() - t0:.1f} s"
    )

    rows: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    print(f"{'run':<8}{'first step s':>13}{'process s':>11}{'compile_s.step':>16}")
    for i in range(args.repeats):
        for kind in ("cold", "warm"):
            if kind == "cold":
                shutil.rmtree(cache, ignore_errors=True)
            r = timed_train(run)
            rows[kind].append(r)
            print(
                f"{kind} {i + 1:<3}{r['first_step_s']:13.2f}{r['process_s']:11.2f}"
                f"{r['compile_step_s']:16.3f}"
            )
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
    print(
        f"median   cold {med['cold']['first_step_s']:.2f} s, warm "
        f"{med['warm']['first_step_s']:.2f} s to the first step: "
        f"{med['cold']['first_step_s'] / med['warm']['first_step_s']:.2f}x faster warm "
        f"(step compile {med['cold']['compile_step_s']:.2f} s -> "
        f"{med['warm']['compile_step_s']:.3f} s, "
        f"{med['cold']['compile_step_s'] / med['warm']['compile_step_s']:.1f}x)"
    )
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
