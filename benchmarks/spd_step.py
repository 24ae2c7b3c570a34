"""SPD train-step throughput and faithfulness-warmup time for the reference toy configs.

TMS 5-2 (templates/tms: C=20 per site, CI `mlp` [16], batch 4096, importance minimality +
stochastic + layerwise recon) and ResidMLP-1 (templates/resid-mlp: 100 features, d_embed 1000,
d_mlp 50, C=100, batch 2048). The steps are built exactly as `pdctl train` / `pdctl warmup`
build them (`train.build` / `train.make_step`, `warmup.build` / `warmup.make_step`, the same
shardings and donation), on the devices JAX sees (one CPU device unless XLA_FLAGS says more;
mesh data = all). The target is freshly initialised (step time does not depend on its values).

    python benchmarks/spd_step.py [--steps 30] [--configs tms resid-mlp]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import jax

from pdctl.config import match_sites
from pdctl.engine import sharding
from pdctl.project import Project
from pdctl.science.spd.losses import make_spd_fns
from pdctl.stages import train, warmup
from pdctl.stages.common import (
    STREAM_DECOMP,
    STREAM_TARGET,
    StageEnv,
    stream_key,
    target_from_config,
    with_remat,
)
from pdctl.stages.init_weights import init_decomposition
from pdctl.templates import create_run


def bench(template: str, n_steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = create_run("bench", template, Path(tmp))
        proj = Project.load(run / "pdctl.toml")
    cfg = proj.config
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    env = StageEnv(proj, "train", mesh, target_from_config(cfg))
    target = env.target
    abstract_params = jax.eval_shape(target.init, stream_key(cfg, STREAM_TARGET))
    params = jax.jit(target.init, out_shardings=env.shardings(abstract_params))(
        stream_key(cfg, STREAM_TARGET)
    )
    dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
    target_sh = jax.tree.map(lambda x: x.sharding, params)
    out = {"config": template, "batch": cfg.train.batch_size, "devices": mesh.size}

    # faithfulness warmup: compile + all cfg.warmup.steps steps
    abstract_dec = warmup.abstract_decomposition(env)
    w_tx, w_make, _, w_sh = warmup.build(env, abstract_dec["components"], cfg.warmup.steps)
    paths, ties = warmup.site_layout(env)
    t0 = time.perf_counter()
    w_state = jax.jit(w_make, out_shardings=w_sh)(dec["components"])
    w_step = (
        jax.jit(
            warmup.make_step(target, paths, w_tx, ties),
            in_shardings=(target_sh, w_sh, None),
            out_shardings=(w_sh, sharding.replicated(mesh)),
            donate_argnums=(1,),
        )
        .lower(params, w_state, None)
        .compile()
    )
    t1 = time.perf_counter()
    for _ in range(cfg.warmup.steps):
        w_state, m = w_step(params, w_state, None)
    jax.block_until_ready(w_state)
    t2 = time.perf_counter()
    out.update(warmup_steps=cfg.warmup.steps, warmup_compile_s=t1 - t0, warmup_run_s=t2 - t1)

    # the SPD train step
    target = with_remat(target, cfg.train.remat)
    fns = make_spd_fns(target, match_sites(cfg, target.site_paths()), cfg)
    tx, make_state, _, state_sh, _ = train.build(env, fns, cfg.train.steps)
    state = jax.jit(make_state, out_shardings=state_sh)(
        w_state["components"], dec["ci_fns"], dec["sources"]
    )
    t0 = time.perf_counter()
    step = (
        jax.jit(
            train.make_step(
                target, fns, tx, cfg, cfg.train.steps, sharding.batch_sharding(mesh, 2)
            ),
            in_shardings=(target_sh, state_sh, None),
            out_shardings=(state_sh, sharding.replicated(mesh)),
            donate_argnums=(1,),
        )
        .lower(params, state, None)
        .compile()
    )
    out["train_compile_s"] = time.perf_counter() - t0
    for _ in range(3):  # warm up
        state, m = step(params, state, None)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(n_steps):
        state, m = step(params, state, None)
    jax.block_until_ready((state, m))
    dt = (time.perf_counter() - t0) / n_steps
    out.update(
        step_ms=dt * 1e3,
        steps_per_s=1 / dt,
        samples_per_s=cfg.train.batch_size / dt,
        loss=float(m["loss"]),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30, help="timed train steps per config")
    ap.add_argument("--configs", nargs="+", default=["tms", "resid-mlp"])
    a = ap.parse_args()
    print(
        f"JAX {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    rows = [bench(c, a.steps) for c in a.configs]
    hdr = (
        f"{'config':<10} {'batch':>6} | {'train compile s':>15} {'step ms':>8} "
        f"{'steps/s':>8} {'samples/s':>10} | {'warmup':>6} {'compile s':>9} {'run s':>6} "
        f"{'total s':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['config']:<10} {r['batch']:>6} | {r['train_compile_s']:>15.2f} "
            f"{r['step_ms']:>8.2f} {r['steps_per_s']:>8.2f} {r['samples_per_s']:>10.0f} | "
            f"{r['warmup_steps']:>6} {r['warmup_compile_s']:>9.2f} {r['warmup_run_s']:>6.2f} "
            f"{r['warmup_compile_s'] + r['warmup_run_s']:>7.2f}"
        )


if __name__ == "__main__":
    main()
