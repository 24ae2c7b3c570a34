"""A template against changed settings of it, through `pdctl run` as a user runs it: each arm
is a run directory made by `pdctl new --template T`, with the keys named changed, trained by
`pdctl run --until N` (its evaluation at step N: set `train.eval_every` to N in every arm),
then one table: ms a step and tokens/s (the median of the logged steps after the first log
line), the evaluation at the last step (L0 per site, alive, the KL and CE unrecovered of the
stochastic-, CI- and fresh-PGD-masked models) and each arm's speed against the first arm's.

    python -m benchmarks.lm.template_ab --template smollm2-all-mlps --root /tmp/ab --until 500 \
        --gguf PATH --text DIR \
        --arm A=train.eval_every=500 \
        --arm B=train.eval_every=500,train.ppgd.n_warmup_steps=0,train.grad_accum_steps=4 \
        [--deadline-s 570] [--compile-cache DIR]
    python -m benchmarks.lm.template_ab --root /tmp/ab --table          # the table only

An arm's value is TOML (`precision.compute_dtype="bfloat16"`). The arms run one after the other
in separate processes (one device); a run directory already there is continued (`pdctl run`
resumes an interrupted stage), so with `--deadline-s` (seconds from the start; the arm in flight
is stopped by SIGTERM, which checkpoints it) the comparison goes in segments across commands,
as on a borrowed TPU whose calls last 10 minutes. `--compile-cache`: one XLA cache for every
arm ($PDCTL_COMPILE_CACHE), so programs the arms share compile once. Long: a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from benchmarks._harness import machine_line

EVAL_KEYS = ("kl_stoch_masked", "kl_ci_masked", "kl_pgd", "ce_unrecovered_stoch_masked",
             "ce_unrecovered_ci_masked", "ce_unrecovered_pgd", "kl_unmasked")  # fmt: skip


def set_key(text: str, dotted: str, value: str) -> str:
    """`text` (a pdctl.toml) with `section.key = value` set in place (its comment kept), or
    inserted under `[section]` when the key is not there. ValueError where the text has no
    `[section]` table or the result is not TOML."""
    section, key = dotted.rsplit(".", 1)
    lines = text.split("\n")
    try:
        start = next(i for i, x in enumerate(lines) if x.strip() == f"[{section}]")
    except StopIteration:
        raise ValueError(f"no [{section}] table in the template") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    pattern = re.compile(rf'^{re.escape(key)}\s*=\s*("[^"]*"|[^#\s]+)(.*)$')
    for i in range(start + 1, end):
        m = pattern.match(lines[i])
        if m:
            lines[i] = f"{key} = {value}{m.group(2)}"
            break
    else:
        lines.insert(start + 1, f"{key} = {value}")
    out = "\n".join(lines)
    try:
        tomllib.loads(out)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{dotted} = {value} is not TOML ({e})") from None
    return out


def make_arm(root: Path, name: str, template: str, edits: list[str], gguf: str, text: str):
    run = root / name
    if run.exists():
        return run
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pdctl", "new", name, "--template", template],
                   cwd=root, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    toml = run / "pdctl.toml"
    s = toml.read_text()
    if gguf:
        s = set_key(s, "target.path", json.dumps(str(Path(gguf).resolve())))
    if text:
        s = set_key(s, "data.path", json.dumps(str(Path(text).resolve())))
    for e in edits:
        k, v = e.split("=", 1)
        try:
            s = set_key(s, k, v)
        except ValueError as err:
            sys.exit(f"--arm: {err}")
    toml.write_text(s)
    return run


def train_step(run: Path) -> int:
    try:
        state = tomllib.loads((run / "pdctl.toml").read_text()).get("state", {})
    except (OSError, tomllib.TOMLDecodeError):
        return 0
    return int(state.get("train", {}).get("step", 0))


def run_arm(run: Path, until: int, budget_s: float | None) -> int:
    """`pdctl run --until` in `run`, stopped by SIGTERM after `budget_s`; its output goes to
    the terminal and to run/template_ab.log."""
    cmd = [sys.executable, "-m", "pdctl", "run", "--until", str(until)]
    if budget_s is not None:
        cmd = ["timeout", "-s", "TERM", str(int(budget_s)), *cmd]
    t0 = time.time()
    with open(run / "template_ab.log", "a") as log:
        proc = subprocess.Popen(cmd, cwd=run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)  # fmt: skip
        for line in proc.stdout:
            stamped = f"{time.time() - t0:7.1f} {line}"
            log.write(stamped)
            sys.stdout.write(stamped)
            sys.stdout.flush()
    return proc.wait()


def rows(run: Path) -> tuple[list[dict], list[dict]]:
    path = run / "metrics" / "train.jsonl"
    train, evals = [], []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if any(k.startswith("eval/") for k in r) else train).append(r)
    return train, evals


def summary(run: Path) -> dict:
    train, evals = rows(run)
    out: dict = {"arm": run.name, "step": train_step(run)}
    timed = [r for r in train[1:] if r.get("step_ms")]  # the first line holds the compile
    if timed:
        out["ms_per_step"] = statistics.median(r["step_ms"] for r in timed)
        tps = [r["tokens_per_s"] for r in timed if r.get("tokens_per_s")]
        out["tokens_per_s"] = statistics.median(tps) if tps else None
        mfu = [r["mfu"] for r in timed if r.get("mfu")]
        out["mfu"] = statistics.median(mfu) if mfu else None
    if evals:
        e = evals[-1]
        out["eval_step"] = e.get("step")
        l0 = [v for k, v in e.items() if k.startswith("eval/l0/")]
        alive = [v for k, v in e.items() if k.startswith("eval/alive/")]
        out["l0_mean"] = sum(l0) / len(l0) if l0 else None
        out["alive_mean"] = sum(alive) / len(alive) if alive else None
        for k in EVAL_KEYS:
            out[k] = e.get(f"eval/{k}")
    return out


def fmt(v, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def table(arms: list[Path]) -> str:
    got = [summary(a) for a in arms]
    base = got[0].get("ms_per_step")
    head = ["arm", "step", "ms / step", "tokens/s", "MFU", "speed vs first", "eval at",
            "L0 / site", "alive / site", *EVAL_KEYS]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for g in got:
        ms = g.get("ms_per_step")
        ratio = None if not (base and ms) else base / ms
        cells = [g["arm"], str(g["step"]), fmt(ms, ".1f"), fmt(g.get("tokens_per_s"), ",.0f"),
                 fmt(g.get("mfu"), ".2f"), fmt(ratio, ".2f") + ("x" if ratio else ""),
                 fmt(g.get("eval_step"), "d"), fmt(g.get("l0_mean"), ".1f"),
                 fmt(g.get("alive_mean"), ".1f"), *(fmt(g.get(k)) for k in EVAL_KEYS)]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="the arms' run directories go here")
    ap.add_argument("--template", default="smollm2-all-mlps")
    ap.add_argument("--arm", action="append", default=[], help="NAME=key=value,key=value")
    ap.add_argument("--until", type=int, default=500)
    ap.add_argument("--gguf", default=os.environ.get("PDCTL_SMOLLM2_GGUF", ""))
    ap.add_argument("--text", default="")
    ap.add_argument("--deadline-s", type=float, default=0.0)
    ap.add_argument("--compile-cache")
    ap.add_argument("--table", action="store_true", help="print the table of --root's arms")
    args = ap.parse_args()
    print(machine_line())
    root = Path(args.root)
    if args.compile_cache:
        os.environ["PDCTL_COMPILE_CACHE"] = args.compile_cache
    t0 = time.time()
    arms = []
    for spec in args.arm:
        name, _, edits = spec.partition("=")
        arms.append(make_arm(root, name, args.template, [e for e in edits.split(",") if e],
                             args.gguf, args.text))  # fmt: skip
    if not args.table:
        for run in arms:
            if train_step(run) >= args.until:
                continue
            left = None
            if args.deadline_s:
                left = args.deadline_s - (time.time() - t0)
                if left < 60:
                    print(f"# {run.name}: {left:.0f} s left, not started (run me again)")
                    break
            run_arm(run, args.until, left)
    if not arms:
        arms = sorted((p for p in root.iterdir() if (p / "pdctl.toml").exists()), key=str)
    print(table(arms))


if __name__ == "__main__":
    main()
