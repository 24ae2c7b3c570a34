"""How far the fit check's XLA:CPU estimate is from XLA:TPU's figures, per program: the factor a
machine without libtpu applies to a TPU verdict's peaks (`pdctl.inspect.topology.CPU_PEAK_MARGIN`).

For each configuration, `pdctl inspect-sharding --stage train --json` twice in child processes:
`--device-memory 15.75GiB` (XLA:CPU, what the check compiles without libtpu) and `--device-kind
tpu-v5e` (XLA:TPU for one v5e, from libtpu: `pip install -e ".[tpu-aot]"`). Arguments, outputs
and aliased bytes are the same HLO's on both (XLA:TPU pads them to its tiles); temporaries are
each compiler's plan. Printed: per program both compilers' temporaries and peaks, and their
ratios TPU / CPU; the range of the peak ratios over programs of >= 0.1 GiB (the largest,
rounded up, is the factor) and of the temporaries' (a program XLA:TPU refused for want of HBM
counts with what it said it needs at least).

    python -m benchmarks.memory.fit_margin
        [--configs tms resid-mlp llama-mlp smollm2 smollm2-16x256] [--gguf PATH] [--json OUT]

A benchmark, never a test: the SmolLM2 configurations compile for minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import machine_line

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30

# name: (template, overrides of its pdctl.toml); the GGUF path is filled in for smollm2
CONFIGS: dict[str, tuple[str, dict]] = {
    "tms": ("tms", {}),
    "resid-mlp": ("resid-mlp", {}),
    "llama-mlp": ("llama-mlp", {}),
    "smollm2": ("smollm2", {}),  # layer 15, 4 x 64 tokens a step
    "smollm2-16x256": ("smollm2", {"data": {"seq_len": 256}, "train": {"batch_size": 16}}),
}


def make_run(root: Path, name: str, gguf: str | None) -> Path:
    from pdctl.testing.runs import edit_config

    template, over = CONFIGS[name]
    subprocess.run([sys.executable, "-m", "pdctl", "new", name, "--template", template],
                   cwd=root, check=True, capture_output=True)  # fmt: skip
    run = root / name
    if template.startswith("smollm2"):
        if not gguf:
            sys.exit("--gguf PATH (or PDCTL_SMOLLM2_GGUF) is required for the smollm2 configs")
        over = {**over, "target": {"path": str(Path(gguf).resolve())}}
    if over:
        edit_config(run, over)
    return run


def inspect(run: Path, device: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pdctl", "--project", str(run), "inspect-sharding",
           "--stage", "train", *device, "--json"]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        sys.exit(f"{run.name} {' '.join(device)}: {last}")
    fit = json.loads(out.stdout)["fit"]
    fit["wall_s"] = time.perf_counter() - t0
    return fit


def temps(q: dict) -> float:
    """A program's temporaries (GiB); for one XLA:TPU refused, what it said it needs at least."""
    if "oom" in q:
        return (q["peak_bytes"] - q.get("held_bytes", 0)) / GIB
    return q["temp_bytes"] / GIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--gguf", default=os.environ.get("PDCTL_SMOLLM2_GGUF"))
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    print(machine_line())
    os.environ.setdefault("PDCTL_LOG", "warning")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdctl-fitmargin-") as tmp:
        for name in args.configs:
            run = make_run(Path(tmp), name, args.gguf)
            cpu = inspect(run, ["--device-memory", "15.75GiB"])
            tpu = inspect(run, ["--device-kind", "tpu-v5e"])
            if tpu.get("compiler", "").startswith("XLA:CPU"):
                sys.exit("libtpu is not installed: pip install -e '.[tpu-aot]'")
            for c, t in zip(cpu["programs"], tpu["programs"], strict=True):
                row = {"config": name, "program": c["program"],
                       "cpu_temp_gib": temps(c), "tpu_temp_gib": temps(t),
                       "cpu_peak_gib": c["peak_bytes"] / GIB, "tpu_peak_gib": t["peak_bytes"] / GIB,
                       "tpu_refused": "oom" in t, "cpu_s": c["compile_s"],
                       "tpu_s": t["compile_s"]}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| config | program | temporaries XLA:CPU GiB | XLA:TPU GiB | TPU / CPU | peak XLA:CPU "
          "GiB | XLA:TPU GiB | TPU / CPU | compile s CPU / TPU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for r in rows:
        ge = ">= " if r["tpu_refused"] else ""
        tr = r["tpu_temp_gib"] / r["cpu_temp_gib"] if r["cpu_temp_gib"] > 1e-3 else None
        pr = r["tpu_peak_gib"] / r["cpu_peak_gib"] if r["cpu_peak_gib"] > 0 else None
        if (
            tr is not None and r["cpu_temp_gib"] >= 0.01
        ):  # ratios of MiB-sized temporaries are noise
            ratios.append((tr, r["config"], r["program"]))
        print(
            f"| {r['config']} | {r['program']} | {r['cpu_temp_gib']:.4f} | {ge}"
            f"{r['tpu_temp_gib']:.4f} | {'-' if tr is None else f'{tr:.3f}'} | "
            f"{r['cpu_peak_gib']:.4f} | {ge}{r['tpu_peak_gib']:.4f} | "
            f"{'-' if pr is None else f'{pr:.3f}'} | {r['cpu_s']:.0f} / {r['tpu_s']:.0f} |"
        )
    peaks = [(r["tpu_peak_gib"] / r["cpu_peak_gib"], r["config"], r["program"])
             for r in rows if r["cpu_peak_gib"] >= 0.1]  # fmt: skip
    print()
    for what, got, size in (("peaks", peaks, "0.1 GiB"), ("temporaries", ratios, "10 MiB")):
        if got:
            lo, hi = min(got), max(got)
            print(f"# {what} XLA:TPU / XLA:CPU over {len(got)} programs of >= {size}: "
                  f"{lo[0]:.3f} ({lo[1]}, {lo[2]}) to {hi[0]:.3f} ({hi[1]}, {hi[2]})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
