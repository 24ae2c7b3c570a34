"""Where the SPD train step spends its time: a per-term cost table and a jax.profiler trace.

Per-term table: the step of the unmodified template, then the same step with one loss term's
coefficient set to 0 (a term with coefficient 0 is not computed), then with every CI-based term
off (faithfulness only: the clean forward, the optimizer and the loop counters). The difference
to the full step is what the term costs, its backward through the CI functions included.

Trace: 10 steps under `jax.profiler.trace` (a Perfetto trace under --trace DIR, viewable in
ui.perfetto.dev), and the table of the XLA ops that took the most time per step.

    python -m benchmarks.toys.spd_profile --template tms [--trace /tmp/tms-trace] [--steps 10]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import tempfile
import time
import tomllib
from pathlib import Path

import jax

from benchmarks._harness import machine_line
from pdctl.config import parse_config
from pdctl.engine import runtime, sharding
from pdctl.stages import train
from pdctl.stages.init_weights import init_decomposition
from pdctl.stages.inputs import STREAM_DECOMP, STREAM_TARGET, stream_key, target_from_config
from pdctl.templates import templates_root

TERMS = ("importance_minimality", "stochastic_recon", "stochastic_recon_layerwise")


def build(template: str, loss: dict):
    """The train stage's program for the template with `loss` overrides: params, a fresh state
    and the jitted (donating) step."""
    raw = tomllib.loads((templates_root() / template / "pdctl.toml").read_text())
    raw["train"]["loss"].update(loss)
    cfg = parse_config(raw)
    mesh = sharding.make_mesh(-1, 1)
    target = target_from_config(cfg)
    prog = train.program(cfg, mesh, target)
    (abstract, shardings) = prog.frozen_abstract[0], prog.frozen_shardings[0]
    params = jax.jit(target.init, out_shardings=shardings)(stream_key(cfg, STREAM_TARGET))
    del abstract
    dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
    state = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
    return params, state, prog.jit()


def step_ms(template: str, loss: dict, n: int) -> float:
    params, state, step = build(template, loss)
    for _ in range(3):
        state, _ = step(params, state, None)
    jax.block_until_ready(state)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            state, _ = step(params, state, None)
        jax.block_until_ready(state)
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e3


def trace(template: str, directory: Path, n: int) -> list[tuple[str, float]]:
    params, state, step = build(template, {})
    for _ in range(3):
        state, _ = step(params, state, None)
    jax.block_until_ready(state)
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        for _ in range(n):
            state, _ = step(params, state, None)
        jax.block_until_ready(state)
    return top_ops(directory, n)


def top_ops(directory: Path, n: int, k: int = 15) -> list[tuple[str, float]]:
    """The XLA ops that took the most ms per step in the jax.profiler trace of n steps under
    `directory` (also used by benchmarks/lm/step.py)."""
    path = next(directory.rglob("*.trace.json.gz"))
    totals: collections.Counter = collections.Counter()
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    for e in events:
        name = e.get("name", "")
        # XLA's own ops (fusions, dots, copies); not the Python frames or executor spans
        if e.get("ph") == "X" and "dur" in e and not name.startswith(("$", "Thunk", "Pjit")):
            totals[name] += e["dur"] / n / 1e3
    return totals.most_common(k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--template", default="tms")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--trace", type=Path, help="keep the Perfetto trace here")
    a = ap.parse_args()
    print(machine_line())
    runtime.cpu_xla_flags()  # pdctl's XLA:CPU flags, as every pdctl command has them
    runtime.configure_devices()
    print(f"{a.template}: {jax.device_count()} devices (data parallel), train step ms per term")
    full = step_ms(a.template, {}, a.steps)
    print(f"  full step                                  {full:8.2f} ms")
    for term in TERMS:
        ms = step_ms(a.template, {term: 0.0}, a.steps)
        print(f"  without {term:<30} {ms:8.2f} ms   term costs {full - ms:7.2f} ms")
    base = step_ms(a.template, {**dict.fromkeys(TERMS, 0.0), "faithfulness": 1.0}, a.steps)
    print(f"  no CI-based term (faithfulness only) {base:8.2f} ms   the rest {full - base:7.2f}")
    directory = a.trace or Path(tempfile.mkdtemp(prefix="pdctl-trace-"))
    print(f"XLA ops by time per step (trace in {directory}):")
    for name, ms in trace(a.template, directory, a.steps):
        print(f"  {ms:7.3f} ms  {name}")


if __name__ == "__main__":
    main()
