"""Seeds per hour: `pdctl sweep run` of N seeds of a template against separate `pdctl run`s of
the same members, end to end (process start, compiles, pretrain, warmup, train, evaluations).

Order: one solo run, the sweep, a second solo run (the solo side is the mean of the two, so a
drift of the shared machine's speed shows up as their difference). Each solo run is a member
directory of a second, identical sweep run alone with `pdctl run` (its own process, pdctl's
default devices: data parallel over every core). Prints per-side wall seconds, seeds per hour,
the ratio, and the sweep's recovery (members with 0 CI errors).

    python -m benchmarks.toys.sweep [--template tms] [--seeds 10] [--solo 2] [--set KEY=VALUE ...]

With `--torch-python` (the torch reference's environment, setup in `toys/torch_step.py`) the
torch reference's SPD step for the same template (goodfire-ai/spd's own loop, 2 threads) is
measured in the same run, twice (after the first solo run and after the sweep; the faster
counts), and its seeds per hour are step ms x train steps x seeds: train steps only (the
reference's pretrain, warmup and start-up would only add to its time, so the ratio is a lower
bound). `--set` overrides (e.g. `train.steps=1000` for a scaled run) apply to both sides.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from benchmarks._harness import child_env, machine_line, module_argv

TORCH_TOY = {"tms": "tms", "resid-mlp": "resid_mlp"}  # templates toys/torch_step.py mirrors


def _pdctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdctl", *args], cwd=cwd, capture_output=True, text=True
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--template", default="tms")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--solo", type=int, default=2, help="solo runs timed (scaled to --seeds)")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--strategy", default=None)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--torch-python", type=Path, help="python of the torch reference's venv")
    ap.add_argument("--spd", type=Path, default=Path("/work/spd-bench/spd"))
    args = ap.parse_args()
    print(machine_line())
    torch_ms: list[float] = []

    def torch_step() -> None:
        if not args.torch_python or args.template not in TORCH_TOY:
            return
        cmd = [str(args.torch_python), *module_argv("benchmarks.toys.torch_step")]
        cmd += ["--child", TORCH_TOY[args.template], "--spd", str(args.spd)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(path=(args.spd,)))
        if r.returncode:
            sys.exit(f"torch reference failed:\n{r.stderr[-2000:]}")
        torch_ms.append(json.loads(r.stdout.strip().splitlines()[-1])["step_ms"])
        print(f"torch reference step: {torch_ms[-1]:.2f} ms", flush=True)

    sets = [x for s in args.sets for x in ("--set", s)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in ("sw", "solo"):
            r = _pdctl(
                "sweep", "new", name, "--template", args.template,
                "--seeds", str(args.seeds), *sets, cwd=root,
            )  # fmt: skip
            if r.returncode:
                sys.exit(r.stderr)
        solo_members = sorted((root / "solo" / "runs").iterdir())[: args.solo]
        solo_s: list[float] = []

        def solo(run: Path) -> None:
            t0 = time.perf_counter()
            r = _pdctl("run", cwd=run)
            solo_s.append(time.perf_counter() - t0)
            print(f"solo {run.name}: {solo_s[-1]:.1f} s ({r.stdout.strip().splitlines()[-1]})")

        solo(solo_members[0])
        torch_step()
        t0 = time.perf_counter()
        cmd = ["sweep", "run", "sw"] + (["--strategy", args.strategy] if args.strategy else [])
        r = _pdctl(*cmd, cwd=root)
        sweep_s = time.perf_counter() - t0
        if r.returncode:
            sys.exit(r.stderr[-2000:])
        print(f"sweep of {args.seeds}: {sweep_s:.1f} s", flush=True)
        torch_step()
        for line in solo_members[1:]:
            solo(line)
        status = json.loads(_pdctl("sweep", "status", "sw", "--json", cwd=root).stdout)
        ok = sum(bool(m.get("success")) for m in status["members"])
        member_toml = tomllib.loads((root / "sw" / "runs" / status["members"][0]["member"]
                                     / "pdctl.toml").read_text())  # fmt: skip
        train = member_toml["state"]["train"]
    per_solo = sum(solo_s) / len(solo_s)
    seq_s = per_solo * args.seeds
    rate = lambda s: args.seeds / s * 3600  # noqa: E731
    print()
    print(f"{'side':<34} {'wall s':>9} {'seeds/h':>9}")
    print(f"{'sweep (one program per stage)':<34} {sweep_s:>9.1f} {rate(sweep_s):>9.1f}")
    print(f"{f'sequential pdctl run (x{args.seeds})':<34} {seq_s:>9.1f} {rate(seq_s):>9.1f}")
    print(f"solo runs: {', '.join(f'{s:.1f}' for s in solo_s)} s")
    print(f"ratio sweep / sequential (seeds per hour): {seq_s / sweep_s:.2f}x")
    print(f"sweep train step {train.get('step_ms')} ms for {args.seeds} members "
          f"({train.get('step_ms', 0) / args.seeds:.2f} ms per member-step)")  # fmt: skip
    if torch_ms:
        torch_s = min(torch_ms) / 1e3 * train["steps"] * args.seeds
        print(f"torch reference (measured {', '.join(f'{t:.2f}' for t in torch_ms)} ms/step, "
              f"train steps only): {rate(torch_s):.1f} seeds/h; ratio sweep / torch "
              f"{torch_s / sweep_s:.2f}x")  # fmt: skip
    else:
        print("torch reference: not measured (--torch-python)")
    print(f"recovery: {ok}/{args.seeds} members with 0 CI errors")
    if args.json:
        args.json.write_text(
            json.dumps({"sweep_s": sweep_s, "solo_s": solo_s, "ok": ok, "torch_ms": torch_ms})
        )


if __name__ == "__main__":
    main()
