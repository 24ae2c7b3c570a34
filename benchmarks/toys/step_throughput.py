"""Pretrain step throughput of every template, and the overhead of the engine's `Loop`.

For each template (tiny-but-realistic sizes, one device by default) it builds the pretrain
step exactly as `pdctl pretrain` does (`pdctl.stages.pretrain.program`, donating,
sharded) and measures, in one run:

  direct   the compiled step called back to back, the host at most MAX_AHEAD steps ahead of
           the devices (as in the Loop; without that bound 2+ CPU devices deadlock XLA:CPU)
  loop     the real `pdctl.engine.loop.Loop` (donation check, transfer guard, logging only at
           the end of each window, the LM's batches from the real prefetching text pipeline)

Each is timed over windows of N steps after warm-up, in `--repeats` interleaved rounds; the best
window of each kind is kept (robust to other load on the machine).
`overhead = loop / direct` (target <= 1.05).

    python -m benchmarks.toys.step_throughput [--devices 4] [--seconds 0.5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks._harness import machine_line

ROOT = Path(__file__).resolve().parents[2]

# Template -> config overrides (tiny but realistic: the real architectures, small widths/batch).
SIZES = {
    "tms": {},  # the template itself: TMS 5-2, batch 1024
    "resid-mlp": {"pretrain": {"batch_size": 256}},  # 100 features, d_embed 1000, d_mlp 50
    "llama-mlp": {  # the template's 2-layer d_model 64 LM, seq 64; batch 16
        "pretrain": {"batch_size": 16},
        "data": {"synthetic_bytes": 400_000},
    },
}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--devices", type=int, default=1,
        help="devices on the data axis (on CPU simulated with XLA's host-device flag)",
    )  # fmt: skip
    ap.add_argument("--seconds", type=float, default=0.5, help="target length of one window")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (best kept)")
    ap.add_argument("--templates", nargs="*", default=list(SIZES))
    return ap.parse_args()


def main() -> None:
    args = _args()
    from pdctl.engine import runtime

    # XLA:CPU simulates the devices; a GPU or TPU host has its own (the first N are used)
    if (
        args.devices > 1
        and not runtime.accelerator_host()
        and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
    ):
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

    import jax

    from pdctl.engine import sharding
    from pdctl.stages.env import text_batches
    from pdctl.testing.runs import make_loop, make_run, pretrain_on  # what the tests build it with

    devices = jax.devices()[: args.devices]
    mesh = sharding.make_mesh(len(devices), 1, devices)
    print(machine_line())
    kind = devices[0].device_kind
    print(f"jax {jax.__version__}, {jax.default_backend()}: {len(devices)} x {kind}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for template in args.templates:
            run = make_run(Path(tmp), template, tiny=False, **SIZES[template])
            rows.append(_bench(template, run, mesh, args, make_loop, pretrain_on, text_batches))
        empty = _empty_step(mesh, args, make_loop)
    _table(rows)
    cost_us = empty[1] - empty[0]
    print(
        f"Loop's own cost per step (an empty step): {cost_us:+.1f} us "
        f"(direct dispatch {empty[0]:.1f} us/step, in the Loop {empty[1]:.1f} us/step)"
    )
    print(
        "  so loop / direct from that cost alone: "
        + ", ".join(
            f"{r['template']} {1 + max(cost_us, 0) / (r['direct_ms'] * 1e3):.4f}" for r in rows
        )
    )


def _bench(template, run, mesh, args, make_loop, pretrain_on, text_batches) -> dict:
    import jax

    pt = pretrain_on(run, mesh, total=10**6)
    cfg = pt.cfg
    bs = cfg.pretrain.batch_size

    # Compile once: `direct` and every Loop below run this same executable.
    state = pt.init_state()
    batch = pt.batch(0)
    t0 = time.perf_counter()
    step = pt.step_fn().lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    state, _ = _direct(step, state, batch, 3)
    t0 = time.perf_counter()
    state, _ = _direct(step, state, batch, 5)
    n = max(10, int(args.seconds / ((time.perf_counter() - t0) / 5)))

    # Rounds of: one direct window (back to back, one sync at the end), then a real Loop run
    # of 2 windows (log_every = n, each timed by the Loop itself: `step_ms`, which ends with
    # its device_get) fed the same device batch, so the ratio is the Loop's own overhead; the
    # LM then also runs a Loop on its real prefetching text pipeline. Interleaving the rounds
    # and keeping the best window of each kind makes the ratio robust to a busy machine.
    direct, looped, piped = [], [], []
    same = itertools.repeat(batch) if pt.is_text else None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state, _ = _direct(step, state, batch, n)
        direct.append((time.perf_counter() - t0) / n)
        looped += _loop_windows(pt, step, n, same, make_loop)
        if pt.is_text:
            batches = text_batches(pt.env, bs, seed=cfg.run.seed, state=None, sharding=pt.batch_sh)
            try:
                piped += _loop_windows(pt, step, n, batches, make_loop)[1:]  # after its warm-up
            finally:
                batches.close()
    del state

    t_direct, t_loop = min(direct), min(looped)
    tokens = bs * pt.target.n_tokens_per_example() if pt.is_text else 0
    params = sum(x.size for x in jax.tree.leaves(pt.abstract_params))
    return {
        "template": template,
        "params": params,
        "batch": bs,
        "steps": n,
        "compile_s": compile_s,
        "direct_ms": t_direct * 1e3,
        "loop_ms": t_loop * 1e3,
        "steps_per_s": 1 / t_direct,
        "samples_per_s": bs / t_direct,
        "tokens_per_s": tokens / t_direct if tokens else None,
        "overhead": t_loop / t_direct,
        "pipeline": min(piped) / t_direct if piped else None,
        "spread": (max(direct) / t_direct, max(looped) / t_loop),
    }


def _direct(step, state, batch, n):
    """`n` calls of the compiled `step` back to back, the host at most MAX_AHEAD steps ahead of
    the devices as in the Loop (each call waits on the metrics of the step MAX_AHEAD behind):
    unbounded, a multi-device CPU mesh deadlocks XLA:CPU's collective rendezvous
    (tests/engine/test_rendezvous.py). Returns (state, metrics) of the last step, ready."""
    import collections

    import jax

    from pdctl.engine.loop import MAX_AHEAD

    behind = collections.deque()
    for _ in range(n):
        state, m = step(state, batch)
        behind.append(m)
        if len(behind) > MAX_AHEAD:
            jax.block_until_ready(behind.popleft())
    jax.block_until_ready((state, m))
    return state, m


def _empty_step(mesh, args, make_loop) -> tuple[float, float]:
    """(direct, Loop) microseconds per step of a step that does nothing but count: the Loop's
    absolute per-step cost, free of any model's noise."""
    import jax

    from pdctl.engine.loop import loop_counters

    def step(state, batch):
        loop = state["loop"]
        metrics = {"loss": loop["step"] * 0.0, "max_bad_run": loop["max_bad_run"]}
        return {"loop": {**loop, "step": loop["step"] + 1}}, metrics

    init = jax.jit(lambda: {"loop": loop_counters(jax.random.PRNGKey(0))})
    compiled = jax.jit(step, donate_argnums=0).lower(init(), None).compile()
    n, direct, looped = 20000, [], []
    for _ in range(args.repeats):
        state = init()
        t0 = time.perf_counter()
        state, _ = _direct(compiled, state, None, n)
        direct.append((time.perf_counter() - t0) / n)
        with tempfile.TemporaryDirectory() as d:
            loop, _, _ = make_loop(Precompiled(compiled), init(), Path(d), total=2 * n, log_every=n)
            loop.run()
            lines = (Path(d) / "metrics.jsonl").read_text().splitlines()
        looped += [json.loads(x)["step_ms"] / 1e3 for x in lines]
    return min(direct) * 1e6, min(looped) * 1e6


class Precompiled:
    """Hands the Loop an executable compiled once (the Loop calls `.lower(...).compile()`)."""

    def __init__(self, compiled):
        self.compiled = compiled

    def lower(self, *args):
        return self

    def compile(self):
        return self.compiled


def _loop_windows(pt, step, n, batches, make_loop, windows: int = 2) -> list[float]:
    """Seconds per step of each window of a real `Loop` run."""
    with tempfile.TemporaryDirectory() as d:
        loop, echoed, _ = make_loop(
            Precompiled(step),
            pt.init_state(),
            Path(d),
            total=n * windows,
            log_every=n,
            batches=batches,
        )
        loop.run()
        lines = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    assert not echoed, echoed  # no DONATION FAILED
    return [r["step_ms"] / 1e3 for r in lines]


def _table(rows: list[dict]) -> None:
    head = (
        f"{'template':<10} {'params':>8} {'batch':>6} {'N':>5} {'compile s':>9} "
        f"{'step ms':>9} {'steps/s':>9} {'samples/s':>11} {'tokens/s':>10} "
        f"{'loop ms':>9} {'loop/direct':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        tok = f"{r['tokens_per_s']:>10.3g}" if r["tokens_per_s"] else f"{'-':>10}"
        print(
            f"{r['template']:<10} {r['params']:>8,} {r['batch']:>6} {r['steps']:>5} "
            f"{r['compile_s']:>9.2f} {r['direct_ms']:>9.3f} {r['steps_per_s']:>9.1f} "
            f"{r['samples_per_s']:>11.4g} {tok} {r['loop_ms']:>9.3f} {r['overhead']:>11.3f}"
        )
    print()
    worst = max(r["overhead"] for r in rows)
    verdict = "OK" if worst <= 1.05 else "ABOVE TARGET"
    print(f"loop overhead (loop / direct per step): worst {worst:.3f}, target <= 1.05: {verdict}")
    for r in rows:
        a, b = r["spread"]
        print(
            f"  {r['template']:<10} {r['overhead']:.3f}  (window spread: direct x{a:.2f}, "
            f"loop x{b:.2f}; best of each kept)"
        )
    for r in rows:
        if r["pipeline"]:
            print(
                f"{r['template']}: Loop on the real prefetching text pipeline / direct = "
                f"{r['pipeline']:.3f} (host batching and transfers included)"
            )


if __name__ == "__main__":
    main()
