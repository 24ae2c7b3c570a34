"""Where the scanned train step still grows with depth: the lowered program's operations per
extra site, by kind and by the pdctl source line that emits them.

Lowers (does not compile) the train step of `benchmarks/scan_compile.py`'s tiny random Llamas
with `[train] scan_layers = true` at two depths, counts the StableHLO operations, and divides
the difference by the number of extra sites (7 projections per layer). What stays constant
with depth is the scanned layer body; what grows is the per-site work between the stacked
train state and the per-site functions.

    python benchmarks/scan_hlo.py [--layers 8 32] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
SITES_PER_LAYER = 7  # q, k, v, o, gate, up, down
OP = re.compile(r'= "?(stablehlo\.[a-z_]+|sdy\.[a-z_]+)[^\n]*?loc\((#loc\d+)\)')
LOC_DEF = re.compile(r"^(#loc\d+) = loc\((.*)\)$", re.M)
SOURCE = re.compile(r'"[^"]*/(pdctl/[^"]+)":(\d+)')


def lowered_text(n_layers: int) -> tuple[str, float]:
    import scan_compile

    from pdctl.config import parse_config
    from pdctl.engine import sharding
    from pdctl.stages import train
    from pdctl.stages.inputs import target_from_config

    cfg = parse_config(scan_compile.tiny_raw(n_layers, scan=True))
    mesh = sharding.make_mesh(-1, 1)
    target = target_from_config(cfg, need_weights=False)
    prog = train.program(cfg, mesh, target)
    t0 = time.perf_counter()
    text = prog.lower().as_text(debug_info=True)
    return text, time.perf_counter() - t0


def census(text: str) -> collections.Counter:
    """(operation, pdctl source line or '-') -> count."""
    defs = dict(LOC_DEF.findall(text))

    def source(loc: str, depth: int = 0) -> str | None:
        body = defs.get(loc, "")
        m = SOURCE.search(body)
        if m:
            return f"{m.group(1)}:{m.group(2)}"
        if depth < 8:
            for sub in re.findall(r"#loc\d+", body):
                found = source(sub, depth + 1)
                if found:
                    return found
        return None

    return collections.Counter((op, source(loc) or "-") for op, loc in OP.findall(text))


def main() -> None:
    from pdctl.engine import runtime

    runtime.configure_devices()
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs=2, default=[8, 32])
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    lo, hi = a.layers
    (ta, sa), (tb, sb) = lowered_text(lo), lowered_text(hi)
    ca, cb = census(ta), census(tb)
    extra = (hi - lo) * SITES_PER_LAYER
    print(f"lowered step: {lo} layers {sum(ca.values())} ops ({sa:.1f} s), {hi} layers "
          f"{sum(cb.values())} ops ({sb:.1f} s): "
          f"{(sum(cb.values()) - sum(ca.values())) / extra:.1f} ops per extra site")  # fmt: skip
    by_op: collections.Counter = collections.Counter()
    for (op, _), n in cb.items():
        by_op[op] += n
    for (op, _), n in ca.items():
        by_op[op] -= n
    print(f"\n{'operation':<32}{'per extra site':>15}")
    for op, n in by_op.most_common(a.top):
        if n > 0:
            print(f"{op:<32}{n / extra:>15.2f}")
    diff = {k: cb[k] - ca[k] for k in set(ca) | set(cb)}
    print(f"\n{'operation':<32}{'source':<44}{'per extra site':>15}")
    for (op, src), n in sorted(diff.items(), key=lambda kv: -kv[1])[: a.top]:
        if n > 0:
            print(f"{op:<32}{src:<44}{n / extra:>15.2f}")


if __name__ == "__main__":
    main()
