"""Does SPD recover a toy model's ground truth? One template, N seeds, each a full `pdctl run`.

Every seed is a fresh run directory from the template with `[run] seed` set (it seeds the
target, the decomposition init, the data and the masks), taken through init-weights ->
pretrain -> warmup -> train by the installed CLI in a fresh process (`python -m pdctl run`), so
what is measured is exactly what a user runs. Per seed it prints CI errors per site (against
each site's ground-truth pattern: identity for TMS linear1/linear2 and ResidMLP mlp_in, a dense
block for TMS hidden layers and ResidMLP mlp_out), min MMCS and mean ML2R (TMS), L0 and alive
components per site, and wall time; then the success fraction (success = 0 CI errors in total).

Runs one seed at a time (a seed uses every core: XLA_FLAGS gets one CPU device per core unless
it already sets a count, and the mesh is data = all). Each finished seed is appended to
--out as one JSON line, so a long sweep can be read while it runs and is not lost if stopped.

    python -m benchmarks.toys.recovery --template tms --seeds 10
    python -m benchmarks.toys.recovery --template tms-40-10 --seeds 3 --out tms4010.jsonl
    python -m benchmarks.toys.recovery --template resid-mlp --seeds 1 --set train.steps=2000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

from benchmarks._harness import git_commit, machine_line


def _value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _edit(run: Path, sets: dict[str, object]) -> None:
    path = run / "pdctl.toml"
    raw = tomllib.loads(path.read_text())
    for dotted, value in sets.items():
        *parents, last = dotted.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path.write_text(tomli_w.dumps(raw))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        n = os.cpu_count() or 1
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def one_seed(template: str, seed: int, sets: dict[str, object], parent: Path) -> dict:
    name = f"seed{seed}"
    pdctl = [sys.executable, "-m", "pdctl"]
    subprocess.run(
        [*pdctl, "new", name, "--template", template], cwd=parent, check=True, capture_output=True
    )
    run = parent / name
    _edit(run, {"run.seed": seed, **sets})
    t0 = time.perf_counter()
    r = subprocess.run([*pdctl, "run"], cwd=run, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {
            "seed": seed,
            "error": (r.stderr or r.stdout).strip().splitlines()[-1:],
            "wall_s": wall,
        }
    state = tomllib.loads((run / "pdctl.toml").read_text())["state"]
    ev = state["train"].get("eval", {})
    errors = ev.get("ci_errors", {})
    return {
        "seed": seed,
        "ci_errors": errors,
        "success": errors.get("total", float("nan")) == 0,
        "mmcs": ev.get("mmcs", {}),
        "ml2r": ev.get("ml2r", {}),
        "l0": ev.get("l0", {}),
        "alive": ev.get("alive", {}),
        "recovered": ev.get("recovered"),
        "pretrain_loss": state["pretrain"].get("metrics", {}).get("loss"),
        "train_loss": state["train"].get("metrics", {}).get("loss"),
        "train_step_ms": state["train"].get("step_ms"),
        "wall_s": wall,
    }


def _fmt(d: dict, digits: int = 0) -> str:
    return " ".join(f"{k}={v:.{digits}f}" for k, v in d.items() if k != "total")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", default="tms")
    ap.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (or --seed-list)")
    ap.add_argument("--seed-list", type=int, nargs="*", help="explicit seeds")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="override a template key (TOML value), e.g. train.steps=2000",
    )
    ap.add_argument("--out", type=Path, help="append one JSON line per finished seed")
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    a = ap.parse_args()
    sets = {}
    for item in a.set:
        key, _, text = item.partition("=")
        sets[key.strip()] = _value(text.strip())
    seeds = a.seed_list if a.seed_list else list(range(a.seeds))
    commit = git_commit()
    print(machine_line(), flush=True)
    print(
        f"template {a.template}, seeds {seeds}, overrides {sets or 'none'}, "
        f"XLA_FLAGS={_env()['XLA_FLAGS']!r}",
        flush=True,
    )
    parent = a.keep or Path(tempfile.mkdtemp(prefix="pdctl-recovery-"))
    parent.mkdir(parents=True, exist_ok=True)
    rows = []
    print(
        f"{'seed':>4} {'ok':>3} {'CI err':>6}  {'per site':<40} {'min MMCS':>8} "
        f"{'ML2R':>6} {'alive':<24} {'L0':<30} {'wall s':>7}",
        flush=True,
    )
    for seed in seeds:
        r = one_seed(a.template, seed, sets, parent)
        r.update(template=a.template, overrides=sets, commit=commit)
        rows.append(r)
        if a.out:
            with a.out.open("a") as f:
                f.write(json.dumps(r) + "\n")
        if "error" in r:
            print(f"{seed:>4} ERR {r['error']}", flush=True)
            continue
        mmcs = min(r["mmcs"].values()) if r["mmcs"] else float("nan")
        ml2r = sum(r["ml2r"].values()) / len(r["ml2r"]) if r["ml2r"] else float("nan")
        print(
            f"{seed:>4} {'yes' if r['success'] else 'no':>3} "
            f"{r['ci_errors'].get('total', float('nan')):>6.0f}  {_fmt(r['ci_errors']):<40} "
            f"{mmcs:>8.4f} {ml2r:>6.3f} {_fmt(r['alive']):<24} {_fmt(r['l0'], 2):<30} "
            f"{r['wall_s']:>7.0f}",
            flush=True,
        )
    done = [r for r in rows if "error" not in r]
    ok = sum(r["success"] for r in done)
    print(
        f"success: {ok}/{len(done)} seeds with 0 CI errors"
        + (f" ({len(rows) - len(done)} runs failed)" if len(done) < len(rows) else "")
    )
    if done:
        print(f"wall time per seed: {sum(r['wall_s'] for r in done) / len(done):.0f} s")


if __name__ == "__main__":
    main()
