"""The LM-recipe A/B on SmolLM2-135M: the paper's recipe (arm A) against the current LM recipe
(arm B), the same steps, batches and tokens for both, in ONE process on one device.

- Arm A (the paper's recipe at its best measured setting, docs/results.md "Second attempt"):
  C = 1024 per site from a random init, 1,000 faithfulness-warmup steps, L_p importance
  minimality 2e-5 (p 2 -> 0.4, beta 0.5), stochastic subset reconstruction 1.0, CI-masked
  reconstruction 1.0, the leaky-hard sigmoid.
- Arm B (goodfire-ai/param-decomp's LM recipe): C = 1536 = the MLP's neurons, each component
  one neuron (`decomp.init = "nonlinearity_aligned"`: V U = W exactly, no warmup), smooth-L0
  (gamma 1 -> 0.01 over 90% of the run) with importance minimality `--imp` and the frequency
  term at half of it (EMA half-life 200), the merged stochastic / PPGD term (adv_fraction 0.5),
  the lower-leaky-hard clamp.

Both: SmolLM2's layer `--layer` MLP (gate / up / down), shared-MLP CI functions (hidden 128),
faithfulness 1e7, lr 1e-3 cosine, KL output, batches drawn from the training documents of
Debian's fortunes (10% of documents held out), `--batch` x `--seq` tokens a step. The arms step
in turn on the same batch. Every `--eval-every` steps and at the end, on `--eval-batch` held-out
sequences, at the evaluations' matmul precision: L0 and alive (mean CI > 1e-6) per site, the KL
of the stochastic-, fresh-PGD- (20 sign steps, sources shared over batch and positions), CI-,
un- and zero-masked models, and the CI- / zero-masked CE. Printed as the curve and the final
Pareto; written as JSON and a PNG of the curves (`--out DIR`).

    python -m benchmarks.lm.ab --gguf PATH --text DIR --out DIR [--steps 10000] [--batch 16]
        [--seq 256] [--eval-every 1000] [--deadline-s 0] [--arms A B] [--imp 1e-5]
        [--state DIR] [--compile-cache DIR]
    python -m benchmarks.lm.ab --merge A.json B.json --out DIR

`--merge`: the arms of separate runs (one arm per run, e.g. one per session on a borrowed TPU; the
batch sampler is seeded alone, so every arm sees the same batches whatever `--arms` held) joined
into one table, trend and Pareto, refused unless the runs agree on every setting but `--arms`.

`--deadline-s` (wall seconds from the start): both arms stop at the same step when the next
round of steps would pass it (the schedules were set for `--steps`; the output says where they
stopped). With `--state DIR` a run stopped by its deadline saves every arm's train state, logs,
evaluations and the batch sampler there, and the same command started again resumes from it at
the next step (the same batches as an unbroken run; the arms' schedules run to `--steps`): a run
longer than one command may last (a 10-minute call on a borrowed TPU) goes in segments. With
`--compile-cache DIR` XLA's executables are kept there, so a resumed segment does not compile
again. Long: a benchmark, never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._harness import machine_line

T0 = time.perf_counter()


def arm_overrides(arm: str, args: argparse.Namespace) -> dict:
    site = f"model.layers.{args.layer}.mlp.*"
    if arm == "A":
        return {
            "decomp": {"sites": [{"pattern": site, "C": 1024}], "sigmoid": "leaky_hard"},
            "warmup": {"steps": args.warmup_steps, "lr": 0.002, "weight_decay": 0.0},
            "train": {
                "optim": {"lr": 1e-3},
                "loss": {
                    "importance_minimality": 2e-5,
                    "p": 2.0,
                    "p_final": 0.4,
                    "beta": 0.5,
                    "stochastic_recon": 0.0,
                    "stochastic_recon_layerwise": 0.0,
                    "stochastic_recon_subset": 1.0,
                    "ci_masked_recon": 1.0,
                },
            },
        }
    if arm == "B":
        return {
            "decomp": {
                "sites": [{"pattern": site, "C": 1536}],
                "init": "nonlinearity_aligned",
                "sigmoid": "lower_leaky_hard",
            },
            "warmup": {"steps": 0},
            "train": {
                "loss": {
                    "sparsity": "smooth_l0",
                    "p_final": None,
                    "gamma_final": 0.01,
                    "gamma_anneal_end": 0.9,
                    "importance_minimality": args.imp,
                    "beta": 0.0,
                    "frequency": args.imp / 2,
                    "frequency_ema_halflife": 200,
                    "stochastic_recon_subset": 0.0,
                    "merged_recon": 1.0,
                    "adv_fraction": 0.5,
                },
                # the reference's LM configs: sources per example and position, two warm-up
                # ascents, Adam (b1 0.01, b2 0.99) at 0.01 after a 5% warm-up; components at a
                # small lr (their 5e-5 with Muon over 400k steps; Adam here, --lr-b)
                "ppgd": {
                    "scope": "per_batch_per_position",
                    "n_warmup_steps": 2,
                    "lr": 0.01,
                    "b1": 0.01,
                    "b2": 0.99,
                    "warmup_frac": 0.05,
                },
                "optim": {"lr": args.lr_b},
                "ci_optim": {"grad_clip": 1.0},
            },
        }
    raise SystemExit(f"unknown arm {arm!r}")


# The smollm2 template ships arm B's recipe: arm A takes these of its keys back to their defaults
# (random init, the lp penalty, no PPGD sources, no clipping of the CI functions' gradients).
ARM_A_DROP = {
    "decomp": ["init"],
    "train": {
        "ppgd": None,
        "ci_optim": ["grad_clip"],
        "loss": [
            "sparsity",
            "gamma_final",
            "gamma_anneal_end",
            "frequency",
            "frequency_ema_halflife",
            "merged_recon",
            "adv_fraction",
        ],
    },
}


def _drop(raw: dict, drop: dict) -> dict:
    out = dict(raw)
    for k, v in drop.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list):
            out[k] = {kk: vv for kk, vv in out[k].items() if kk not in v}
        else:
            out[k] = _drop(out[k], v)
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def arm_config(arm: str, args: argparse.Namespace):
    from pdctl.config import parse_config
    from pdctl.templates import templates_root

    raw = tomllib.loads((templates_root() / "smollm2" / "pdctl.toml").read_text())
    common = {
        "target": {"path": str(Path(args.gguf).resolve())},
        "data": {"path": str(Path(args.text).resolve()), "seq_len": args.seq},
        "mesh": {"data": 1, "fsdp": 1},
        "train": {"steps": args.steps, "batch_size": args.batch},
    }
    if arm == "A":
        raw = _drop(raw, ARM_A_DROP)
    raw = _merge(_merge(raw, common), arm_overrides(arm, args))
    return parse_config(raw)


def corpus(cfg, split: str):
    from pdctl.science import data

    return data.load_corpus(
        cfg.data.path,
        tokenizer_path=cfg.target.path,
        cache_dir="/tmp/pdctl-lm-ab-tokens",
        seq_len=cfg.data.seq_len,
        split=split,
        eval_fraction=cfg.data.eval_fraction,
        separator=cfg.data.separator,
    )


class Arm:
    """One arm's config, programs and state; `step(batch)` advances it."""

    def __init__(
        self, name: str, args: argparse.Namespace, mesh, params_cache: dict, resume: bool = False
    ):
        import jax

        from pdctl.engine.precision import Policy
        from pdctl.science.spd import components as comps_mod
        from pdctl.science.targets import imported
        from pdctl.stages import train, warmup
        from pdctl.stages.decomposition import aligned_sites, decomposed_sites
        from pdctl.stages.init_weights import init_decomposition
        from pdctl.stages.inputs import STREAM_DECOMP, stream_key, target_from_config

        self.name, self.args = name, args
        self.cfg = cfg = arm_config(name, args)
        self.target = target = target_from_config(cfg)
        self.policy = Policy.from_config(cfg.precision)
        self.prog = train.program(cfg, mesh, target)
        if "params" not in params_cache:
            params_cache["params"] = imported.load(
                target, self.prog.frozen_shardings[0], dtype=target.param_dtype
            )
        self.params = params = params_cache["params"]
        dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
        components = dict(dec["components"])
        self.warmup_s, self.warmup_floor = 0.0, None
        if cfg.decomp.init == "nonlinearity_aligned" and not resume:
            sites = decomposed_sites(cfg, target)
            weights = target.site_weights(params)
            keys = jax.random.split(stream_key(cfg, STREAM_DECOMP), len(sites))
            for i, (path, side) in enumerate(aligned_sites(cfg, target, sites).items()):
                C = sites[path][2]
                components[path] = jax.device_put(
                    comps_mod.aligned_site_components(keys[i], weights[path], C, side),
                    self.prog.state_shardings["trainable"]["components"][path],
                )
        if cfg.warmup.steps and not resume:
            wprog = warmup.program(cfg, mesh, target)
            wstep, wstate = wprog.jit(), wprog.jit_make_state()(components)
            t = time.perf_counter()
            for _ in range(cfg.warmup.steps):
                wstate, wm = wstep(params, wstate, None)
            self.warmup_floor = float(jax.device_get(wm["faithfulness"]))
            self.warmup_s = time.perf_counter() - t
            components = wstate["components"]
        self.dec = dec
        self.state = self.prog.jit_make_state()(components, dec["ci_fns"], dec["sources"])
        self.step_fn = None
        self.compile_s = 0.0
        self.log: list[dict] = []
        self.evals: list[dict] = []

    def save(self, path: Path) -> None:
        """The train state's leaves (PRNG keys as their key data) in one .npz."""
        import jax
        import numpy as np

        leaves = jax.device_get(
            [
                jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
                for x in jax.tree.leaves(self.state)
            ]
        )
        np.savez(path, *[np.asarray(x) for x in leaves])

    def restore(self, path: Path) -> None:
        """Put the saved leaves in place of the fresh state's, with its shardings and dtypes."""
        import jax
        import numpy as np

        fresh, treedef = jax.tree.flatten(self.state)
        with np.load(path) as z:
            saved = [z[f"arr_{i}"] for i in range(len(z.files))]
        if len(saved) != len(fresh):
            raise SystemExit(f"{path}: {len(saved)} arrays, the state has {len(fresh)}")
        out = []
        for old, new in zip(fresh, saved, strict=True):
            if jax.dtypes.issubdtype(old.dtype, jax.dtypes.prng_key):
                data = jax.device_put(new, old.sharding)
                out.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(old)))
            else:
                out.append(jax.device_put(new.view(old.dtype).reshape(old.shape), old.sharding))
        self.state = jax.tree.unflatten(treedef, out)

    def compile(self, batch) -> None:
        t = time.perf_counter()
        self.step_fn = self.prog.jit().lower(self.params, self.state, batch).compile()
        self.compile_s = time.perf_counter() - t

    def step(self, batch):
        self.state, m = self.step_fn(self.params, self.state, batch)
        return m

    def evaluate(self, step: int, eval_batch) -> dict:
        import jax

        from pdctl.science.spd import evaluate

        trainable = self.state["trainable"]  # (the MLP sites are untied: no expansion)
        comps, ci_fns = trainable["components"], trainable["ci_fns"]
        with self.policy.eval_scope():
            lm = evaluate.lm_eval(
                self.target, self.params, comps, ci_fns, self.cfg, eval_batch,
                jax.random.PRNGKey(7),
            )  # fmt: skip
            stats = evaluate.ci_stats(
                self.target, self.params, comps, ci_fns, self.cfg, self.target.inputs(eval_batch)
            )
        row = {"step": step, **{k: float(v) for k, v in {**lm, **stats}.items()}}
        self.evals.append(row)
        return row


# what must match for a saved run to be resumed by this command
RUN_KEYS = ("arms", "steps", "batch", "seq", "layer", "imp", "lr_b", "warmup_steps", "eval_batch")


def save_segment(state_dir: Path, args, arms: list[Arm], done: int, stepping: float, rng) -> None:
    """Every arm's state (.npz) and the rest (meta.json), meta written last: a run killed while
    saving resumes from the previous segment's files or not at all, never from a mix."""
    state_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "args": vars(args),
        "done": done,
        "stepping_s": stepping,
        "rng": rng,
        "arms": {
            a.name: {
                "log": a.log,
                "evals": a.evals,
                "warmup_s": a.warmup_s,
                "warmup_floor": a.warmup_floor,
            }
            for a in arms
        },
    }
    old = state_dir / "meta.json"
    if old.exists():
        old.unlink()
    for a in arms:
        tmp = state_dir / f"{a.name}.tmp.npz"
        a.save(tmp)
        tmp.replace(state_dir / f"{a.name}.npz")
    (state_dir / "meta.json.tmp").write_text(json.dumps(meta))
    (state_dir / "meta.json.tmp").replace(state_dir / "meta.json")


def sites_of(row: dict, key: str) -> dict[str, float]:
    return {k.split("/", 1)[1].split(".")[-1]: v for k, v in row.items() if k.startswith(key + "/")}


def fmt_eval(arm: str, r: dict) -> str:
    l0 = " / ".join(f"{v:.1f}" for v in sites_of(r, "l0").values())
    alive = " / ".join(f"{v:.0f}" for v in sites_of(r, "alive_mean").values())
    return (
        f"| {arm} | {r['step']} | {l0} | {alive} | {r.get('kl/stoch_masked', float('nan')):.4f} | "
        f"{r.get('kl/pgd', float('nan')):.4f} | {r['kl/ci_masked']:.4f} | {r['kl/unmasked']:.2g} | "
        f"{r['ce/ci_masked']:.4f} | {r['ce/zero_masked']:.4f} | {r['ce/target']:.4f} |"
    )


HEADER = (
    "| arm | step | L0 gate / up / down | alive (mean CI > 1e-6) | KL stochastic | KL fresh PGD "
    "| KL CI-masked | KL unmasked | CE CI-masked | CE zero-masked | CE target |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def plot(out: Path, arms: list[Arm]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(20, 4.2))
    for n, a in enumerate(arms):
        c = f"C{n}"
        steps = [r["step"] for r in a.evals]
        l0 = [sum(sites_of(r, "l0").values()) / 3 for r in a.evals]
        ax[0].plot(steps, l0, marker="o", color=c, label=a.name)
        ax[1].plot(steps, [r.get("kl/stoch_masked") for r in a.evals], "o-", color=c, label=a.name)
        ax[2].plot(steps, [r.get("kl/pgd") for r in a.evals], marker="o", color=c, label=a.name)
        ax[3].scatter(
            [l0[-1]], [a.evals[-1].get("kl/pgd")], s=60, color=c, label=f"{a.name} (fresh PGD)"
        )
        ax[3].scatter(
            [l0[-1]], [a.evals[-1].get("kl/stoch_masked")], marker="x", s=60, color=c,
            label=f"{a.name} (stochastic)",
        )  # fmt: skip
    for i, (t, y) in enumerate(
        [
            ("mean L0 per site", "L0"),
            ("KL stochastic-masked", "KL"),
            ("KL fresh-PGD-masked", "KL"),
            ("Pareto at the end: L0 vs KL", "KL"),
        ]
    ):
        ax[i].set_title(t)
        ax[i].set_ylabel(y)
        ax[i].set_xlabel("L0" if i == 3 else "step")
        ax[i].legend()
        ax[i].set_yscale("log")
    ax[3].set_xscale("log")
    fig.tight_layout()
    fig.savefig(out / "lm_ab.png", dpi=90)


def merge(paths: list[str], out: Path) -> None:
    """Join per-arm runs' lm_ab.json files: one trend table by step, the final Pareto, the plot."""
    from types import SimpleNamespace

    runs = [json.loads(Path(p).read_text()) for p in paths]
    keys = [k for k in RUN_KEYS if k != "arms"]
    first = {k: runs[0]["args"][k] for k in keys}
    for p, r in zip(paths, runs, strict=True):
        other = {k: r["args"][k] for k in keys}
        if other != first:
            diff = sorted(k for k in keys if other[k] != first[k])
            sys.exit(f"{p}: run with other settings ({', '.join(diff)}) than {paths[0]}")
    arms: dict[str, dict] = {}
    for p, r in zip(paths, runs, strict=True):
        for name, a in r["arms"].items():
            if name in arms:
                sys.exit(f"{p}: arm {name} is in two of the runs")
            arms[name] = {**a, "machine": r["machine"], "steps_done": r["steps_done"],
                          "stepping_s": r["stepping_s"], "setup_s": r["setup_s"]}  # fmt: skip
    names = sorted(arms)
    for n in names:
        a = arms[n]
        ms = a["stepping_s"] / max(a["steps_done"], 1) * 1e3
        print(f"# {n}: {a['machine']}; {a['steps_done']} steps, {ms:.1f} ms a step "
              f"({first['batch'] * first['seq'] / ms * 1e3:,.0f} tokens/s)")  # fmt: skip
    print(HEADER)
    steps = sorted({e["step"] for a in arms.values() for e in a["evals"]})
    for st in steps:
        for n in names:
            for e in arms[n]["evals"]:
                if e["step"] == st:
                    print(fmt_eval(n, e))
    print("\nfinal:\n" + HEADER)
    for n in names:
        print(fmt_eval(n, arms[n]["evals"][-1]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm_ab.json").write_text(json.dumps({"args": first, "arms": arms}, indent=1))
    plot(out, [SimpleNamespace(name=n, evals=arms[n]["evals"]) for n in names])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.environ.get("PDCTL_SMOLLM2_GGUF"))
    ap.add_argument("--text", default=os.environ.get("PDCTL_TEXT", "/usr/share/games/fortunes"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", nargs="+", default=["A", "B"])
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--imp", type=float, default=2e-5)
    ap.add_argument("--lr-b", type=float, default=1e-4)
    ap.add_argument("--warmup-steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--deadline-s", type=float, default=0.0)
    ap.add_argument("--state", help="save / resume the run here (segments across commands)")
    ap.add_argument("--segment-steps", type=int, default=0, help="stop (and save) after N steps")
    ap.add_argument("--compile-cache", help="XLA's persistent compilation cache directory")
    ap.add_argument("--merge", nargs="+", help="join these per-arm lm_ab.json files (see above)")
    args = ap.parse_args()
    print(machine_line())
    if args.merge:
        merge(args.merge, Path(args.out))
        return
    if not args.gguf:
        sys.exit("--gguf PATH (or PDCTL_SMOLLM2_GGUF) is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import jax
    import numpy as np

    from pdctl.engine import sharding

    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    state_dir = Path(args.state) if args.state else None
    meta_path = state_dir / "meta.json" if state_dir else None
    meta = json.loads(meta_path.read_text()) if meta_path and meta_path.exists() else None
    if meta is not None:
        same = {k: meta["args"][k] for k in RUN_KEYS} == {k: vars(args)[k] for k in RUN_KEYS}
        if not same:
            sys.exit(f"{meta_path}: saved with other settings of {RUN_KEYS}; use another --state")
        print(f"# resuming after step {meta['done']} from {state_dir}", flush=True)
    dev = jax.devices()[0]
    machine = f"{dev.platform} {getattr(dev, 'device_kind', '?')}, jax {jax.__version__}"
    print(f"# {machine}; layer {args.layer}, {args.batch} x {args.seq} tokens, {args.steps} steps")
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    cache: dict = {}
    arms = [Arm(a, args, mesh, cache, resume=meta is not None) for a in args.arms]
    t_setup = {"load": time.perf_counter() - T0}
    base = arms[0].cfg
    train_ids = np.asarray(corpus(base, "train"))
    eval_ids = np.asarray(corpus(base, "eval"))
    S = args.seq + 1
    n_eval = min(args.eval_batch, len(eval_ids) // S)
    eval_batch = {"tokens": jax.numpy.asarray(eval_ids[: n_eval * S].reshape(n_eval, S))}
    rng = np.random.default_rng(0)
    start, stepping = 1, 0.0
    if meta is not None:
        for a in arms:
            a.restore(state_dir / f"{a.name}.npz")
            m = meta["arms"][a.name]
            a.log, a.evals = m["log"], m["evals"]
            a.warmup_s, a.warmup_floor = m["warmup_s"], m["warmup_floor"]
        rng.bit_generator.state = meta["rng"]
        start, stepping = meta["done"] + 1, meta["stepping_s"]

    def batch_at():
        starts = rng.integers(0, len(train_ids) - S, args.batch)
        tok = np.stack([train_ids[s : s + S] for s in starts]).astype(np.int32)
        return jax.device_put({"tokens": tok}, arms[0].prog.batch_shardings)

    first = batch_at()

    def prepare(a: Arm) -> dict | None:
        if meta is not None:
            a.compile(first)
            return None
        # the step-0 evaluation (it compiles the evaluation's programs) beside the train step's
        # compile: XLA compiles both at once (dots traced in each thread's own precision scope)
        with ThreadPoolExecutor(1) as side:
            compiled = side.submit(a.compile, first)
            row = a.evaluate(0, eval_batch)
            compiled.result()
        return row

    with ThreadPoolExecutor(len(arms)) as pool:  # XLA compiles the arms side by side
        step0 = list(pool.map(prepare, arms))
    setup_s = time.perf_counter() - T0
    print(f"# setup: GGUF, init and warmup {t_setup['load']:.0f} s; all {setup_s:.0f} s")
    for a in arms:
        print(
            f"# {a.name}: train compile {a.compile_s:.0f} s, warmup {a.warmup_s:.0f} s "
            f"(floor {a.warmup_floor}); setup done at {setup_s:.0f} s",
            flush=True,
        )
    print(HEADER)
    for a, r in zip(arms, step0, strict=True):
        print(fmt_eval(a.name, r if r is not None else a.evals[-1]), flush=True)
    done, batch, rng_before = start - 1, first, None
    for step in range(start, args.steps + 1):
        if args.segment_steps and done - start + 1 >= args.segment_steps:
            print(f"# segment: stopped after step {done} of {args.steps}", flush=True)
            break
        if args.deadline_s and done >= start:
            left = args.deadline_s - (time.perf_counter() - T0)
            # the next logging window and a final evaluation must fit
            if left < stepping / done * args.log_every + 20 + 10 * bool(state_dir):
                print(f"# deadline: stopped after step {done} of {args.steps}", flush=True)
                break
        t = time.perf_counter()
        for a in arms:
            m = a.step(batch)
            if step % args.log_every == 0 or step == args.steps:
                m = jax.device_get(m)
                scalars = {k: float(v) for k, v in m.items() if np.ndim(v) == 0}
                a.log.append({"step": step, **scalars})
        rng_before = dict(rng.bit_generator.state)
        batch = batch_at()
        if step % args.log_every == 0:
            jax.block_until_ready([a.state for a in arms])
        stepping += time.perf_counter() - t
        done = step
        if step % args.eval_every == 0 and step != args.steps:
            for a in arms:
                print(fmt_eval(a.name, a.evaluate(step, eval_batch)), flush=True)
    jax.block_until_ready([a.state for a in arms])
    for a in arms:  # before the save, so a resumed run's curve keeps this point
        if not a.evals or a.evals[-1]["step"] != done:
            print(fmt_eval(a.name, a.evaluate(done, eval_batch)), flush=True)
    if state_dir is not None and done > start - 1:
        # the sampler's state after the batch drawn for step done + 1 (`batch`): the resumed run
        # draws that batch again from the state before it, so the state saved is the earlier one.
        # Saved at the end too, so the same command started again finds the run complete.
        save_segment(state_dir, args, arms, done, stepping, rng_before)
        more = "; the same command goes on" if done < args.steps else " (complete)"
        print(f"# saved after step {done} to {state_dir}{more}", flush=True)
    wall = time.perf_counter() - T0
    tokens = done * args.batch * args.seq
    print(
        f"\n# {done} steps per arm, {tokens:,} tokens each; setup {setup_s:.0f} s, "
        f"wall {wall:.0f} s"
    )
    pair_ms = stepping / max(done, 1) * 1e3
    print(
        f"# stepping: {stepping:.0f} s, {pair_ms:.1f} ms per step of every arm "
        f"({args.batch * args.seq * len(arms) / pair_ms * 1e3:,.0f} tokens/s over the arms)"
    )
    print("\nfinal:\n" + HEADER)
    for a in arms:
        print(fmt_eval(a.name, a.evals[-1]))
    result = {
        "machine": machine,
        "args": vars(args),
        "steps_done": done,
        "tokens_per_arm": tokens,
        "wall_s": wall,
        "setup_s": setup_s,
        "stepping_s": stepping,
        "arms": {
            a.name: {
                "config": arm_overrides(a.name, args),
                "compile_s": a.compile_s,
                "warmup_s": a.warmup_s,
                "warmup_floor": a.warmup_floor,
                "evals": a.evals,
                "log": a.log,
            }
            for a in arms
        },
    }
    (out / "lm_ab.json").write_text(json.dumps(result, indent=1))
    plot(out, arms)


if __name__ == "__main__":
    main()
