"""Where a train step's time goes on a TPU v5e, without a chip: XLA:TPU's own cost model.

XLA:TPU writes an `estimated_cycles` figure into the backend config of every op it emits
(fusions, dots, copies, ...). This sums them over the optimized program of each configuration of
`tpu/fit.py` (compiled for v5e:1x1 by libtpu on this CPU, as `tpu/fit.py --device-kind tpu-v5e`
does), each `while` loop's body multiplied by its trip count (read from its condition), and
prints one table: the estimated step time, the part in each loop nest (the PPGD warm-up
ascents, the loss over micro-batches, the layer scans inside them), and each configuration
against the first; then, per configuration, the ops that cost most, named by the JAX operation
that produced them.

The model is XLA's, not a measurement: on the smollm2-all-mlps template it estimated 920 ms a
step where the chip ran 573.9 ms, with the ascents' share 48% against the profile's 46%
(docs/performance.md, "Where a step's time goes, on this CPU"): compare configurations by its
ratios, and confirm on a chip.

    python -m benchmarks.tpu.cost [--gguf PATH] [--configs NAME ...] [--top 25]
        [--hlo-dir DIR]          # also write each optimized program's text there
        [--diff]                 # and the ops that changed most from the first configuration
    python -m benchmarks.tpu.cost --hlo FILE ...  # a program already dumped
    python -m benchmarks.tpu.cost --runs DIR ...  # also each run directory's train step

Needs libtpu (`pip install -e ".[tpu-aot]"`); a configuration compiles in ~70 s on 2 cores.
A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
from pathlib import Path

from benchmarks._harness import machine_line

V5E_GHZ = 1.5  # the v5e TensorCore clock: 197 TFLOP/s over 4 MXUs x 128 x 128 x 2 per cycle

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_OP = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
_TRIP = re.compile(r"s32\[\]\S* constant\((\d+)\)")


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    """The HLO module's computations (name -> instruction lines) and the entry's name."""
    comps: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
        elif cur is not None and line.startswith("  "):
            comps[cur].append(line)
    entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M)
    if entry is None:
        raise ValueError("not an HLO module's text: no ENTRY computation")
    return comps, entry.group(1)


def costed_ops(text: str) -> list[dict]:
    """Every op with an estimated cost: its cycles times the trip counts of the loops around
    it, its name, result shape, JAX op name and loop nest ("while.12x8/while.30x30")."""
    comps, entry = computations(text)

    def trip(cond: str) -> int:
        for line in comps.get(cond, []):
            m = _TRIP.search(line)
            if m:
                return int(m.group(1))
        return 1

    rows: list[dict] = []

    def walk(comp: str, mult: int, nest: tuple[str, ...]) -> None:
        for line in comps.get(comp, []):
            m = _OP.match(line)
            if not m:
                continue
            name, shape, op = m.groups()
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line)
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                n = trip(cond.group(1)) if cond else 1
                if body:
                    walk(body.group(1), mult * n, (*nest, f"{name}x{n}"))
                continue
            if op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                for b in branches.group(1).split(",") if branches else []:
                    walk(b.strip().lstrip("%"), mult, (*nest, name))
                continue
            if op == "call":
                to = re.search(r"to_apply=%?([\w.\-]+)", line)
                if to:
                    walk(to.group(1), mult, (*nest, name))
            cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
            if cycles:
                jax_op = re.search(r'op_name="([^"]*)"', line)
                rows.append(
                    {
                        "cycles": int(cycles.group(1)) * mult,
                        "name": name,
                        "shape": shape.split("{")[0] if not shape.startswith("(") else shape,
                        "op": jax_op.group(1) if jax_op else "",
                        "nest": "/".join(nest),
                    }
                )

    walk(entry, 1, ())
    return rows


def short_op(op: str) -> str:
    """A JAX op name without the step's jit and loop-body prefixes (the part that says what)."""
    return re.sub(r"jit\(step\)/|while/body/|closed_call/", "", op)[-70:]


def ms(cycles: float) -> float:
    return cycles / V5E_GHZ / 1e6


def outer_nests(rows: list[dict]) -> dict[str, float]:
    """Estimated ms by the outermost loop (or "outside loops"), each with everything inside."""
    by: dict[str, float] = collections.defaultdict(float)
    for r in rows:
        by[r["nest"].split("/")[0] or "outside loops"] += ms(r["cycles"])
    return dict(by)


def describe(rows: list[dict], top: int) -> str:
    """The loop nests and the costliest ops (grouped by JAX op name and result shape)."""
    total = sum(ms(r["cycles"]) for r in rows)
    nests: dict[str, float] = collections.defaultdict(float)
    for r in rows:
        nests[r["nest"] or "outside loops"] += ms(r["cycles"])
    out = [f"  estimated {total:.1f} ms a step ({len(rows)} costed ops)", "  by loop nest:"]
    for nest, v in sorted(nests.items(), key=lambda kv: -kv[1])[:12]:
        out.append(f"    {v:8.1f} ms {v / total:6.1%}  {nest}")
    ops: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    for r in rows:
        ops[
            (short_op(r["op"]), r["shape"][:48], r["nest"].split("/")[-1] if r["nest"] else "-")
        ] += ms(r["cycles"])
    out.append("  costliest ops (JAX op, result, innermost loop):")
    for (op, shape, nest), v in sorted(ops.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"    {v:7.2f} ms  {op:70s} {shape:48s} {nest}")
    return "\n".join(out)


def by_op(rows: list[dict]) -> dict[tuple[str, str, int], float]:
    """Estimated ms by (JAX op, result shape, loop depth): comparable across programs, whose
    loops XLA numbers differently."""
    out: dict[tuple[str, str, int], float] = collections.defaultdict(float)
    for r in rows:
        shape = re.sub(r"\{[^}]*\}", "", r["shape"])[:48]
        out[(short_op(r["op"]), shape, r["nest"].count("/") + bool(r["nest"]))] += ms(r["cycles"])
    return dict(out)


def diff(first: list[dict], other: list[dict], top: int) -> str:
    """The ops whose estimated time changed most from `first` to `other`."""
    a, b = by_op(first), by_op(other)
    keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0.0) - a.get(k, 0.0)))
    out = ["  changed most (ms: first -> this; JAX op, result, loop depth):"]
    for op, shape, depth in keys[:top]:
        va, vb = a.get((op, shape, depth), 0.0), b.get((op, shape, depth), 0.0)
        out.append(f"    {va:7.2f} -> {vb:7.2f}  {op:70s} {shape:48s} {depth}")
    return "\n".join(out)


def compile_text(name: str, args) -> tuple[str, float]:
    """The optimized program of `tpu/fit.py`'s configuration `name`, compiled for v5e:1x1,
    and the fit check's predicted peak (GiB)."""
    from benchmarks.tpu import fit as tpu_fit
    from pdctl.inspect import topology

    topo, _ = topology.target(None, "tpu-v5e", None)
    if topo is None:
        sys.exit('no libtpu to compile for a TPU: pip install -e ".[tpu-aot]"')
    f = tpu_fit.Fit(name, args, topology.devices(topo), topo.budget, "aot", {})
    compiled = f.compiled["train step"][0]
    if compiled is None:
        sys.exit(f"{name}: the train step does not compile for one v5e ({f.check['worst']})")
    return compiled.as_text(), f.peak / 2**30


def compile_run(run: Path) -> tuple[str, float]:
    """The optimized train step of the run directory `run` (its pdctl.toml as it stands, on one
    device), compiled for v5e:1x1, and its peak as XLA states it (GiB)."""
    from pdctl.engine import sharding
    from pdctl.inspect import plan, topology
    from pdctl.inspect.memory import memory_report
    from pdctl.project import Project

    topo, _ = topology.target(None, "tpu-v5e", None)
    if topo is None:
        sys.exit('no libtpu to compile for a TPU: pip install -e ".[tpu-aot]"')
    cfg = Project.load(run / "pdctl.toml").config
    mesh = sharding.mesh_from_config(cfg.mesh, topology.devices(topo)[:1])
    compiled = plan(cfg, "train", mesh).program.lower().compile()
    peak = memory_report(compiled, 0)["peak_bytes_estimate"]
    return compiled.as_text(), peak / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.environ.get("PDCTL_SMOLLM2_GGUF"))
    ap.add_argument("--text", default=os.environ.get("PDCTL_TEXT", "/usr/share/games/fortunes"))
    ap.add_argument("--configs", nargs="+", default=["b16 k8 full src-bf16"])
    ap.add_argument("--hlo", nargs="+", help="analyse these dumped programs instead")
    ap.add_argument("--runs", nargs="+", type=Path, default=[], help="run directories to add")
    ap.add_argument("--hlo-dir", help="write each compiled program's text here")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--diff", action="store_true", help="each program's changes from the first")
    args = ap.parse_args()
    args.no_eval = True
    print(f"# {machine_line()}", flush=True)
    programs: list[tuple[str, str]] = []
    if args.hlo:
        programs = [(p, Path(p).read_text()) for p in args.hlo]
    else:
        if not args.gguf:
            sys.exit("--gguf PATH (or PDCTL_SMOLLM2_GGUF) is required")
        from pdctl.engine import runtime

        runtime.configure_devices()
        jobs = [(name, lambda n=name: compile_text(n, args)) for name in args.configs]
        jobs += [(str(run), lambda r=run: compile_run(r)) for run in args.runs]
        for name, make in jobs:
            t = time.perf_counter()
            text, peak = make()
            print(
                f"# {name}: compiled for v5e:1x1 in {time.perf_counter() - t:.0f} s; "
                f"predicted peak {peak:.2f} GiB",
                flush=True,
            )
            if args.hlo_dir:
                Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                Path(args.hlo_dir, re.sub(r"\W+", "_", name) + ".hlo.txt").write_text(text)
            programs.append((name, text))
    results = [(name, costed_ops(text)) for name, text in programs]
    base = sum(r["cycles"] for r in results[0][1])
    print("\n| configuration | estimated ms / step | vs first | biggest loop nests (ms) |")
    print("| --- | --- | --- | --- |")
    for name, rows in results:
        total = sum(r["cycles"] for r in rows)
        nests = sorted(outer_nests(rows).items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in nests)
        print(f"| {name} | {ms(total):.1f} | {base / total:.2f}x | {parts} |")
    for i, (name, rows) in enumerate(results):
        print(f"\n# {name}\n{describe(rows, args.top)}")
        if i and args.diff:
            print(diff(results[0][1], rows, args.top))


if __name__ == "__main__":
    main()
