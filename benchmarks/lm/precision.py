"""What the precision policy (`pdctl.engine.precision`) costs and buys, on whatever JAX runs on.

SmolLM2-135M-Instruct from its GGUF, the MLP of one layer (gate / up / down, C per site), on
real text (Debian's fortunes), the smollm2 template's losses, one process, one device. Arms:

- `old`: faithfulness at the platform's default matmul precision (pdctl before the policy: on a
  TPU one bf16 pass), every other matmul at default;
- `new`: faithfulness at full float32 precision (`arrays.exact_matmul`), the rest at default;
- `high` / `highest`: `[precision] matmul` for every other matmul as well.

Printed, per arm: the warmup's faithfulness after `--warmup-steps` steps (the floor V U reaches),
the train step's ms at `--batch` x `--seq` tokens (best of 3 windows, the arms interleaved),
tokens/s, XLA's FLOPs of the step and MFU against `--peak-tflops`, and the unmasked / CI-masked
KL of an evaluation at the default and at the `eval_matmul` precision. Ratios against `old`.

    python -m benchmarks.lm.precision --gguf PATH --text DIR [--arms old new high highest]
        [--batch 32] [--seq 256] [--layer 15] [--C 1024] [--warmup-steps 1000] [--steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import tomllib
from pathlib import Path

from benchmarks._harness import machine_line


def _machine() -> str:
    import jax

    d, n = jax.devices()[0], len(jax.devices())
    return f"{d.platform} {getattr(d, 'device_kind', '?')} x{n}, jax {jax.__version__}"


@contextlib.contextmanager
def faithfulness_at_default():
    """The term as pdctl computed it before the policy: V @ U at the default precision."""
    from pdctl.science.spd import losses

    exact = losses.exact_matmul
    losses.exact_matmul = lambda a, b: a.astype("float32") @ b.astype("float32")
    try:
        yield
    finally:
        losses.exact_matmul = exact


def config(args: argparse.Namespace, matmul: str = "default"):
    from pdctl.config import parse_config
    from pdctl.templates import templates_root

    raw = tomllib.loads((templates_root() / "smollm2" / "pdctl.toml").read_text())
    raw["target"]["path"] = str(Path(args.gguf).resolve())
    raw["data"]["path"] = str(Path(args.text).resolve())
    raw["data"]["seq_len"] = args.seq
    raw["decomp"]["sites"] = [{"pattern": f"model.layers.{args.layer}.mlp.*", "C": args.C}]
    raw["train"]["batch_size"] = args.batch
    raw["mesh"] = {"data": 1, "fsdp": 1}
    raw["precision"]["matmul"] = matmul
    # the table reads the unmasked and CI-masked KL only: no fresh-PGD evaluation, whose
    # program took minutes of the TPU's compile time for nothing here
    raw["train"]["eval_pgd"] = {"enabled": False}
    return parse_config(raw)


def tokens(args: argparse.Namespace, n: int, offset: int = 0):
    import numpy as np

    from pdctl.science import data

    tok = data.corpus_tokenizer(Path(args.gguf).resolve())
    files = sorted(p for p in Path(args.text).iterdir() if p.is_file() and p.suffix != ".dat")
    texts = [t for f in files for t in f.read_text(errors="replace").split("\n%\n")]
    ids = data._encode(tok.tokenizer, texts, tok.eos_id)
    S = args.seq + 1
    start = offset * S
    return np.asarray(ids[start : start + n * S].reshape(n, S), dtype=np.int32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.environ.get("PDCTL_SMOLLM2_GGUF"))
    ap.add_argument("--text", default=os.environ.get("PDCTL_TEXT", "/usr/share/games/fortunes"))
    ap.add_argument("--arms", nargs="+", default=["old", "new", "high", "highest"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--C", type=int, default=1024)
    ap.add_argument("--warmup-steps", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--peak-tflops", type=float, default=197.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--warmup-only", action="store_true", help="the warmup floor alone")
    args = ap.parse_args()
    print(machine_line())
    if not args.gguf:
        sys.exit("--gguf PATH (or PDCTL_SMOLLM2_GGUF) is required")

    import jax
    import numpy as np

    from pdctl.engine import sharding
    from pdctl.engine.precision import matmul_scope
    from pdctl.science.spd import evaluate
    from pdctl.science.targets import imported
    from pdctl.stages import train, warmup
    from pdctl.stages.init_weights import init_decomposition
    from pdctl.stages.inputs import STREAM_DECOMP, stream_key, target_from_config

    print(f"# {_machine()}; layer {args.layer} C={args.C}, {args.batch} x {args.seq} tokens")
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    base = config(args)
    target = target_from_config(base)
    params = None
    results: dict[str, dict] = {}
    steps, progs, states = {}, {}, {}
    batch = tokens(args, args.batch)
    eval_tokens = tokens(args, args.eval_batch, offset=args.batch)

    for arm in args.arms:
        matmul = arm if arm in ("high", "highest") else "default"
        cfg = config(args, matmul)
        scope = faithfulness_at_default() if arm == "old" else contextlib.nullcontext()
        with scope:
            wprog = warmup.program(cfg, mesh, target)
            if params is None:
                params = imported.load(target, wprog.frozen_shardings[0], dtype=target.param_dtype)
            dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
            wstep = wprog.jit()
            wstate = wprog.jit_make_state()(dec["components"])
            t = time.perf_counter()
            for _ in range(args.warmup_steps):
                wstate, wm = wstep(params, wstate, None)
            floor = float(jax.device_get(wm["faithfulness"]))
            warm_s = time.perf_counter() - t
            if args.warmup_only:
                print(f"# {arm}: warmup floor {floor:.3g} in {warm_s:.1f} s", flush=True)
                continue
            prog = train.program(cfg, mesh, target)
            state = prog.jit_make_state()(wstate["components"], dec["ci_fns"], dec["sources"])
            b = jax.device_put({"tokens": batch}, prog.batch_shardings)
            t = time.perf_counter()
            compiled = prog.jit().lower(params, state, b).compile()
            compile_s = time.perf_counter() - t
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        state, m = compiled(params, state, b)
        first = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
        comps = wstate["components"]
        kl = {}
        for name, prec in (("default", "default"), ("eval", cfg.precision.eval_matmul)):
            with matmul_scope(prec):
                ev = evaluate.lm_eval(
                    target, params, comps, dec["ci_fns"], cfg,
                    {"tokens": jax.numpy.asarray(eval_tokens)}, jax.random.PRNGKey(0),
                )  # fmt: skip
            kl[name] = {"unmasked": ev["kl/unmasked"], "ci_masked": ev["kl/ci_masked"]}
        steps[arm], progs[arm], states[arm] = compiled, b, state
        results[arm] = {
            "warmup_faithfulness": floor,
            "warmup_s": warm_s,
            "train_compile_s": compile_s,
            "gflop": float(cost.get("flops", float("nan"))) / 1e9,
            "first_step": {
                k: first[k]
                for k in ("faithfulness", "total", "stochastic_recon_subset")
                if k in first
            },
            "kl": kl,
        }
        print(f"# {arm}: warmup floor {floor:.3g} in {warm_s:.1f} s, compile {compile_s:.1f} s",
              flush=True)  # fmt: skip

    if args.warmup_only:
        return

    def window(arm: str) -> float:
        fn, b = steps[arm], progs[arm]
        t = time.perf_counter()
        for _ in range(args.steps):
            states[arm], m = fn(params, states[arm], b)
        jax.block_until_ready(m)
        return (time.perf_counter() - t) / args.steps * 1e3

    for arm in args.arms:  # warm
        window(arm)
    best = {arm: float("inf") for arm in args.arms}
    for _ in range(3):  # interleaved windows
        for arm in args.arms:
            best[arm] = min(best[arm], window(arm))

    ntok = args.batch * args.seq
    ref = best.get("old", next(iter(best.values())))
    print(
        "| arm | warmup faithfulness | step ms | x old | tokens/s | MFU | first-step faithfulness"
        " / total | unmasked KL (default / eval) | compile s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for arm in args.arms:
        r = results[arm]
        ms = best[arm]
        r["step_ms"], r["tokens_per_s"] = ms, ntok / ms * 1e3
        r["mfu"] = r["gflop"] * 1e9 / (ms / 1e3) / (args.peak_tflops * 1e12)
        f = r["first_step"]
        print(
            f"| {arm} | {r['warmup_faithfulness']:.3g} | {ms:.1f} | {ms / ref:.3f} | "
            f"{r['tokens_per_s'] / 1e3:.1f}k | {r['mfu']:.2f} | "
            f"{f.get('faithfulness', float('nan')):.3g} / {f.get('total', float('nan')):.3g} | "
            f"{r['kl']['default']['unmasked']:.2g} / {r['kl']['eval']['unmasked']:.2g} | "
            f"{r['train_compile_s']:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": _machine(), "args": vars(args), **results}, indent=1)
        )


if __name__ == "__main__":
    main()
