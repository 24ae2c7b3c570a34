"""Time from starting `pdctl run` to the train stage's first step, on this machine's CPU, for
the `tms` template as shipped: two checkouts of pdctl compared in one run, interleaved.

Absolute times on a shared machine are noise; the ratio after / before is the figure. Each side
runs in fresh child processes that import that side's pdctl (PYTHONPATH and `sys.path` start
with the checkout; the working directory is a temporary one), with the same environment:
JAX_PLATFORMS=cpu, one fresh XDG_STATE_HOME per benchmark run (the compile cache's key lives
there), no $PDCTL_COMPILE_CACHE. The run is `pdctl new RUN --template tms` with only `[train]
log_every = 1` changed, so both sides mark the first train step the same way: its metrics line
in RUN/metrics/train.jsonl (polled every 0.05 s, timed from the process start). Then the
process gets SIGTERM (a stop: exit 3) and is waited for. Two cases per side and repeat:

- cold: `pdctl run` in a fresh run directory (init-weights, pretrain, warmup, then train; the
  default compile cache RUN/cache/compile, where the side has one, starts empty);
- warm: `pdctl train --fresh` in the same run directory right after (`pdctl run` would resume
  the stopped train, or refuse; the earlier stages are done, the compile cache is as the cold
  run left it).

Order per repeat: cold before, cold after, warm before, warm after. Also recorded: pdctl's
own `[state.train] first_step_s` where the side writes it (from the command's start), and the
CPU seconds (user + system, /proc) the command's processes had used when the first step was
seen: the work, which other jobs on a shared machine stretch much less than the wall time.
`--set KEY=VALUE` (repeatable; VALUE in TOML) changes the template on both sides, e.g.
`--set warmup.steps=0` for a warmup stage with nothing to do.

    git worktree add /tmp/pdctl-before 7902a53
    python -m benchmarks.startup.first_step --before /tmp/pdctl-before [--after .] [--repeats 2]
        [--set warmup.steps=0] [--json out.json]
    git worktree remove --force /tmp/pdctl-before
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

from benchmarks._harness import ROOT, child_env, git_commit, machine_line

RUN = "tms-run"
CASES = ("cold", "warm")
SIDES = ("before", "after")
# what must not leak from this shell into a side's process
UNSET = ("PDCTL_COMPILE_CACHE", "PDCTL_STARTED", "PDCTL_SUPERVISED", "PDCTL_SUPERVISOR")


def side_env(root: Path, state_home: Path) -> dict[str, str]:
    env = child_env(
        root, JAX_PLATFORMS="cpu", XDG_STATE_HOME=str(state_home), WANDB_MODE="disabled"
    )
    for k in UNSET:
        env.pop(k, None)
    return env


def pdctl_argv(root: Path, *args: str) -> list[str]:
    """`pdctl ARGS` on the pdctl of `root`, whatever else is on the path."""
    code = f"import sys; sys.path.insert(0, {str(root)!r}); from pdctl.cli import main; main()"
    return [sys.executable, "-c", code, *args]


def which_pdctl(root: Path, env: dict[str, str], cwd: Path) -> str:
    code = f"import sys; sys.path.insert(0, {str(root)!r}); import pdctl; print(pdctl.__file__)"
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True
    )
    return r.stdout.strip() or r.stderr.strip()


def new_run(
    root: Path, env: dict[str, str], parent: Path, sets: dict[str, object] | None = None
) -> Path:
    """A fresh `tms` run under `parent`, with `[train] log_every = 1` and the `sets`
    ({"warmup.steps": 0})."""
    parent.mkdir(parents=True)
    r = subprocess.run(
        pdctl_argv(root, "new", RUN, "--template", "tms"),
        env=env,
        cwd=parent,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        sys.exit(f"pdctl new failed ({root}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    run = parent / RUN
    path = run / "pdctl.toml"
    raw = tomllib.loads(path.read_text())
    raw["train"]["log_every"] = 1
    for key, value in (sets or {}).items():
        *tables, name = key.split(".")
        table = raw
        for t in tables:
            table = table.setdefault(t, {})
        table[name] = value
    path.write_text(tomli_w.dumps(raw))
    return run


def tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` and every process below it so far (from
    /proc; None where there is none): the work to the first step, which other jobs on a
    loaded machine stretch far less than the wall time."""
    import os

    try:
        tick = os.sysconf("SC_CLK_TCK")
        stats = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                stats[int(d.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    except (OSError, ValueError, IndexError):
        return None
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += [c for c, (ppid, _) in stats.items() if ppid == p and c not in tree]
    return sum(stats[p][1] for p in tree if p in stats) / tick if pid in stats else None


def has_line(path: Path) -> bool:
    try:
        return b"\n" in path.read_bytes()
    except FileNotFoundError:
        return False


def time_first_step(
    root: Path, env: dict[str, str], run: Path, args: list[str], log: Path, timeout: float
) -> dict:
    """Start `pdctl --project RUN ARGS`, wait for the train stage's first metrics line, stop it
    (SIGTERM) and wait for it."""
    metrics = run / "metrics" / "train.jsonl"
    metrics.unlink(missing_ok=True)  # a fresh train truncates it only once it starts
    with log.open("w") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(
            pdctl_argv(root, "--project", str(run), *args),
            env=env,
            cwd=run.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        first = cpu = None
        while p.poll() is None and time.perf_counter() - t0 < timeout:
            if has_line(metrics):
                first = time.perf_counter() - t0
                cpu = tree_cpu_s(p.pid)
                break
            time.sleep(0.05)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        wall = time.perf_counter() - t0
    if first is None:
        tail = log.read_text()[-3000:]
        sys.exit(f"no train step within {timeout:.0f} s (exit {rc}), {log}:\n{tail}")
    state = tomllib.loads((run / "pdctl.toml").read_text()).get("state", {})
    return {
        "first_step_s": first,
        "cpu_s": cpu,
        "pdctl_first_step_s": state.get("train", {}).get("first_step_s"),
        "rc": rc,
        "process_s": wall,
    }


def fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the older pdctl")
    ap.add_argument("--after", type=Path, default=ROOT, help="default: this checkout")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1200, help="s to the first step, per run")
    ap.add_argument("--json", type=Path, help="write the raw numbers here")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config key of the template, both sides (VALUE in TOML): warmup.steps=0",
    )  # fmt: skip
    a = ap.parse_args()
    sets = {}
    for item in a.set:
        key, _, value = item.partition("=")
        sets[key.strip()] = tomllib.loads(f"v = {value}")["v"]
    roots = {"before": a.before.resolve(), "after": a.after.resolve()}
    commits = {s: git_commit(r) or "?" for s, r in roots.items()}
    work = Path(tempfile.mkdtemp(prefix="pdctl-first-step-"))
    state_home = work / "state"
    state_home.mkdir()
    envs = {s: side_env(r, state_home) for s, r in roots.items()}
    print(machine_line())
    if sets:
        print(f"template tms with {sets}")
    for s in SIDES:
        where = which_pdctl(roots[s], envs[s], work)
        print(f"{s}: {roots[s]} at {commits[s]}, imports {where}", file=sys.stderr)
        if not where.startswith(str(roots[s])):
            sys.exit(f"{s}: the child imports pdctl from {where}, not from {roots[s]}")

    t_start = time.perf_counter()
    rows: list[dict] = []
    for i in range(a.repeats):
        runs = {s: new_run(roots[s], envs[s], work / f"{s}-{i}", sets) for s in SIDES}
        for case in CASES:
            args = ["run"] if case == "cold" else ["train", "--fresh"]
            for s in SIDES:
                log = work / f"{s}-{i}" / f"{case}.log"
                r = time_first_step(roots[s], envs[s], runs[s], args, log, a.timeout)
                row = {"side": s, "case": case, "repeat": i, **r}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    wall = time.perf_counter() - t_start

    def values(s: str, case: str, key: str = "first_step_s") -> list[float]:
        return [r[key] for r in rows if r["side"] == s and r["case"] == case and r[key] is not None]

    print()
    head = ["case", "side", "commit", "first train step s (runs)", "median s", "min s"]
    tail = ["pdctl's first_step_s", "CPU s to it (runs)", "median CPU s"]
    print("| " + " | ".join([*head, *tail]) + " |")
    print("|---" * (len(head) + len(tail)) + "|")
    summary: dict = {}
    for case in CASES:
        for s in SIDES:
            xs, own = values(s, case), values(s, case, "pdctl_first_step_s")
            cpu = values(s, case, "cpu_s")
            summary[f"{case}_{s}"] = {"median": statistics.median(xs), "min": min(xs)}
            if cpu:
                summary[f"{case}_{s}"]["cpu_median"] = statistics.median(cpu)
            print(
                f"| {case} | {s} | {commits[s]} | {fmt(xs)} | {statistics.median(xs):.2f} | "
                f"{min(xs):.2f} | {fmt(own) if own else '-'} | {fmt(cpu) if cpu else '-'} | "
                f"{f'{statistics.median(cpu):.2f}' if cpu else '-'} |"
            )
    print()
    for case in CASES:
        b, af = summary[f"{case}_before"], summary[f"{case}_after"]
        ratio = {k: af[k] / b[k] for k in ("median", "min", "cpu_median") if k in af and k in b}
        summary[f"{case}_ratio"] = ratio
        cpu = f", {ratio['cpu_median']:.2f} (CPU s medians)" if "cpu_median" in ratio else ""
        print(
            f"{case}: after / before = {ratio['median']:.2f} (medians), {ratio['min']:.2f} "
            f"(mins){cpu}"
        )
    odd = [r for r in rows if r["rc"] != 3]
    if odd:
        print("exit codes other than 3 (stopped): " + ", ".join(
            f"{r['case']} {r['side']} #{r['repeat']}: {r['rc']}" for r in odd
        ))  # fmt: skip
    print(f"benchmark wall time {wall:.0f} s ({a.repeats} repeats); logs in {work}")
    if a.json:
        out = {
            "machine": machine_line(),
            "sides": {s: {"root": str(roots[s]), "commit": commits[s]} for s in SIDES},
            "repeats": a.repeats,
            "set": sets,
            "wall_s": wall,
            "runs": rows,
            "summary": summary,
        }
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
