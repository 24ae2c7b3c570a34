"""The SmolLM2 layer-15 train step on one TPU chip, before and after, in ONE process (issue 41
items 1 and 4): step ms, tokens/s and MFU per arm, measured in interleaved timing windows.

SmolLM2-135M-Instruct from its GGUF (loaded once), the MLP of one layer (gate / up / down), one
device, `--batch` x `--seq` tokens a step, real text (Debian's fortunes). An arm is a recipe and
modifiers, `RECIPE[+MOD...]` or an alias:

    recipes   template   the smollm2 template as shipped (merged_recon, per-position PPGD with
                         2 warm-up ascents, C = 1536, smooth-L0, frequency term)
              edbbc41    the template's losses at edbbc41, where issue 41 measured 68.5 ms
                         (subset recon only, C = 1024, no PPGD)
    modifiers fdefault   faithfulness's V @ U at the default matmul precision (pdctl before the
                         precision policy: one bf16 pass on a TPU)
              noskip     no prefix skip: every masked forward runs from the embedding
              tbf16      the frozen target stored in bfloat16 (`[precision] target_dtype`)
              cbf16      `[precision] compute_dtype = "bfloat16"` (activations in bfloat16)
              unroll     the PPGD warm-up ascents unrolled (`[train.ppgd] unroll`)
    aliases   before      edbbc41+fdefault+noskip (what issue 41 timed at edbbc41: 68.5 ms)
              policy-old  edbbc41+noskip (before with the precision policy alone: the pair
                          for the issue's 5% criterion)
              default     template+fdefault (the 5% pair on the template, with `policy`)
              policy      template (as shipped: the policy, the prefix skip)
              after       template+tbf16+unroll+cbf16 (every opt-in option measured here)
              after-f32   template+tbf16+unroll (those that keep float32 activations)

Default arms: before policy-old policy after. Every arm's train step, and the evaluation of
each `--eval-arms` arm (default: policy; the masked forwards at `[precision] eval_matmul`,
fresh-PGD off), is lowered first (one at a time: the modifiers patch module functions while
tracing), then all compile at once in threads (XLA releases the GIL) while the GGUF loads,
the text is tokenized and the states are made: each program once. Then one step per arm (its
first-step metrics), the evaluations (unmasked / CI-masked KL of the template's aligned
init, V U = W), a warm window per arm, and `--windows` interleaved timing windows of `--steps`
steps (best of them; `--deadline-s` stops adding windows), plus, for `--sync-arm`, windows
reading the loss after every step (what one host sync per step costs; pdctl's loop reads
nothing between logging points). MFU is XLA's FLOPs over `--peak-tflops`; XLA counts a loop's
body once, so a rolled PPGD warm-up takes the count of an unrolled arm of the same recipe
(marked +). Printed: the table, the step ratios of `RATIOS` whose arms ran, the phase times.

    python -m benchmarks.tpu.step [--arms before policy-old policy after] [--gguf PATH]
        [--text DIR] [--batch 32] [--seq 256] [--layer 15] [--steps 10] [--windows 4]
        [--compile-cache DIR] [--deadline-s S] [--json OUT.json]

`--aot TOPOLOGY` (e.g. v5e:1x1; needs libtpu, no chip) compiles each arm with XLA:TPU for that
topology and prints XLA's FLOPs, bytes accessed and memory per step instead, with the FLOP
floor against `--peak-tflops` (and the bytes at `--hbm-gbs`, not a floor: XLA counts VMEM-held
operands too); no weights are read.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python -m benchmarks.tpu.step --aot v5e:1x1 --arms ...
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from benchmarks._harness import git_commit

# The template's losses at edbbc41 (templates/smollm2/pdctl.toml there): what replaces today's.
EDBBC41 = """
[decomp]
sites = [{ pattern = "model.layers.15.mlp.*", C = 1024 }]
delta_component = true
sigmoid = "leaky_hard"
sampling = "continuous"
n_mask_samples = 1
ci_threshold = 0.0
[decomp.ci_fn]
type = "shared_mlp"
hidden = [128]
[warmup]
steps = 1000
lr = 0.002
weight_decay = 0.0
log_every = 50
[train.optim]
lr = 1e-3
schedule = "cosine"
warmup_frac = 0.0
final_lr_frac = 0.1
grad_clip = 0.01
[train.ci_optim]
lr = 1e-3
schedule = "cosine"
final_lr_frac = 0.1
[train.loss]
faithfulness = 1e7
importance_minimality = 5e-4
p = 2.0
p_final = 0.4
beta = 0.5
stochastic_recon = 0.0
stochastic_recon_layerwise = 0.0
stochastic_recon_subset = 1.0
subset_routing = "uniform_k"
ppgd_recon = 0.0
output = "kl"
"""
RECIPES = ("template", "edbbc41")
MODS = ("fdefault", "noskip", "tbf16", "cbf16", "unroll")
ALIASES = {
    "before": "edbbc41+fdefault+noskip",
    "policy-old": "edbbc41+noskip",
    "default": "template+fdefault",
    "policy": "template",
    "after": "template+tbf16+unroll+cbf16",
    "after-f32": "template+tbf16+unroll",
}
# (numerator, denominator, what the ratio of their steps answers)
RATIOS = (
    ("policy-old", "before", "the precision policy's cost, edbbc41's recipe (criterion <= 1.05)"),
    ("policy", "default", "the precision policy's cost, the template (criterion <= 1.05)"),
    ("policy", "before", "the template as shipped against edbbc41's step"),
    ("after", "policy", "the opt-in options against the template as shipped"),
    ("after-f32", "policy", "the float32 opt-in options against the template as shipped"),
    ("after", "before", "after against before"),
)


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    recipe: str
    mods: frozenset[str]

    @classmethod
    def parse(cls, name: str) -> Arm:
        recipe, *mods = ALIASES.get(name, name).split("+")
        if recipe not in RECIPES or not set(mods) <= set(MODS):
            sys.exit(
                f"--arms: {name!r} is not RECIPE[+MOD...] (recipes {', '.join(RECIPES)}; "
                f"modifiers {', '.join(MODS)}) or one of {', '.join(ALIASES)}"
            )
        return cls(name, recipe, frozenset(mods))

    @property
    def spec(self) -> str:
        return "+".join([self.recipe, *sorted(self.mods)])

    def eval_key(self) -> tuple:
        """What the evaluation's program depends on (not faithfulness, not the prefix skip)."""
        return (self.recipe, "tbf16" in self.mods, "cbf16" in self.mods)

    @contextlib.contextmanager
    def tracing(self):
        """The modifiers that are not configuration, for as long as the step is traced."""
        from pdctl.science.spd import losses

        saved = losses.exact_matmul, losses.prefix_layer
        if "fdefault" in self.mods:  # V @ U as pdctl computed it before the policy
            losses.exact_matmul = lambda a, b: a.astype("float32") @ b.astype("float32")
        if "noskip" in self.mods:
            losses.prefix_layer = lambda target, paths: None
        try:
            yield
        finally:
            losses.exact_matmul, losses.prefix_layer = saved


def config(args: argparse.Namespace, arm: Arm):
    from pdctl.config import parse_config
    from pdctl.templates import templates_root

    raw = tomllib.loads((templates_root() / "smollm2" / "pdctl.toml").read_text())
    if arm.recipe == "edbbc41":
        old = tomllib.loads(EDBBC41)
        raw["decomp"], raw["warmup"] = old["decomp"], old["warmup"]
        raw["train"].pop("ppgd", None)
        raw["train"].update(old["train"])
    raw["target"]["path"] = str(Path(args.gguf).resolve()) if args.gguf else "model.gguf"
    raw["data"]["path"] = str(Path(args.text).resolve())
    raw["data"]["seq_len"] = args.seq
    C = raw["decomp"]["sites"][0]["C"]
    raw["decomp"]["sites"] = [{"pattern": f"model.layers.{args.layer}.mlp.*", "C": C}]
    raw["train"]["batch_size"] = args.batch
    raw["train"]["eval_batch_size"] = args.eval_batch
    raw["mesh"] = {"data": 1, "fsdp": 1}
    if "tbf16" in arm.mods:
        raw["precision"]["target_dtype"] = "bfloat16"
    if "cbf16" in arm.mods:
        raw["precision"]["compute_dtype"] = "bfloat16"
    if "unroll" in arm.mods and "ppgd" in raw["train"]:
        raw["train"]["ppgd"]["unroll"] = True
    # the table reads the unmasked and CI-masked KL only: no fresh-PGD evaluation
    raw["train"]["eval_pgd"] = {"enabled": False}
    return parse_config(raw)


# ---- XLA's view of a compiled step ---------------------------------------------------------


def cost(compiled: Any) -> dict[str, float]:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, list | tuple) else c
    m = compiled.memory_analysis()
    out = {
        "gflop": float(c.get("flops", 0.0)) / 1e9,
        "gb_accessed": float(c.get("bytes accessed", 0.0)) / 1e9,
        "transcendentals_g": float(c.get("transcendentals", 0.0)) / 1e9,
    }
    if m is not None:
        for k in ("argument", "output", "alias", "temp"):
            out[f"{k}_gib"] = getattr(m, f"{k}_size_in_bytes") / 2**30
    text = compiled.as_text() or ""
    out["while_loops"] = text.count(" while(")
    return out


# ---- the run ----------------------------------------------------------------------------------


def _machine() -> str:
    import jax

    d, n = jax.devices()[0], len(jax.devices())
    return f"{d.platform} {getattr(d, 'device_kind', '?')} x{n}, jax {jax.__version__}"


def _commit() -> str:
    return git_commit() or "?"


def lower_eval(args: argparse.Namespace, cfg: Any, target: Any, prog: Any, mesh: Any) -> Any:
    """The train stage's masked-forwards evaluation (`evaluate.lm_eval_program`, fresh-PGD off)
    lowered from abstract arguments at `[precision] eval_matmul`, as `stages.train_eval`
    traces it."""
    import jax
    import jax.numpy as jnp

    from pdctl.engine import sharding
    from pdctl.engine.precision import Policy
    from pdctl.science.spd import evaluate

    trainable = sharding.abstract_with_shardings(
        prog.abstract_state["trainable"], prog.state_shardings["trainable"]
    )
    params = sharding.abstract_with_shardings(prog.frozen_abstract[0], prog.frozen_shardings[0])
    rep = sharding.replicated(mesh)
    x = jax.ShapeDtypeStruct((args.eval_batch, args.seq), jnp.int32, sharding=rep)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
    d, comps = cfg.decomp, trainable["components"]
    fn = evaluate.lm_eval_program(
        target, evaluate.unit_order(target, comps), d.ci_fn.type, d.sigmoid, d.sampling,
        d.delta_component, cfg.train.eval_rounding_threshold, evaluate.fresh_pgd_config(cfg),
    )  # fmt: skip
    with Policy.from_config(cfg.precision).eval_scope():
        return fn.lower(params, comps, trainable["ci_fns"], x, x, key)


def build(args: argparse.Namespace, arm: Arm, mesh: Any, need_weights: bool):
    """(config, target, train program) of an arm."""
    from pdctl.stages import train
    from pdctl.stages.inputs import target_from_config

    cfg = config(args, arm)
    target = target_from_config(cfg, need_weights=need_weights)
    return cfg, target, train.program(cfg, mesh, target)


def aot(args: argparse.Namespace, arms: list[Arm]) -> None:
    from pdctl.engine import sharding
    from pdctl.inspect import topology

    topo = topology.parse_topology(args.aot)
    devices = topology.devices(topo)
    mesh = sharding.make_mesh(1, 1, devices[:1])
    ntok = args.batch * args.seq
    print(f"# pdctl {_commit()}; XLA:TPU AOT for {topo.name}; layer {args.layer}, "
          f"{args.batch} x {args.seq} tokens", flush=True)  # fmt: skip
    rows = {}
    for arm in arms:
        prog = build(args, arm, mesh, need_weights=False)[2]
        t = time.perf_counter()
        with arm.tracing():
            lowered = prog.lower()
        lower_s = time.perf_counter() - t
        t = time.perf_counter()
        try:
            compiled = lowered.compile()
        except Exception as e:  # XLA:TPU refuses a program that does not fit the chip
            oom = topology.out_of_memory(e)
            if oom is None:
                raise
            print(f"# {arm.name} ({arm.spec}): does not fit: {oom['message']}", flush=True)
            continue
        r = {"spec": arm.spec, "lower_s": lower_s, "compile_s": time.perf_counter() - t}
        r.update(cost(compiled))
        # every FLOP at peak: a floor on the step (a loop's body counted once, see `cost`);
        # XLA's bytes at HBM speed are not one (it counts every fusion's operands, VMEM-held
        # ones included: edbbc41's step ran in 59% of that figure, docs/performance.md)
        r["flop_ms"] = r["gflop"] / args.peak_tflops
        r["byte_ms"] = r["gb_accessed"] / args.hbm_gbs * 1e3
        r["flop_ceiling_tokens_per_s"] = ntok / r["flop_ms"] * 1e3
        rows[arm.name] = r
        if args.hlo_dir:
            Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.hlo_dir) / f"{arm.name}.hlo.txt").write_text(compiled.as_text())
        print(f"# {arm.name} ({arm.spec}): {json.dumps(r)}", flush=True)
    print("| arm | spec | GFLOP | GB accessed | loops | temp GiB | args GiB | ms at peak "
          "FLOP/s | tokens/s ceiling | XLA bytes at HBM speed, ms | compile s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(
            f"| {name} | {r['spec']} | {r['gflop']:,.0f} | {r['gb_accessed']:.1f} | "
            f"{r['while_loops']} | {r.get('temp_gib', float('nan')):.2f} | "
            f"{r.get('argument_gib', float('nan')):.2f} | {r['flop_ms']:.1f} | "
            f"{r['flop_ceiling_tokens_per_s'] / 1e3:.0f}k | {r['byte_ms']:.0f} | "
            f"{r['compile_s']:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"aot": topo.name, "args": vars(args),
                                               "arms": rows}, indent=1))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=os.environ.get("PDCTL_SMOLLM2_GGUF"))
    ap.add_argument("--text", default=os.environ.get("PDCTL_TEXT", "/usr/share/games/fortunes"))
    ap.add_argument("--arms", nargs="+", default=["before", "policy-old", "policy", "after"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10, help="steps per timing window")
    ap.add_argument("--windows", type=int, default=4, help="interleaved timing windows")
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--peak-tflops", type=float, default=197.0, help="v5e bf16 peak")
    ap.add_argument("--hbm-gbs", type=float, default=819.0, help="v5e HBM bandwidth (GB/s)")
    ap.add_argument("--compile-cache", default="", help="JAX's persistent compilation cache")
    ap.add_argument(
        "--eval-arms",
        nargs="*",
        default=["policy"],
        help="template arms whose evaluation (unmasked KL) to compile and run",
    )
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="stop adding timing windows past this many seconds (0: none)")  # fmt: skip
    ap.add_argument("--sync-arm", default="after",
                    help="also time this arm reading the loss after every step")  # fmt: skip
    ap.add_argument("--json", default="")
    ap.add_argument("--aot", default="", metavar="TOPOLOGY", help="compile only, for a TPU")
    ap.add_argument("--hlo-dir", default="", help="(--aot) write each step's compiled HLO")
    args = ap.parse_args(argv)
    arms = [Arm.parse(a) for a in args.arms]
    if len({a.name for a in arms}) != len(arms):
        sys.exit("--arms: an arm is named twice")
    if args.aot:
        aot(args, arms)
        return
    if not args.gguf:
        sys.exit("--gguf PATH (or PDCTL_SMOLLM2_GGUF) is required")
    run(args, arms)


def tokens(args: argparse.Namespace, n: int, offset: int = 0):
    """`n` sequences of `--seq` + 1 tokens from the text, starting `offset` sequences in:
    only as many documents are tokenized as that needs."""
    import numpy as np

    from pdctl.science import data

    tok = data.corpus_tokenizer(Path(args.gguf).resolve())
    files = sorted(p for p in Path(args.text).iterdir() if p.is_file() and p.suffix != ".dat")
    S, need = args.seq + 1, (offset + n) * (args.seq + 1)
    ids, have = [], 0
    for f in files:
        docs = f.read_text(errors="replace").split("\n%\n")
        for i in range(0, len(docs), 256):
            ids.append(data._encode(tok.tokenizer, docs[i : i + 256], tok.eos_id))
            have += len(ids[-1])
            if have >= need:
                break
        if have >= need:
            break
    ids = np.concatenate(ids)
    if len(ids) < need:
        sys.exit(f"--text: {len(ids)} tokens, {need} needed")
    return np.asarray(ids[offset * S : need].reshape(n, S), dtype=np.int32)


def run(args: argparse.Namespace, arms: list[Arm]) -> None:
    phases: dict[str, float] = {}
    t_all = t = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - t
        t = now

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pdctl.engine import sharding
    from pdctl.science.targets import imported
    from pdctl.stages.init_weights import aligned_components, init_decomposition
    from pdctl.stages.inputs import STREAM_DECOMP, stream_key

    if args.compile_cache:
        from pdctl.engine import compile_cache

        compile_cache.install(args.compile_cache)
    print(f"# pdctl {_commit()}; {_machine()}; layer {args.layer}, {args.batch} x {args.seq} "
          f"tokens a step", flush=True)  # fmt: skip
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    phase("start")

    # every step lowered (one at a time: the modifiers patch while tracing), then compiled
    # together in threads while the weights load and the text is tokenized
    built, lowered = {}, {}
    for arm in arms:
        built[arm.name] = build(args, arm, mesh, need_weights=True)
        with arm.tracing():
            lowered[arm.name] = built[arm.name][2].lower()
    # one evaluation program per distinct program (not per arm), at eval_matmul
    eval_arm: dict[tuple, str] = {}
    for arm in arms:
        wanted = arm.name in args.eval_arms and arm.recipe == "template"
        if wanted and arm.eval_key() not in eval_arm:
            eval_arm[arm.eval_key()] = arm.name
            lowered[f"eval:{arm.name}"] = lower_eval(args, *built[arm.name], mesh)
    phase("lower")
    pool = ThreadPoolExecutor(max_workers=len(lowered))

    def timed(fn):
        def go():
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0

        return go

    futures = {name: pool.submit(timed(low.compile)) for name, low in lowered.items()}

    _, target0, prog0 = built[arms[0].name]
    f32 = imported.load(target0, prog0.frozen_shardings[0], dtype=jnp.float32)
    jax.block_until_ready(f32)
    # the bfloat16 copy as the GGUF load makes it (float32, then rounded to nearest even)
    params = {jnp.dtype(jnp.float32): f32}
    for _, target, _ in built.values():
        dt = jnp.dtype(target.param_dtype)
        if dt not in params:
            params[dt] = jax.jit(lambda p, dt=dt: jax.tree.map(lambda x: x.astype(dt), p))(f32)
    phase("load weights")
    batch_np = tokens(args, args.batch)
    eval_np = tokens(args, args.eval_batch, offset=args.batch)
    phase("tokenize")

    decomps, states, batches = {}, {}, {}
    for arm in arms:
        cfg, target, prog = built[arm.name]
        if arm.recipe not in decomps:
            decomps[arm.recipe] = init_decomposition(cfg, target, mesh,
                                                     stream_key(cfg, STREAM_DECOMP))[0]  # fmt: skip
        dec = decomps[arm.recipe]
        if cfg.decomp.init == "nonlinearity_aligned":  # V U = W, as the warmup stage starts it
            p = params[jnp.dtype(target.param_dtype)]
            comps, _, _ = aligned_components(cfg, target, mesh, p, dec["components"])
            dec = decomps[arm.name] = {**dec, "components": comps}
        states[arm.name] = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
        batches[arm.name] = jax.device_put({"tokens": batch_np}, prog.batch_shardings)
    jax.block_until_ready(states)
    phase("states")

    compiled, compile_s = {}, {}
    names = {fut: name for name, fut in futures.items()}
    for fut in as_completed(names):
        name = names[fut]
        compiled[name], compile_s[name] = fut.result()
        print(f"# compiled {name} in {compile_s[name]:.0f} s ({time.perf_counter() - t_all:.0f} "
              "s into the run)", flush=True)  # fmt: skip
    pool.shutdown()
    phase("wait for the compiles")

    results: dict[str, dict[str, Any]] = {}
    for arm in arms:
        cfg, target, prog = built[arm.name]
        p = params[jnp.dtype(target.param_dtype)]
        states[arm.name], m = compiled[arm.name](p, states[arm.name], batches[arm.name])
        first = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
        c = cost(compiled[arm.name])
        results[arm.name] = {"spec": arm.spec, "compile_s": compile_s[arm.name], **c,
                             "first_step": first}  # fmt: skip
        print(f"# {arm.name}: first step faithfulness {first.get('faithfulness', 0):.3g}, "
              f"total {first.get('total', 0):.4g}; XLA {c['gflop']:,.0f} GFLOP, "
              f"{c['gb_accessed']:.1f} GB, temp {c.get('temp_gib', 0):.2f} GiB",
              flush=True)  # fmt: skip
    phase("first steps")

    # the evaluations: on the initial components of an arm whose V U = W (the aligned init)
    evals: dict[tuple, dict[str, float]] = {}
    if eval_arm:
        toks = jnp.asarray(eval_np)
        for key, name in eval_arm.items():
            target = built[name][1]
            dec = decomps[name]
            out = compiled[f"eval:{name}"](
                params[jnp.dtype(target.param_dtype)], dec["components"], dec["ci_fns"],
                toks[:, :-1], toks[:, 1:], jax.random.PRNGKey(0),
            )  # fmt: skip
            out = {k: float(v) for k, v in jax.device_get(out).items()}
            evals[key] = {"unmasked": out["kl/unmasked"], "ci_masked": out["kl/ci_masked"],
                          "compile_s": compile_s[f"eval:{name}"]}  # fmt: skip
    phase("evaluations")

    def window(arm: Arm, n: int, sync: bool = False) -> float:
        """ms per step over `n` steps dispatched back to back (the train loop reads nothing
        between its logging points); `sync`: reading the loss after every step instead."""
        target = built[arm.name][1]
        p, fn, b = params[jnp.dtype(target.param_dtype)], compiled[arm.name], batches[arm.name]
        t0 = time.perf_counter()
        for _ in range(n):
            states[arm.name], m = fn(p, states[arm.name], b)
            if sync:
                float(m["loss"])
        jax.block_until_ready(m)
        return (time.perf_counter() - t0) / n * 1e3

    for arm in arms:
        window(arm, 2)
    times: dict[str, list[float]] = {a.name: [] for a in arms}
    synced: dict[str, list[float]] = {}
    sync_arm = next((a for a in arms if a.name == args.sync_arm), None)
    for w in range(args.windows):  # interleaved
        if w and args.deadline_s and time.perf_counter() - t_all > args.deadline_s:
            print(f"# --deadline-s: {w} timing windows of {args.windows}", flush=True)
            break
        for arm in arms:
            times[arm.name].append(window(arm, args.steps))
        if sync_arm is not None:
            synced.setdefault(sync_arm.name, []).append(window(sync_arm, args.steps, sync=True))
    phase("timing")

    ntok = args.batch * args.seq
    for arm in arms:
        r = results[arm.name]
        ms = min(times[arm.name])
        r["step_ms"], r["windows_ms"] = ms, times[arm.name]
        r["tokens_per_s"] = ntok / ms * 1e3
        # XLA counts a loop's body once: a step with the PPGD warm-up as a loop takes the
        # FLOPs of an arm of its recipe without one (the same arithmetic), else is marked
        r["mfu_gflop"], r["mfu_note"] = r["gflop"], "" if not r["while_loops"] else "*"
        if r["while_loops"]:
            flat = [results[a.name]["gflop"] for a in arms if a.recipe == arm.recipe
                    and not results[a.name]["while_loops"]]  # fmt: skip
            if flat:
                r["mfu_gflop"], r["mfu_note"] = max(flat), "+"
        r["mfu"] = r["mfu_gflop"] * 1e9 / (ms / 1e3) / (args.peak_tflops * 1e12)
        r["kl"] = evals.get(arm.eval_key())
    ref = results.get("before", results[arms[0].name])
    print("| arm | spec | step ms (best; spread) | x before | tokens/s | MFU (XLA FLOPs) | "
          "first-step faithfulness / total | unmasked KL (eval_matmul) | compile s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for arm in arms:
        r = results[arm.name]
        f = r["first_step"]
        spread = max(r["windows_ms"]) / r["step_ms"] - 1
        kl = f"{r['kl']['unmasked']:.2g}" if r["kl"] else "-"
        print(
            f"| {arm.name} | {r['spec']} | {r['step_ms']:.1f} (+{spread:.0%}) | "
            f"{r['step_ms'] / ref['step_ms']:.3f} | {r['tokens_per_s'] / 1e3:.1f}k | "
            f"{r['mfu']:.2f}{r['mfu_note']} | {f.get('faithfulness', float('nan')):.3g} / "
            f"{f.get('total', float('nan')):.3g} | {kl} | {r['compile_s']:.0f} |"
        )
    notes = {r["mfu_note"] for r in results.values()}
    if "+" in notes:
        print("# +: XLA counts the PPGD warm-up loop's body once; MFU from the FLOPs of the "
              "unrolled arm of the same recipe")  # fmt: skip
    if "*" in notes:
        print("# *: XLA counts the PPGD warm-up loop's body once: this MFU is understated "
              "(add an arm with +unroll for the step's FLOPs)")  # fmt: skip
    for name, ts in synced.items():
        ms, base = min(ts), results[name]["step_ms"]
        results[name]["synced_step_ms"] = ms
        print(f"# {name} with the loss read after every step: {ms:.1f} ms ({ms - base:+.1f} ms "
              f"a step: what one host sync per step would cost)")  # fmt: skip
    ratios = {}
    for num, den, what in RATIOS:
        if num in results and den in results:
            a, b = results[num], results[den]
            ratios[f"{num}/{den}"] = a["step_ms"] / b["step_ms"]
            print(f"# {num} / {den} step: {a['step_ms'] / b['step_ms']:.3f} ({what}); tokens/s "
                  f"{b['tokens_per_s']:,.0f} -> {a['tokens_per_s']:,.0f}, MFU {b['mfu']:.2f} -> "
                  f"{a['mfu']:.2f}")  # fmt: skip
    phases["total"] = time.perf_counter() - t_all
    print("# phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": _machine(), "commit": _commit(),
                                               "args": vars(args), "phases": phases,
                                               "ratios": ratios, "arms": results},
                                              indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
