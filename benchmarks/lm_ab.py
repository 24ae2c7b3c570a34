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

    python benchmarks/lm_ab.py --gguf PATH --text DIR --out DIR [--steps 10000] [--batch 16]
        [--seq 256] [--eval-every 1000] [--deadline-s 0] [--arms A B] [--imp 1e-5]

`--deadline-s` (wall seconds from the start): both arms stop at the same step when the next
round of steps would pass it (the schedules were set for `--steps`; the output says where they
stopped). Long: a benchmark, never a test.
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

T0 = time.perf_counter()


def arm_overrides(arm: str, args: argparse.Namespace) -> dict:
    site = f"model.layers.{args.layer}.mlp.*"
    if arm == "A":
        return {
            "decomp": {"sites": [{"pattern": site, "C": 1024}]},
            "warmup": {"steps": args.warmup_steps},
            "train": {
                "loss": {
                    "importance_minimality": 2e-5,
                    "p": 2.0,
                    "p_final": 0.4,
                    "beta": 0.5,
                    "stochastic_recon_subset": 1.0,
                    "ci_masked_recon": 1.0,
                }
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

    def __init__(self, name: str, args: argparse.Namespace, mesh, params_cache: dict):
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
        if cfg.decomp.init == "nonlinearity_aligned":
            sites = decomposed_sites(cfg, target)
            weights = target.site_weights(params)
            keys = jax.random.split(stream_key(cfg, STREAM_DECOMP), len(sites))
            for i, (path, side) in enumerate(aligned_sites(cfg, target, sites).items()):
                C = sites[path][2]
                components[path] = jax.device_put(
                    comps_mod.aligned_site_components(keys[i], weights[path], C, side),
                    self.prog.state_shardings["trainable"]["components"][path],
                )
        if cfg.warmup.steps:
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
    args = ap.parse_args()
    if not args.gguf:
        sys.exit("--gguf PATH (or PDCTL_SMOLLM2_GGUF) is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import jax
    import numpy as np

    from pdctl.engine import sharding

    dev = jax.devices()[0]
    machine = f"{dev.platform} {getattr(dev, 'device_kind', '?')}, jax {jax.__version__}"
    print(f"# {machine}; layer {args.layer}, {args.batch} x {args.seq} tokens, {args.steps} steps")
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    cache: dict = {}
    arms = [Arm(a, args, mesh, cache) for a in args.arms]
    base = arms[0].cfg
    train_ids = np.asarray(corpus(base, "train"))
    eval_ids = np.asarray(corpus(base, "eval"))
    S = args.seq + 1
    n_eval = min(args.eval_batch, len(eval_ids) // S)
    eval_batch = {"tokens": jax.numpy.asarray(eval_ids[: n_eval * S].reshape(n_eval, S))}
    rng = np.random.default_rng(0)

    def batch_at():
        starts = rng.integers(0, len(train_ids) - S, args.batch)
        tok = np.stack([train_ids[s : s + S] for s in starts]).astype(np.int32)
        return jax.device_put({"tokens": tok}, arms[0].prog.batch_shardings)

    first = batch_at()

    def prepare(a: Arm) -> dict:
        a.compile(first)
        return a.evaluate(0, eval_batch)  # compiles the evaluation's programs too

    with ThreadPoolExecutor(len(arms)) as pool:  # XLA compiles the arms side by side
        step0 = list(pool.map(prepare, arms))
    setup_s = time.perf_counter() - T0
    for a in arms:
        print(
            f"# {a.name}: train compile {a.compile_s:.0f} s, warmup {a.warmup_s:.0f} s "
            f"(floor {a.warmup_floor}); setup done at {setup_s:.0f} s",
            flush=True,
        )
    print(HEADER)
    for a, r in zip(arms, step0, strict=True):
        print(fmt_eval(a.name, r), flush=True)
    stepping, done, batch = 0.0, 0, first
    for step in range(1, args.steps + 1):
        if args.deadline_s and done:
            left = args.deadline_s - (time.perf_counter() - T0)
            # the next logging window and a final evaluation must fit
            if left < stepping / done * args.log_every + 20:
                print(f"# deadline: stopped after step {done} of {args.steps}", flush=True)
                break
        t = time.perf_counter()
        for a in arms:
            m = a.step(batch)
            if step % args.log_every == 0 or step == args.steps:
                m = jax.device_get(m)
                scalars = {k: float(v) for k, v in m.items() if np.ndim(v) == 0}
                a.log.append({"step": step, **scalars})
        batch = batch_at()
        if step % args.log_every == 0:
            jax.block_until_ready([a.state for a in arms])
        stepping += time.perf_counter() - t
        done = step
        if step % args.eval_every == 0 and step != args.steps:
            for a in arms:
                print(fmt_eval(a.name, a.evaluate(step, eval_batch)), flush=True)
    jax.block_until_ready([a.state for a in arms])
    for a in arms:
        if not a.evals or a.evals[-1]["step"] != done:
            print(fmt_eval(a.name, a.evaluate(done, eval_batch)), flush=True)
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
