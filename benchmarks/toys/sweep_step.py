"""The stacked train step of a sweep, per member: how a device's members are stepped (`map`:
one after another; `vmap`: batched) and how many members per device, against one run's step on
one device at a few batch sizes (the per-example cost of the TMS 5-2 step is not flat in the
batch on XLA:CPU: its (B, C, 16) CI-MLP arrays leave the core's cache).

Each configuration runs in a fresh child process (the device count is fixed when JAX starts);
best of 3 windows of 30 steps.

    python -m benchmarks.toys.sweep_step [--template tms] [--devices 2]
    python -m benchmarks.toys.sweep_step --members 2 4 8 16 32   # where throughput stops rising
    python -m benchmarks.toys.sweep_step --members 3 5 --compare-padding  # padded vs divisor mesh

A member count that does not fill the devices evenly runs padded here (`stacked.member_mesh`
with `pad`: the fewest members per device, padding slots copying the first member, what pdctl
does on GPU/TPU); `--compare-padding` also runs each count on the most devices that divide it,
without padding (what pdctl does on CPU).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import child_env, machine_line, module_argv

CASES = [  # (members, devices used, batch, strategy)
    (1, 1, 1024, "map"),
    (1, 1, 2048, "map"),
    (1, 1, 4096, "map"),
    (2, 2, 4096, "map"),
    (10, 2, 4096, "map"),
    (10, 2, 4096, "vmap"),
    (10, 1, 4096, "map"),
]


def child(template: str, n: int, d: int, batch: int, strategy: str, pad: bool = True) -> None:
    from pdctl.engine import runtime

    runtime.cpu_xla_flags()  # pdctl's XLA:CPU flags, as `pdctl sweep run` has them
    import jax
    import numpy as np

    from pdctl.project import Project
    from pdctl.stages import train
    from pdctl.stages.init_weights import init_decomposition
    from pdctl.stages.inputs import STREAM_DECOMP, STREAM_TARGET, stream_key, target_from_config
    from pdctl.sweep import stacked as st
    from pdctl.templates import create_run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Project.load(create_run("b", template, Path(tmp)) / "pdctl.toml").config
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_size": batch})})
    mesh = st.member_mesh(n, jax.devices()[:d], pad=pad)
    slots = st.member_slots(n, mesh)
    target = target_from_config(cfg)
    prog = train.program(cfg, mesh, target)
    params = jax.device_get(jax.jit(target.init)(stream_key(cfg, STREAM_TARGET)))
    dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
    one = jax.device_get(prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"]))
    sp = st.stacked_program(prog, slots, strategy)
    state = sp.put([one] * slots, sp.state_shardings)
    frozen = sp.put([params] * slots, sp.frozen_shardings[0])
    step = sp.jit().lower(frozen, state, None).compile()
    best = float("inf")
    for _ in range(4):  # the first window warms up
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(30):
            state, m = step(frozen, state, None)
        jax.block_until_ready(state)
        best = min(best, (time.perf_counter() - t0) / 30)
    print(f"{n:>7} {mesh.size:>7} {slots:>5} {batch:>6} {strategy:>8} {best * 1e3:>9.2f} "
          f"{best * 1e3 / n:>11.2f} {best * 1e9 / n / batch:>10.0f}")  # fmt: skip
    assert np.all(np.isfinite(np.asarray(m["loss"])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--template", default="tms")
    ap.add_argument("--devices", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--members",
        type=int,
        nargs="+",
        help="instead of the fixed cases: these member counts, map, over --devices, at --batch",
    )
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--compare-padding", action="store_true")
    ap.add_argument("--child", nargs=5)
    args = ap.parse_args()
    if args.child:
        n, d, b, s, pad = args.child
        child(args.template, int(n), int(d), int(b), s, pad == "pad")
        return
    print(machine_line())
    env = child_env()
    # (no JAX_PLATFORMS: JAX takes the accelerator where there is one)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    print(f"{'members':>7} {'devices':>7} {'slots':>5} {'batch':>6} {'strategy':>8} {'step ms':>9} "
          f"{'ms/member':>11} {'ns/example':>10}")  # fmt: skip
    cases = [(*c, "pad") for c in CASES]
    if args.members:
        layouts = ("pad", "divide") if args.compare_padding else ("pad",)
        # alternated, so that a drift of the machine's speed hits both layouts alike
        cases = [(n, args.devices, args.batch, "map", lay) for n in args.members for lay in layouts]
    for n, d, b, s, lay in cases:
        d = min(d, args.devices)
        r = subprocess.run(
            [sys.executable, *module_argv(__spec__.name, "--template", args.template, "--child", n,
                                          d, b, s, lay)], env=env, capture_output=True, text=True,
        )  # fmt: skip
        print(
            r.stdout.strip() if r.returncode == 0 else f"{n} {d} {b} {s}: failed {r.stderr[-300:]}"
        )


if __name__ == "__main__":
    main()
