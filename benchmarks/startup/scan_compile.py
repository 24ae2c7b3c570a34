"""Train-step compile time as depth grows: layers scanned and sites stacked (`[train]
scan_layers = true`) against unrolled (`false`, the default), on the same machine in one run.

Tiny random Llamas (d_model 128, 4 heads, 2 kv heads, MLP 256, vocab 512, seq 32, batch 4),
every attention and MLP projection decomposed (C 64 attention, 128 MLP), the hf-lm template's
losses (faithfulness, importance minimality, uniform-k subset recon, PPGD with 2 warm-up ascent
steps), on pdctl's default devices (one CPU device per core). Per depth and side, in a fresh
child process: the train step's compile s (lower + compile), the evaluation's first call
(its compiles, then one run) s, the step ms (best of 3 windows), and the loss after 3 steps
from the same start (scan vs unrolled agree to float reassociation).

    python -m benchmarks.startup.scan_compile [--layers 2 8 32] [--unrolled-max 8] [--baseline REV]

Unrolled sides run only up to `--unrolled-max` layers (at 32 layers the unrolled step alone
compiled for ~8 min on this machine). With `--baseline REV` the scanned side also runs on the
code of git revision REV (a temporary worktree), interleaved with this checkout's, depth by
depth.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _harness

ROOT = Path(__file__).resolve().parents[2]


def model_dir(n_layers: int) -> Path:
    d = Path(tempfile.mkdtemp(prefix=f"pdctl-scan-{n_layers}-"))
    cfg = dict(
        architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=n_layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def tiny_raw(n_layers: int, scan: bool) -> dict:
    """The hf-lm template's table for the tiny Llama of `n_layers` (seq 32, batch 4, C 128 /
    64, CI hidden 64), as parsed TOML to edit further."""
    import tomllib

    from pdctl.templates import templates_root

    raw = tomllib.loads((templates_root() / "hf-lm" / "pdctl.toml").read_text())
    raw["target"]["path"] = str(model_dir(n_layers))
    raw["data"]["seq_len"] = 32
    raw["decomp"]["sites"] = [
        {"pattern": "*.mlp.*", "C": 128},
        {"pattern": "*attn.*", "C": 64},
    ]
    raw["decomp"]["ci_fn"]["hidden"] = [64]
    raw["train"]["batch_size"] = 4
    raw["train"]["eval_batch_size"] = 4
    raw["train"]["scan_layers"] = scan
    return raw


def fresh_train(cfg):
    """(mesh, target, train program, random target params, fresh train state, one batch of
    random tokens, number of sites) for `cfg` on pdctl's default devices."""
    import numpy as np

    from pdctl.engine import sharding
    from pdctl.testing.runs import fresh_train_state

    mesh = sharding.make_mesh(-1, 1)
    tokens = np.random.default_rng(0).integers(0, 512, size=(4, 33), dtype=np.int32)
    return (mesh, *fresh_train_state(cfg, mesh, tokens))


def child(n_layers: int, scan: bool, n_steps: int) -> dict:
    from pdctl.engine import runtime

    runtime.configure_devices()
    import jax

    from pdctl.config import parse_config
    from pdctl.engine import sharding
    from pdctl.science.spd import evaluate
    from pdctl.stages import train
    from pdctl.stages.inputs import with_scan

    t_init = time.perf_counter()
    cfg = parse_config(tiny_raw(n_layers, scan))
    mesh, target, prog, params, state, batch, n_sites = fresh_train(cfg)
    tokens = jax.device_get(batch["tokens"])
    jax.block_until_ready((params, state))
    init_s = time.perf_counter() - t_init

    t0 = time.perf_counter()
    step = prog.jit().lower(params, state, batch).compile()
    compile_s = time.perf_counter() - t0

    t_run = time.perf_counter()
    holder = {"state": state}
    losses = []
    for _ in range(3):
        holder["state"], m = step(params, holder["state"], batch)
        losses.append(float(jax.device_get(m["total"])))

    def best(n: int) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(n):
                holder["state"], m = step(params, holder["state"], batch)
            jax.block_until_ready(m)
            times.append((time.perf_counter() - t) / n)
        return min(times) * 1e3

    step_ms = best(n_steps)
    run_s = time.perf_counter() - t_run

    # The evaluation's programs (CI statistics and the LM's masked CE / KL), as the train
    # stage builds them: compiled on their first call.
    ev_target = with_scan(target, scan)
    fns = train.spd_fns(cfg, ev_target)
    rep = sharding.replicated(mesh)
    # (the stacked state as it is, as the train stage's evaluation takes it)
    comps = jax.device_put(jax.device_get(holder["state"]["trainable"]), rep)
    eb = jax.device_put({"tokens": tokens}, rep)
    t0 = time.perf_counter()
    c = fns.expand(comps["components"])
    evaluate.ci_stats(ev_target, params, c, comps["ci_fns"], cfg, ev_target.inputs(eb))
    evaluate.lm_eval(ev_target, params, c, comps["ci_fns"], cfg, eb, jax.random.key(1))
    eval_s = time.perf_counter() - t0
    return {
        "layers": n_layers,
        "scan": scan,
        "sites": n_sites,
        "devices": mesh.size,
        "compile_s": compile_s,
        "init_s": init_s,
        "run_s": run_s,
        "eval_first_s": eval_s,
        "step_ms": step_ms,
        "losses": losses,
    }


def run_child(n_layers: int, scan: bool, n_steps: int, root: Path = ROOT) -> dict:
    """One measurement in a fresh process, on the code under `root` (this file's copy there)."""
    script = root / "benchmarks" / "startup" / "scan_compile.py"
    if not script.is_file():  # a revision before the benchmarks' folders: this file's copy
        script = Path(__file__).resolve()
    argv = [str(script), "--child", str(n_layers), "--steps", str(n_steps)]
    if scan:
        argv.append("--scan")
    what = f"child ({n_layers} layers, scan {scan})"
    return _harness.run_child(argv, what=what, env=_harness.child_env(root), cwd=root)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--unrolled-max", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="steps per timing window")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--baseline", help="git revision whose scanned step runs beside this one")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--scan", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.scan, a.steps)))
        return
    base_root = None
    if a.baseline:
        base_root = Path(tempfile.mkdtemp(prefix="pdctl-baseline-"))
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_root), a.baseline],
            check=True,
            capture_output=True,
        )
    rows = []
    try:
        for n in a.layers:
            # interleaved: every side of a depth back to back
            sides = [("unrolled", False, ROOT)] if n <= a.unrolled_max else []
            if base_root is not None:
                sides.append((f"scan@{a.baseline}", True, base_root))
            sides.append(("scan", True, ROOT))
            for side, scan, root in sides:
                r = {**run_child(n, scan, a.steps, root), "side": side}
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    finally:
        if base_root is not None:
            remove = ["worktree", "remove", "--force", str(base_root)]
            subprocess.run(["git", "-C", str(ROOT), *remove])
    w = max(len(r["side"]) for r in rows)
    print(f"{'layers':>6} {'sites':>5} {'side':>{w}} {'compile s':>9} {'eval 1st s':>10} "
          f"{'step ms':>8}  loss after 1, 2, 3 steps")  # fmt: skip
    for r in rows:
        loss = ", ".join(f"{v:.6g}" for v in r["losses"])
        print(f"{r['layers']:>6} {r['sites']:>5} {r['side']:>{w}} {r['compile_s']:>9.1f} "
              f"{r['eval_first_s']:>10.1f} {r['step_ms']:>8.1f}  {loss}")  # fmt: skip
    for side in dict.fromkeys(r["side"] for r in rows if r["scan"]):
        scans = {r["layers"]: r for r in rows if r["side"] == side}
        if len(scans) > 1:
            lo, hi = min(scans), max(scans)
            ratio = scans[hi]["compile_s"] / scans[lo]["compile_s"]
            print(f"{side}: compile at {hi} layers / at {lo} layers = {ratio:.2f}x (goal <= 1.5x)")
    for r in rows:
        if r["side"] != "scan":
            continue
        n = r["layers"]
        for o in rows:
            if o["layers"] == n and o["side"] != "scan":
                print(f"{n} layers: compile {o['side']} / scan = "
                      f"{o['compile_s'] / r['compile_s']:.2f}x, step scan / {o['side']} = "
                      f"{r['step_ms'] / o['step_ms']:.2f}x")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
