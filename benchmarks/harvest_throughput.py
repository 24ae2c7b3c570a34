"""Harvest throughput against its bound: the same CI program over the same batches with nothing
counted ("forward + CI only") vs `pdctl harvest` (the program plus `accumulate.Harvest`'s host
work and the database), tokens per second, sides interleaved in one process.

    python benchmarks/harvest_throughput.py RUN_DIR [--tokens N] [--batch-size B] [--repeats 3]

RUN_DIR is a trained LM run (its train checkpoint is read, nothing in it is changed except
harvest/harvest.db, which the harvest side rewrites).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from pdctl.engine import runtime

    runtime.configure_devices()
    import jax
    import numpy as np

    from pdctl.engine import sharding
    from pdctl.harvest import run as hv
    from pdctl.project import Project
    from pdctl.report import load
    from pdctl.science.spd import evaluate
    from pdctl.stages.common import StageEnv, corpus_tokens

    project = Project.load(args.run / "pdctl.toml")
    cfg = project.config
    dec = load.load_decomposition(project, "train")
    mesh = sharding.make_mesh(-1, 1)
    B = args.batch_size or cfg.train.eval_batch_size
    T = cfg.data.seq_len
    env = StageEnv(project, "train", mesh, dec.target)
    stream = np.asarray(corpus_tokens(env, "eval"))
    n_windows = stream.size // T
    if args.tokens:
        n_windows = min(n_windows, args.tokens // T)
    windows = stream[: n_windows * T].reshape(n_windows, T).astype(np.int32)
    rep = sharding.replicated(mesh)
    params, comps, ci_fns = (jax.device_put(x, rep) for x in (dec.params, dec.components,
                                                                dec.ci_fns))  # fmt: skip
    in_sh = sharding.batch_sharding(mesh, 2)

    def bound() -> float:
        t0 = time.perf_counter()
        for lo in range(0, n_windows, B):
            x = windows[lo : lo + B]
            if x.shape[0] < B:
                x = np.concatenate([x, np.zeros((B - x.shape[0], T), x.dtype)])
            ci, _ = evaluate.compute_ci_jit(
                dec.target, params, comps, ci_fns, cfg, jax.device_put(x, in_sh)
            )
            jax.tree.map(np.asarray, ci)  # to the host, as the harvest does
        return time.perf_counter() - t0

    def harvest() -> float:
        t0 = time.perf_counter()
        hv.harvest(project, n_tokens=n_windows * T, batch_size=B)
        return time.perf_counter() - t0

    bound(), harvest()  # compiles
    rows = []
    for _ in range(args.repeats):
        rows.append((bound(), harvest()))
    n = n_windows * T
    b, h = min(r[0] for r in rows), min(r[1] for r in rows)
    print(f"{n} tokens, batch {B} x {T}, {len(jax.devices())} devices, "
          f"{sum(dec.site_C.values())} components in {len(dec.site_C)} sites")  # fmt: skip
    print("| side | best s | tokens/s |")
    print("|---|---|---|")
    print(f"| forward + CI only | {b:.3f} | {n / b:.0f} |")
    print(f"| harvest | {h:.3f} | {n / h:.0f} |")
    print(f"\nharvest / bound throughput: {b / h:.3f}")


if __name__ == "__main__":
    main()
