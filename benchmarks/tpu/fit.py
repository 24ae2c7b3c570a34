"""Every MLP of SmolLM2-135M on one TPU v5e (issue 42): for each configuration, the train step
and the evaluation's programs compiled by XLA:TPU, their memory as the compiler states it, and
on a TPU chip the memory and time of real steps, in ONE table with predicted against measured.

The configurations (`CONFIGS`) are the smollm2-all-mlps template (90 sites, C = 1536, the LM
recipe, per-position PPGD sources, `scan_layers` on) with the memory keys set explicitly:
global batch, `grad_accum_steps`, `remat`, the dtype of Adam's first moments and of the PPGD
sources, and the evaluation's `eval_accum_steps`; 256 tokens per sequence, 16 evaluation
sequences.

- On a TPU chip: each configuration's programs are compiled for the chip (the same
  `StepProgram` and evaluation programs the train stage runs, `pdctl.inspect.fit`), then
  `--steps` real steps (after `--warmup-steps`) on random token ids (the step's time and memory
  do not depend on which tokens) with a state from the template's random init (nor on the
  values), then one evaluation of each kind, each configuration right after its compile (a
  run cut short keeps what it printed). Measured: ms per step, tokens/s, MFU (matmul FLOPs of
  the step's jaxpr, scans counted per iteration (`measure.matmul_flops`), over 197 TFLOP/s;
  XLA's `cost_analysis()` FLOPs beside it, which count a scan's body once), the device's
  peak: `peak_bytes_in_use` + `peak_bytes_reserved` (`measure.device_peak_bytes`: a TPU
  runtime reserves an executable's temporaries apart from the buffers in use). That peak is
  the process's maximum, so list configurations by increasing predicted peak (the default list
  is: the old setting, refused at compile; the template; 32 x 256); each row's measured peak
  is the maximum so far. The GGUF is read once.
- Anywhere else with `--device-kind tpu-v5e` (or `--topology v5e:1x1`): the predictions only,
  compiled by XLA:TPU for that topology from libtpu (`pip install -e ".[tpu-aot]"`).

    python -m benchmarks.tpu.fit [--gguf PATH] [--text PATH] [--configs NAME ...] [--steps 10]
        [--warmup-steps 2] [--no-eval] [--compile-cache DIR] [--device-kind tpu-v5e]
        [--topology v5e:1x1] [--json PATH]

`--gguf` / `--text` default to $PDCTL_SMOLLM2_GGUF / $PDCTL_TEXT (the text only fills `[data]
path`: nothing is tokenized). A benchmark, never a test: a configuration's programs take
minutes to compile on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import tomllib
from pathlib import Path

from benchmarks._harness import ROOT, machine_line

T0 = time.perf_counter()
GIB = 2**30
SEQ = 256
V5E_PEAK_TFLOPS = 197.0

# name: the [train] keys that decide the memory (everything else is the template's); "moments"
# and "sources": the storage of Adam's first moments (components, CI functions) and of the PPGD
# sources with their first moment
CONFIGS: dict[str, dict] = {
    # the template as it was, at 16 x 256: one batch, no remat, float32 state
    "b16": {"batch_size": 16, "grad_accum_steps": 1, "remat": "none", "moments": "float32",
            "sources": "float32", "eval_accum_steps": 1},
    "b16 k8 full": {"batch_size": 16, "grad_accum_steps": 8, "remat": "full",
                    "moments": "float32", "sources": "float32", "eval_accum_steps": 4},
    # the template now
    "b16 k8 full src-bf16": {"batch_size": 16, "grad_accum_steps": 8, "remat": "full",
                             "moments": "float32", "sources": "bfloat16", "eval_accum_steps": 4},
    "b16 k8 full all-bf16": {"batch_size": 16, "grad_accum_steps": 8, "remat": "full",
                             "moments": "bfloat16", "sources": "bfloat16", "eval_accum_steps": 4},
    "b32 k16 full src-bf16": {"batch_size": 32, "grad_accum_steps": 16, "remat": "full",
                              "moments": "float32", "sources": "bfloat16", "eval_accum_steps": 4},
    "b32 k32 full src-bf16": {"batch_size": 32, "grad_accum_steps": 32, "remat": "full",
                              "moments": "float32", "sources": "bfloat16", "eval_accum_steps": 4},
}  # fmt: skip
# Issue 49's speed variants of the template (b16 k8 full src-bf16) and the all-matrix template:
# each changes the keys named (merged into the config after the ones above).
_T = CONFIGS["b16 k8 full src-bf16"]
VARIANTS: dict[str, dict] = {
    # the masked / PPGD forwards' matmuls and activations in bfloat16 (faithfulness stays
    # float32: `pdctl.engine.precision`), the frozen target stored in bfloat16
    "b16 k8 full bf16": {"precision": {"compute_dtype": "bfloat16", "target_dtype": "bfloat16"}},
    "b16 k8 none bf16": {"remat": "none",
                         "precision": {"compute_dtype": "bfloat16", "target_dtype": "bfloat16"}},
    "b16 k8 dots bf16": {"remat": "dots_saveable",
                         "precision": {"compute_dtype": "bfloat16", "target_dtype": "bfloat16"}},
    "b16 k4 full bf16": {"grad_accum_steps": 4,
                         "precision": {"compute_dtype": "bfloat16", "target_dtype": "bfloat16"}},
    "b16 k4 none bf16": {"grad_accum_steps": 4, "remat": "none",
                         "precision": {"compute_dtype": "bfloat16", "target_dtype": "bfloat16"}},
    "b16 k2 full bf16": {"grad_accum_steps": 2,
                         "precision": {"compute_dtype": "bfloat16", "target_dtype": "bfloat16"}},
    "b16 k8 none": {"remat": "none"},
    "b16 k8 full unrolled": {"train": {"scan_layers": False}},
    "b16 k4 full bf16 unrolled": {"grad_accum_steps": 4, "train": {"scan_layers": False},
                                  "precision": {"compute_dtype": "bfloat16",
                                                "target_dtype": "bfloat16"}},
    # where the time goes: the step without its two PPGD warm-up ascents
    "b16 k8 full no-ascent": {"ppgd": {"n_warmup_steps": 0}},
    "b16 k8 full bf16 no-ascent": {"ppgd": {"n_warmup_steps": 0},
                                   "precision": {"compute_dtype": "bfloat16",
                                                 "target_dtype": "bfloat16"}},
    # the candidate template of issue 49: no warm-up ascents, bfloat16, 4 (or 2) micro-batches;
    # and it unrolled (scan against unrolled on the chip)
    "b16 k4 full bf16 no-ascent": {"grad_accum_steps": 4, "ppgd": {"n_warmup_steps": 0},
                                   "precision": {"compute_dtype": "bfloat16",
                                                 "target_dtype": "bfloat16"}},
    "b16 k2 full bf16 no-ascent": {"grad_accum_steps": 2, "ppgd": {"n_warmup_steps": 0},
                                   "precision": {"compute_dtype": "bfloat16",
                                                 "target_dtype": "bfloat16"}},
    "b16 k4 full bf16 no-ascent unrolled": {"grad_accum_steps": 4, "ppgd": {"n_warmup_steps": 0},
                                            "train": {"scan_layers": False},
                                            "precision": {"compute_dtype": "bfloat16",
                                                          "target_dtype": "bfloat16"}},
    # the warm-up ascents on the merged term's adversarial examples only (issue 49: the
    # ascents were 46% of the step): as shipped otherwise, and with bfloat16 and 4 micro-batches
    "b16 k8 full assigned": {"ppgd": {"ascent_examples": "assigned"}},
    "b16 k4 full bf16 assigned": {"grad_accum_steps": 4, "ppgd": {"ascent_examples": "assigned"},
                                  "precision": {"compute_dtype": "bfloat16",
                                                "target_dtype": "bfloat16"}},
    # every matrix (templates/smollm2-all), as shipped and in bfloat16
    "all": {"template": "smollm2-all"},
    "all bf16": {"template": "smollm2-all",
                 "precision": {"compute_dtype": "bfloat16", "target_dtype": "bfloat16"}},
}  # fmt: skip
for _name, _over in VARIANTS.items():
    CONFIGS[_name] = {**_T, **_over}
# on a chip (~8 minutes): the old setting (refused at compile), the template, 32 x 256
DEFAULT = ["b16", "b16 k8 full src-bf16", "b32 k32 full src-bf16"]


def config_for(name: str, args: argparse.Namespace):
    from pdctl.config import parse_config

    c = CONFIGS[name]
    template = c.get("template", "smollm2-all-mlps")
    raw = tomllib.loads((ROOT / "templates" / template / "pdctl.toml").read_text())
    raw["target"]["path"] = str(Path(args.gguf).resolve())
    raw["data"]["path"] = str(Path(args.text).resolve())
    raw["data"]["seq_len"] = SEQ
    raw["mesh"] = {"data": 1, "fsdp": 1}
    t = raw["train"]
    for k in ("batch_size", "grad_accum_steps", "remat", "eval_accum_steps"):
        t[k] = c[k]
    t["eval_batch_size"] = 16
    t.setdefault("optim", {})["moments_dtype"] = c["moments"]
    t.setdefault("ci_optim", {})["moments_dtype"] = c["moments"]
    t.setdefault("ppgd", {})["dtype"] = c["sources"]
    t["ppgd"].update(c.get("ppgd", {}))
    t.update(c.get("train", {}))
    raw.setdefault("precision", {}).update(c.get("precision", {}))
    return parse_config(raw)


def step_flops(p) -> float:
    """Matmul FLOPs of one train step (its jaxpr, scans counted per iteration)."""
    import jax

    from pdctl.engine.measure import matmul_flops

    prog = p.program
    return matmul_flops(jax.make_jaxpr(prog.policy.scoped(prog.step))(*prog.abstract_args()))


class Fit:
    """One configuration: its plan, compiled programs and the fit check's rows."""

    def __init__(self, name: str, args, devices, budget, compiler: str, eval_cache: dict):
        from pdctl.engine import measure, sharding
        from pdctl.inspect import array_rows, fit, plan

        self.name, self.spec = name, CONFIGS[name]
        self.cfg = cfg = config_for(name, args)
        mesh = sharding.mesh_from_config(cfg.mesh, devices[:1])
        self.p = p = plan(cfg, "train", mesh)
        rows = array_rows(p)
        step = fit.compile_or_oom("the train step", lambda: p.program.lower().compile())
        self.compiled = {"train step": step}
        if not args.no_eval:
            tc = cfg.train
            for prog, lowered in fit.eval_programs(p).items():
                # the evaluation's programs depend on its settings, not on the train batch
                # (and the CI program not on eval_accum_steps)
                accum = tc.eval_accum_steps if prog != "eval: CI" else None
                key = (prog, tc.eval_batch_size, accum, cfg.precision.eval_matmul)
                if key not in eval_cache:
                    eval_cache[key] = fit.compile_or_oom(prog, lowered.compile)
                self.compiled[prog] = eval_cache[key]
        self.check = fit.check(p, self.compiled, budget, rows, compiler)
        self.flops = step_flops(p)
        self.xla_flops = measure.step_flops(step[0]) if step[0] is not None else None
        self.peak = self.check["peak_bytes"]
        self.measured: dict = {}

    # ---- on a chip ------------------------------------------------------------------------
    def run(self, args, params_cache: dict) -> None:
        """Real steps and evaluations on the chip: ms per step, the device's peak after them."""
        import jax
        import numpy as np

        from pdctl.engine import measure
        from pdctl.science.targets import imported
        from pdctl.stages.init_weights import init_decomposition
        from pdctl.stages.inputs import (
            STREAM_DECOMP,
            STREAM_TRAIN,
            stream_key,
            target_from_config,
        )

        step = self.compiled["train step"][0]
        if step is None:
            return
        cfg, prog, dev = self.cfg, self.p.program, jax.devices()[0]
        target = target_from_config(cfg)
        key = ("params", str(target.param_dtype))  # a bfloat16 target_dtype: another copy
        if key not in params_cache:
            for other in [k for k in params_cache if isinstance(k, tuple)]:  # one copy at a time
                del params_cache[other]
            t = time.perf_counter()
            params_cache[key] = imported.load(
                target, prog.frozen_shardings[0], dtype=target.param_dtype
            )
            params_cache["load_s"] = time.perf_counter() - t
        params = params_cache[key]
        dec, _ = init_decomposition(cfg, self.p.target, prog.mesh, stream_key(cfg, STREAM_DECOMP))
        state = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
        del dec
        rng = np.random.default_rng(0)
        vocab = int(self.p.target.spec.vocab_size)

        def tokens(n: int):
            return rng.integers(0, vocab, size=(n, SEQ + 1), dtype=np.int32)

        batch = jax.device_put({"tokens": tokens(cfg.train.batch_size)}, prog.batch_shardings)
        for _ in range(args.warmup_steps):
            state, m = step(params, state, batch)
        jax.block_until_ready(state)
        t = time.perf_counter()
        for _ in range(args.steps):
            state, m = step(params, state, batch)
        jax.block_until_ready(state)
        ms = (time.perf_counter() - t) / max(args.steps, 1) * 1e3
        self.measured["ms"] = ms
        if args.profile and args.profile_config in (None, self.name):
            self.measured["profile"] = profile_ops(step, params, state, batch, args.profile)
            state = self.measured["profile"].pop("state")
        self.measured["loss"] = float(jax.device_get(m["loss"]))
        self.measured["peak_after_steps"] = measure.device_peak_bytes([dev])
        self.measured["stats_after_steps"] = dev.memory_stats()
        if len(self.compiled) > 1:
            trainable = state["trainable"]
            ev = tokens(cfg.train.eval_batch_size)
            x, labels = jax.device_put(ev[:, :-1]), jax.device_put(ev[:, 1:])
            t = time.perf_counter()
            ci = self.compiled["eval: CI"][0]
            if ci is not None:
                jax.block_until_ready(ci(params, trainable["components"], trainable["ci_fns"], x))
            lm = self.compiled.get("eval: masked forwards", (None,))[0]
            if lm is not None:
                key = stream_key(cfg, STREAM_TRAIN)
                out = lm(params, trainable["components"], trainable["ci_fns"], x, labels, key)
                self.measured["kl_pgd"] = float(jax.device_get(out.get("kl/pgd", np.nan)))
            self.measured["eval_s"] = time.perf_counter() - t
            self.measured["peak_after_eval"] = measure.device_peak_bytes([dev])
            self.measured["stats_after_eval"] = dev.memory_stats()
        del state, batch
        gc.collect()


def profile_ops(step, params, state, batch, n: int, top: int = 25) -> dict:
    """`n` steps under `jax.profiler`, the device's op time summed by op name (the trace's
    "XLA Ops" line of the TPU plane): where the step's time goes."""
    import collections
    import glob
    import tempfile

    import jax

    d = tempfile.mkdtemp(prefix="pdctl-prof-")
    jax.block_until_ready(state)
    with jax.profiler.trace(d):
        for _ in range(n):
            state, _m = step(params, state, batch)
        jax.block_until_ready(state)
    (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    by_op: dict[str, float] = collections.defaultdict(float)
    by_cat: dict[str, float] = collections.defaultdict(float)
    example: dict[str, str] = {}
    total = 0.0
    for plane in data.planes:
        if not plane.name.startswith("/device:TPU:0"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for ev in line.events:
                dur = ev.duration_ns / 1e6 / n
                by_op[ev.name] += dur
                total += dur
                stats = dict(ev.stats)
                if ev.name not in example:
                    example[ev.name] = " ".join(
                        f"{k}={str(v)[:80]}" for k, v in stats.items() if not k.startswith("_")
                    )
                by_cat[str(stats.get("hlo_category", stats.get("category", "?")))] += dur
    ops = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    print(f"# profile: {total:.1f} ms of device ops a step ({n} steps traced)")
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1])[:12]:
        print(f"#   category {cat}: {ms:.1f} ms ({ms / max(total, 1e-9):.1%})")
    for name, ms in ops:
        print(f"#   {ms:8.2f} ms  {name[:60]}  [{example.get(name, '')[:300]}]")
    return {"state": state, "device_ms": total, "categories": dict(by_cat), "top_ops": ops}


def g(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def table(fits: list[Fit], real: bool) -> str:
    head = (
        "| config | tokens / step (accum, remat, state dtypes; eval accum) | program | compile s "
        "| arguments "
        "| outputs | temporaries | aliased | state held | predicted peak GiB | fit (margin) |"
    )
    sep = "|---" * 11 + "|"
    if real:
        head += " measured peak GiB | predicted / measured | ms / step | tokens/s | MFU |"
        sep += "---|" * 5
    lines = [head, sep]
    for f in fits:
        s = f.spec
        bf = {"float32": "f32", "bfloat16": "bf16"}
        tc = f.cfg.train
        tokens = tc.batch_size * f.cfg.data.seq_len
        shape = (
            f"{tc.batch_size} x {f.cfg.data.seq_len} (k {tc.grad_accum_steps}, {tc.remat}, moments "
            f"{bf[s['moments']]}, sources {bf[s['sources']]}; eval k {tc.eval_accum_steps})"
        )
        budget = f.check["budget_bytes"]
        for q in f.check["programs"]:
            peak = q.get("peak_bytes")
            if "oom" in q:
                cells = ["-", "-", f">= {g(q['peak_bytes'] - q['held_bytes'])}", "-"]
                verdict = "refused"
            else:
                cells = [g(q.get(k)) for k in ("argument_bytes", "output_bytes", "temp_bytes",
                                               "alias_bytes")]  # fmt: skip
                verdict = f"{'fits' if peak <= budget else 'NO'} ({g(budget - peak)})"
            row = [f.name, shape, q["program"], f"{q['compile_s']:.0f}", *cells,
                   g(q["held_bytes"]), ("> " if "oom" in q else "") + g(peak), verdict]  # fmt: skip
            if real:
                m = f.measured
                train = q["program"] == "train step"
                key = "peak_after_steps" if train else "peak_after_eval"
                got = m.get(key)
                ratio = f"{peak / got:.3f}" if got and "oom" not in q else "-"
                if train and "ms" in m:
                    tok = tokens / m["ms"] * 1e3
                    mfu = f.flops / (m["ms"] / 1e3) / (V5E_PEAK_TFLOPS * 1e12)
                    row += [g(got), ratio, f"{m['ms']:.1f}", f"{tok:,.0f}", f"{mfu:.3f}"]
                else:
                    row += [g(got), ratio, "-", "-", "-"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.environ.get("PDCTL_SMOLLM2_GGUF"))
    ap.add_argument("--text", default=os.environ.get("PDCTL_TEXT", "/usr/share/games/fortunes"))
    ap.add_argument("--configs", nargs="+", default=DEFAULT, choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--no-eval", action="store_true", help="the train step only")
    ap.add_argument("--compile-cache", help="XLA's persistent compilation cache directory")
    ap.add_argument("--device-kind", help="without a TPU chip: compile for this kind (tpu-v5e)")
    ap.add_argument("--topology", help="without a TPU chip: compile for this slice (v5e:1x1)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--profile", type=int, default=0, help="trace this many steps after timing")
    ap.add_argument("--profile-config", help="profile only this configuration")
    args = ap.parse_args()
    if not args.gguf:
        sys.exit("--gguf PATH (or PDCTL_SMOLLM2_GGUF) is required")
    print(f"# {machine_line()}", flush=True)

    import jax

    from pdctl.engine import runtime
    from pdctl.inspect import fit, topology

    runtime.configure_devices()  # libtpu without chips (the tpu-aot extra): the CPU is JAX's

    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    real = jax.devices()[0].platform == "tpu"
    if real:
        devices = jax.devices()[:1]
        dev = devices[0]
        limit = (dev.memory_stats() or {}).get("bytes_limit") or fit.DEVICE_MEMORY["tpu-v5e"]
        budget = (int(limit), f"{dev.device_kind}, {limit / GIB:.2f} GiB")
        compiler = f"XLA:TPU on {dev.device_kind}"
        print(f"# {dev.device_kind}, jax {jax.__version__}; HBM limit {limit / GIB:.2f} GiB")
    else:
        topo, _ = topology.target(args.topology, args.device_kind or "tpu-v5e", None)
        if topo is None:
            sys.exit('no TPU here and no libtpu to compile for one: pip install -e ".[tpu-aot]"')
        devices, budget = topology.devices(topo), topo.budget
        compiler = f"XLA:TPU {topo.name} (AOT, libtpu)"
        print(f"# no TPU chip: predictions only, compiled for {topo.name} by libtpu", flush=True)
    fits, eval_cache, params = [], {}, {}
    for name in args.configs:
        t = time.perf_counter()
        f = Fit(name, args, devices, budget, compiler, eval_cache)
        fits.append(f)
        xla = f"{f.xla_flops / 1e12:.2f}" if f.xla_flops else "-"
        print(
            f"# {name}: compiled in {time.perf_counter() - t:.0f} s; predicted peak "
            f"{g(f.peak)} GiB (worst: {f.check['worst']}); step matmul FLOPs "
            f"{f.flops / 1e12:.2f} T (XLA cost_analysis: {xla} T); "
            f"at {time.perf_counter() - T0:.0f} s",
            flush=True,
        )
        if not real:
            continue
        # each configuration runs as soon as it has compiled, so that a run cut short keeps
        # what it measured; the device's peak is the process's maximum: list configurations
        # by increasing predicted peak (the default list is)
        if any(e.peak > f.peak for e in fits[:-1] if e.measured):
            print(f"# {name}: an earlier configuration's peak was higher: its measured peak is "
                  "that maximum")  # fmt: skip
        t = time.perf_counter()
        f.run(args, params)
        m = f.measured
        tok = f.cfg.train.batch_size * f.cfg.data.seq_len
        rate = f"{tok / m['ms'] * 1e3:,.0f} tokens/s, " if "ms" in m else ""
        print(
            f"# {f.name}: ran in {time.perf_counter() - t:.0f} s; {m.get('ms', 0):.1f} ms "
            f"a step, {rate}peak {g(m.get('peak_after_steps'))} / after eval "
            f"{g(m.get('peak_after_eval'))} GiB; at {time.perf_counter() - T0:.0f} s",
            flush=True,
        )
    if "load_s" in params:
        print(f"# GGUF read in {params['load_s']:.0f} s")
    print()
    print(table(fits, real))
    print(f"\n# {compiler}; budget {budget[1]}; wall {time.perf_counter() - T0:.0f} s")
    if args.json:
        out = [
            {
                "config": f.name,
                **f.spec,
                "check": f.check,
                "flops": f.flops,
                "xla_flops": f.xla_flops,
                "measured": f.measured,
            }
            for f in fits
        ]
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
