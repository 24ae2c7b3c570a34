"""pdctl's SPD train step against the torch reference's (goodfire-ai/spd) on the toys, interleaved.

Each round runs, in fresh child processes and in this order, the torch reference
(`toys/torch_step.py`, spd's own `optimize` loop, 2 threads) and then pdctl
(`toys/spd_step.py`, the train stage's program on pdctl's default devices) for every toy; `--rounds`
rounds alternate the two sides so that a drift of this shared machine's speed shows up as the
spread between rounds instead of as a ratio. Per toy it prints each side's best window and the
ratio torch / pdctl per round and over the best of all rounds (> 1: pdctl is faster).

    python -m benchmarks.toys.vs_torch [--toys tms resid-mlp] [--rounds 2]
        [--torch-python /work/spd-bench/venv/bin/python] [--spd /work/spd-bench/spd]

The torch side needs its own environment (setup in `benchmarks/toys/torch_step.py`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._harness import child_env, git_commit, machine_line, module_argv, run_child

TORCH_NAME = {"tms": "tms", "resid-mlp": "resid_mlp"}  # pdctl template -> torch_toy_step toy


def torch_step(py: Path, spd: Path, template: str) -> float:
    argv = module_argv("benchmarks.toys.torch_step", "--child", TORCH_NAME[template], "--spd", spd)
    r = run_child(argv, what=f"torch side ({template})", env=child_env(path=(spd,)), python=str(py))
    return r["step_ms"]


def pdctl_step(template: str, steps: int) -> float:
    env = child_env()  # pdctl's default devices: no forced device count
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    argv = module_argv("benchmarks.toys.spd_step", "--child", template, "--steps", steps)
    argv += ["--child-devices", "default"]
    return run_child(argv, what=f"pdctl side ({template})", env=env)["step_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toys", nargs="+", default=["tms", "resid-mlp"], choices=list(TORCH_NAME))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="pdctl steps per timing window")
    ap.add_argument("--torch-python", type=Path, default=Path("/work/spd-bench/venv/bin/python"))
    ap.add_argument("--spd", type=Path, default=Path("/work/spd-bench/spd"))
    a = ap.parse_args()
    print(f"{machine_line()}; goodfire-ai/spd {git_commit(a.spd)}", flush=True)
    got: dict[str, dict[str, list[float]]] = {t: {"torch": [], "pdctl": []} for t in a.toys}
    for r in range(a.rounds):
        for t in a.toys:
            got[t]["torch"].append(torch_step(a.torch_python, a.spd, t))
            got[t]["pdctl"].append(pdctl_step(t, a.steps))
            tt, pp = got[t]["torch"][-1], got[t]["pdctl"][-1]
            print(
                f"round {r + 1}  {t:<10} torch {tt:8.2f} ms  pdctl {pp:8.2f} ms  "
                f"ratio {tt / pp:5.2f}x",
                flush=True,
            )
    print("best window of all rounds (ms per train step):")
    for t in a.toys:
        tt, pp = min(got[t]["torch"]), min(got[t]["pdctl"])
        print(f"  {t:<10} torch {tt:8.2f}  pdctl {pp:8.2f}  torch / pdctl {tt / pp:5.2f}x")


if __name__ == "__main__":
    main()
