"""SPD train-step throughput, FLOPs, MFU, memory and donation for the reference configs, on one
device and on pdctl's default devices (one per core on CPU; the accelerators elsewhere). A device
count N is XLA's host-device flag on CPU, and the first N devices on a GPU or TPU.

The steps are the train and warmup stages' own programs (`train.program`, `warmup.program`:
what `pdctl train` / `pdctl warmup` compile, the same shardings and donation) from the
unmodified templates (tms: TMS 5-2, batch 4096; resid-mlp: ResidMLP-1, batch 2048; llama-mlp:
the byte-level LM, batch 16 x 64 tokens; tms-40-10). Each device count runs in a fresh child
process (the device count is fixed when JAX starts). Per config and device count it prints:
train compile s, step ms (best of 3 windows), samples/s, tokens/s, one device's FLOPs per step
(XLA's count), MFU where the device's peak is known (or `--peak-tflops`), XLA's
`memory_analysis()` estimate of the step's peak per device with and without donating the state
(argument + output + temp - alias) and its ratio to one state copy, the measured pointer reuse
of the first donating call, and the faithfulness warmup's compile and total run time.

    python -m benchmarks.toys.spd_step [--configs tms resid-mlp] [--devices default 1] [--steps 30]
        [--json results.json]

Exits 1 when pdctl's default device count is more than 5% slower than the best count measured
(the default must be the fastest choice on this machine).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks import _harness

BATCHES = {"llama-mlp": 16}  # sequences; the toys use their template's batch


def child(
    template: str,
    n_steps: int,
    peak_tflops: float,
    n_devices: int = 0,
    warmup_steps: int | None = None,
    no_donation: bool = True,
) -> dict:
    """One config's measurements on the first `n_devices` devices (0: all). `warmup_steps`:
    the faithfulness warmup's steps (None: the template's); `no_donation`: also compile the
    step without donation for its memory estimate (one more compile). Callable in a process
    that has run other configs (benchmarks/tpu/accel_check.py): nothing here is global."""
    import jax
    import numpy as np

    from pdctl.engine import donation, measure, sharding
    from pdctl.engine.loop import MAX_AHEAD
    from pdctl.project import Project
    from pdctl.stages import train, warmup
    from pdctl.stages.init_weights import init_decomposition
    from pdctl.stages.inputs import STREAM_DECOMP, STREAM_TARGET, stream_key, target_from_config
    from pdctl.templates import create_run

    t_init = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run = create_run("bench", template, Path(tmp))
        cfg = Project.load(run / "pdctl.toml").config
    if template in BATCHES:
        cfg = cfg.model_copy(
            update={"train": cfg.train.model_copy(update={"batch_size": BATCHES[template]})}
        )
    devices = jax.devices()[:n_devices] if n_devices else jax.devices()
    mesh = sharding.make_mesh(-1, 1, devices)  # data = every device used
    target = target_from_config(cfg)
    w_prog = warmup.program(cfg, mesh, target)
    prog = train.program(cfg, mesh, target)
    params = jax.jit(target.init, out_shardings=w_prog.frozen_shardings[0])(
        stream_key(cfg, STREAM_TARGET)
    )
    dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
    out: dict = {"config": template, "batch": cfg.train.batch_size, "devices": mesh.size}
    out["device_kind"] = jax.devices()[0].device_kind
    jax.block_until_ready((params, dec))
    out["init_s"] = time.perf_counter() - t_init

    # faithfulness warmup: compile + its steps (the template's, or `warmup_steps`)
    n_warmup = cfg.warmup.steps if warmup_steps is None else warmup_steps
    t0 = time.perf_counter()
    w_state = w_prog.jit_make_state()(dec["components"])
    w_step = w_prog.jit().lower(params, w_state, None).compile()
    t1 = time.perf_counter()
    ahead: list = []  # as the stage loop: at most MAX_AHEAD steps in flight (a collective
    for _ in range(n_warmup):  # behind 32 more aborts XLA:CPU: runtime's note)
        w_state, wm = w_step(params, w_state, None)
        ahead.append(wm)
        if len(ahead) > MAX_AHEAD:
            jax.block_until_ready(ahead.pop(0))
    jax.block_until_ready(w_state)
    out.update(
        warmup_steps=n_warmup, warmup_compile_s=t1 - t0, warmup_run_s=time.perf_counter() - t1
    )

    # the SPD train step (the train stage's program, with and without donation)
    state = prog.jit_make_state()(w_state["components"], dec["ci_fns"], dec["sources"])
    batch = None
    if not prog.makes_own_batch:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, target.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1))
        batch = {"tokens": jax.device_put(tokens.astype(np.int32), prog.batch_shardings["tokens"])}
    t0 = time.perf_counter()
    step = prog.jit().lower(params, state, batch).compile()
    out["train_compile_s"] = time.perf_counter() - t0
    plain = prog.jit(donate=False).lower(params, state, batch).compile() if no_donation else None
    out["no_donation_compile_s"] = time.perf_counter() - t0 - out["train_compile_s"]
    state_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))

    def est_peak(compiled) -> float:
        m = compiled.memory_analysis()
        return float(
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )

    out["mem_peak_mib"] = est_peak(step) / 2**20
    out["mem_peak_no_donation_mib"] = est_peak(plain) / 2**20 if plain else None
    out["donation_saving_x"] = (est_peak(plain) - est_peak(step)) / state_bytes if plain else None
    t_run = time.perf_counter()
    before = donation.buffer_bytes_by_ptr(state)
    state, m = step(params, state, batch)
    out["donation_reuse"] = donation.reused_fraction(before, state)[0]
    for _ in range(2):  # warm up
        state, m = step(params, state, batch)
    jax.block_until_ready(state)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        ahead = []
        for _ in range(n_steps):
            state, m = step(params, state, batch)
            ahead.append(m)
            if len(ahead) > MAX_AHEAD:
                jax.block_until_ready(ahead.pop(0))
        jax.block_until_ready((state, m))
        best = min(best, (time.perf_counter() - t0) / n_steps)
    flops = measure.step_flops(step)
    peak = measure.peak_flops_per_device(jax.devices()[0], peak_tflops)
    out.update(
        step_ms=best * 1e3,
        samples_per_s=cfg.train.batch_size / best,
        tokens_per_s=None
        if prog.makes_own_batch
        else cfg.train.batch_size * cfg.data.seq_len / best,
        flops_per_device=flops,
        mfu=measure.mfu(flops, best, peak) if flops and peak else None,
        loss=float(m["loss"]),
        run_s=time.perf_counter() - t_run,
    )
    return out


def run_child(template: str, devices: str, n_steps: int, peak: float) -> dict:
    from pdctl.engine import runtime  # (imports no JAX: the parent never opens a device)

    env = _harness.child_env()  # this checkout, then the parent's PYTHONPATH (a TPU VM's JAX)
    if not runtime.accelerator_host():  # XLA:CPU simulates N devices; elsewhere the child
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        if devices != "default":  # takes the first N of the accelerator's devices
            flags.append(f"--xla_force_host_platform_device_count={devices}")
        env["XLA_FLAGS"] = " ".join(flags)
    argv = _harness.module_argv(__spec__.name, "--child", template, "--steps", n_steps)
    argv += ["--peak-tflops", str(peak), "--child-devices", devices]
    r = _harness.run_child(argv, what=f"{template} on {devices} devices", env=env)
    return {**r, "setting": devices}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30, help="timed train steps per window")
    ap.add_argument("--configs", nargs="+", default=["tms", "resid-mlp"])
    ap.add_argument(
        "--devices",
        nargs="+",
        default=["default", "1"],
        help="device counts to measure: 'default' (pdctl's choice) and/or numbers",
    )
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="one device's peak (MFU)")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-devices", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        from pdctl.engine import runtime

        runtime.cpu_xla_flags()  # pdctl's XLA:CPU flags, as every pdctl command has them
        if a.child_devices == "default":
            runtime.configure_devices()
        n = 0 if a.child_devices == "default" else int(a.child_devices)
        print(json.dumps(child(a.child, a.steps, a.peak_tflops, n)))
        return
    commit = _harness.git_commit()
    print(_harness.machine_line())
    rows = [run_child(c, d, a.steps, a.peak_tflops) for c in a.configs for d in a.devices]
    hdr = (
        f"{'config':<10} {'devices':>10} {'batch':>6} | {'compile s':>9} {'step ms':>8} "
        f"{'samples/s':>10} {'GFLOP/dev':>9} {'MFU':>6} | {'peak MiB':>9} {'no-don.':>9} "
        f"{'saved x':>7} {'reuse':>6} | {'warmup s':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
        gflop = f"{r['flops_per_device'] / 1e9:.2f}" if r["flops_per_device"] else "-"
        label = f"{r['setting']} ({r['devices']})"
        print(
            f"{r['config']:<10} {label:>10} "
            f"{r['batch']:>6} | {r['train_compile_s']:>9.2f} {r['step_ms']:>8.2f} "
            f"{r['samples_per_s']:>10.0f} {gflop:>9} {mfu:>6} | {r['mem_peak_mib']:>9.2f} "
            f"{r['mem_peak_no_donation_mib']:>9.2f} {r['donation_saving_x']:>7.2f} "
            f"{r['donation_reuse']:>6.3f} | {r['warmup_compile_s'] + r['warmup_run_s']:>8.2f}"
        )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"commit": commit, "rows": rows}, indent=2))
    slow = []
    for c in a.configs:
        mine = {r["setting"]: r for r in rows if r["config"] == c}
        if "default" in mine and len(mine) > 1:
            best = min(mine.values(), key=lambda r: r["step_ms"])
            ratio = mine["default"]["step_ms"] / best["step_ms"]
            print(
                f"{c}: default {mine['default']['step_ms']:.2f} ms vs best "
                f"{best['step_ms']:.2f} ms ({best['setting']} devices): {ratio:.2f}x"
            )
            if ratio > 1.05:
                slow.append(c)
    if slow:
        print(f"the default device count is not the fastest for: {', '.join(slow)}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
