"""What the rendezvous fix (tests/engine/test_rendezvous.py) costs: train step and evaluation,
before and after.

On a multi-device XLA:CPU mesh the evaluation now works on a replicated batch, so none of its
programs has a collective (`runtime.collective_free_eval`; see tests/engine/test_rendezvous.py
for the deadlock it avoids). The train step is the same program as before. This measures, on pdctl's
default devices (one CPU device per core), for the llama-mlp template's LM and (with
transformers installed) a tiny imported Llama:
  - the train step (the train stage's program, best of `--windows` windows of `--steps` steps);
  - one evaluation with the batch sharded over the data axis (before) and replicated (after),
    interleaved (before, after, before, after, ...) in one process, best of `--rounds` each;
  - the ratio after / before, and what it adds per train step at the template's `eval_every`.

    python benchmarks/rendezvous.py [--steps 20] [--windows 3] [--rounds 5]

The "before" evaluation is the deadlock-prone one: on a loaded machine it can abort the
process (that is the bug). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _harness import rendezvous_llama


def hf_model(root: Path) -> Path:
    """A tiny random Llama (2 layers, d 64) with a byte-level BPE tokenizer and a corpus
    (tests/fixtures.py's, the one tests/engine/test_rendezvous.py runs)."""
    return rendezvous_llama(root)["model"]


def configs(root: Path) -> list[tuple[str, Path, dict]]:
    """(name, run directory, config overrides) of the runs measured."""
    out: list[tuple[str, Path, dict]] = [("llama-mlp", root / "lm", {"train": {"batch_size": 16}})]
    try:
        model = hf_model(root)
    except ImportError:
        print("transformers/torch not installed: the imported-Llama row is skipped")
        return out
    over = {
        "target": {"path": str(model)},
        "data": {"path": str(root / "corpus.jsonl"), "seq_len": 32},
        "decomp": {
            "sites": [{"pattern": "*.mlp.*", "C": 8}, {"pattern": "*attn.*", "C": 4}],
            "ci_fn": {"type": "shared_mlp", "hidden": [8]},
        },
        "train": {"batch_size": 4, "eval_batch_size": 4},
    }
    out.append(("hf-lm (2 layers)", root / "hf", over))
    return out


def make_run(root: Path, name: str, template: str, over: dict) -> Path:
    import tomllib

    import tomli_w

    from pdctl.templates import create_run

    run = create_run(name, template, root)
    raw = tomllib.loads((run / "pdctl.toml").read_text())
    for table, keys in over.items():
        raw.setdefault(table, {}).update(keys)
    (run / "pdctl.toml").write_text(tomli_w.dumps(raw))
    return run


def measure(run: Path, args: argparse.Namespace) -> dict:
    import jax
    import numpy as np

    from pdctl.engine import runtime, sharding
    from pdctl.project import Project
    from pdctl.stages import train, train_eval
    from pdctl.stages.env import StageEnv
    from pdctl.stages.init_weights import init_decomposition
    from pdctl.stages.inputs import STREAM_DECOMP, STREAM_TARGET, stream_key, target_from_config

    proj = Project.load(run / "pdctl.toml")
    cfg = proj.config
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    target = target_from_config(cfg, proj.root)
    env = StageEnv(proj, "train", mesh, target)  # a view: no lock, nothing written
    prog = train.program(cfg, mesh, target)
    params = jax.jit(target.init, out_shardings=prog.frozen_shardings[0])(
        stream_key(cfg, STREAM_TARGET)
    )
    dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
    state = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
    rng = np.random.default_rng(0)
    vocab = getattr(target, "vocab_size", None) or target.spec.vocab_size
    tokens = rng.integers(0, vocab, (cfg.train.batch_size, cfg.data.seq_len + 1))
    batch = {"tokens": jax.device_put(tokens.astype(np.int32), prog.batch_shardings["tokens"])}
    step = prog.jit().lower(params, state, batch).compile()
    for _ in range(2):
        state, m = step(params, state, batch)
    jax.block_until_ready(state)
    best_step = float("inf")
    for _ in range(args.windows):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state, m = step(params, state, batch)
        jax.block_until_ready((state, m))
        best_step = min(best_step, (time.perf_counter() - t0) / args.steps)

    fns = train.spd_fns(cfg, target)
    shipped = runtime.collective_free_eval
    runtime.collective_free_eval = lambda mesh: False  # the code before the fix
    try:
        before = train_eval.make_eval(env, params, fns)
    finally:
        runtime.collective_free_eval = shipped
    after = train_eval.make_eval(env, params, fns)
    ev_b, ev_a = before(state), after(state)  # compile both
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name, fn in (("before", before), ("after", after)):
            t0 = time.perf_counter()
            fn(state)
            times[name].append(time.perf_counter() - t0)
    b, a = min(times["before"]), min(times["after"])
    # the CE and KL of each masking (not their differences, which cancel to small numbers)
    keys = [k for k in ev_b if k[:3] in ("ce_", "kl_") and "difference" not in k]
    keys = [k for k in keys if "unrecovered" not in k]
    diff = max(abs(ev_b[k] - ev_a[k]) / max(abs(ev_b[k]), 1e-12) for k in keys)
    return {
        "devices": mesh.size,
        "replicated": shipped(mesh),
        "step_ms": best_step * 1e3,
        "eval_before_ms": b * 1e3,
        "eval_after_ms": a * 1e3,
        "eval_spread_before": max(times["before"]) / b,
        "eval_spread_after": max(times["after"]) / a,
        "eval_every": cfg.train.eval_every,
        "ce_rel_diff": diff,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from pdctl.engine import runtime

    runtime.configure_devices()  # pdctl's default: one CPU device per core
    import jax

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, run, over in configs(root):
            template = "llama-mlp" if name == "llama-mlp" else "hf-lm"
            run = make_run(root, run.name, template, over)
            rows.append((name, measure(run, args)))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {jax.device_count()} devices")
    print(
        f"{'config':18} devices | train step ms | eval ms before  after  after/before | "
        "eval_every  +ms/step  +% of step | CE/KL rel diff"
    )
    for name, r in rows:
        extra = (r["eval_after_ms"] - r["eval_before_ms"]) / r["eval_every"]
        print(
            f"{name:18} {r['devices']:7d} | {r['step_ms']:13.2f} | {r['eval_before_ms']:15.1f} "
            f"{r['eval_after_ms']:6.1f} {r['eval_after_ms'] / r['eval_before_ms']:13.2f}x | "
            f"{r['eval_every']:10d} {extra:9.4f} {100 * extra / r['step_ms']:10.3f}% | "
            f"{r['ce_rel_diff']:.1e}"
        )
    print(
        "train step: the same program before and after (the fix changes only the evaluation's "
        "batch sharding); eval: best of the interleaved rounds; +ms/step = (after - before) / "
        "eval_every; spread (slowest / best) before "
        + ", ".join(f"{r['eval_spread_before']:.2f}" for _, r in rows)
        + ", after "
        + ", ".join(f"{r['eval_spread_after']:.2f}" for _, r in rows)
    )


if __name__ == "__main__":
    main()
