"""Compile + run seconds of the decomposition init: per-site jit vs vmap-stacked groups.

A llama-like target with 14 decomposed sites per layer (self- and cross-attention q/k/v/o and
two MLPs' gate/up/down; 4 distinct shapes, C = 8 for attention and 16 for the MLPs) at 1, 8 and
32 layers = 14, 112 and 448 sites, on 4 simulated CPU devices (mesh fsdp=4, so V/U are sharded
over their component axis). Both forms run `pdctl.stages.init_weights.init_decomposition` (V/U,
CI functions and PPGD sources); the naive form with `engine.init.per_item_init` swapped in for
`grouped_init`. Each measurement runs in its own process (fresh JAX, no compile cache) and is
capped at --cap seconds.

    python -m benchmarks.startup.init_compile [--sites 14 112 448] [--cap 180]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks._harness import child_env, machine_line, module_argv
from pdctl.science.targets.base import Target

SITES_PER_LAYER = 14


def _names_shapes(d: int = 32, d_kv: int = 16, m: int = 64) -> dict[str, tuple[int, int]]:
    shapes = {}
    for block in ("attn", "xattn"):
        shapes[f"{block}.q"] = (d, d)
        shapes[f"{block}.k"] = (d, d_kv)
        shapes[f"{block}.v"] = (d, d_kv)
        shapes[f"{block}.o"] = (d, d)
    for block in ("mlp", "mlp2"):
        shapes[f"{block}.gate"] = (d, m)
        shapes[f"{block}.up"] = (d, m)
        shapes[f"{block}.down"] = (m, d)
    assert len(shapes) == SITES_PER_LAYER
    return shapes


class LlamaLike(Target):
    """Just enough of a Target for `init_decomposition`: site paths and shapes (the base class's
    defaults for the rest: no tied sites, no layers to start from)."""

    kind, output_kind = "llama_like", "logits"

    def __init__(self, n_layers: int) -> None:
        self.shapes = {
            f"layers.{i}.{n}": s for i in range(n_layers) for n, s in _names_shapes().items()
        }

    def site_shapes(self) -> dict[str, tuple[int, int]]:
        return dict(self.shapes)

    def site_paths(self) -> list[str]:
        return list(self.shapes)


def child(kind: str, n_sites: int) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import jax

    from pdctl.config import parse_config
    from pdctl.engine import init as engine_init
    from pdctl.engine.sharding import make_mesh
    from pdctl.stages import init_weights

    n_layers = n_sites // SITES_PER_LAYER
    cfg = parse_config(
        {
            "schema": 1,
            "target": {"kind": "llama_mlp"},
            "decomp": {
                "sites": [
                    {"pattern": "layers.*.*attn.*", "C": 8},
                    {"pattern": "layers.*.mlp*", "C": 16},
                ],
                "ci_fn": {"type": "mlp", "hidden": [16]},
            },
        }
    )
    target = LlamaLike(n_layers)
    if kind == "per_item":
        init_weights.grouped_init = engine_init.per_item_init
    mesh = make_mesh(1, 4)
    key = jax.random.PRNGKey(0)
    t0 = time.perf_counter()
    out, compile_s = init_weights.init_decomposition(cfg, target, mesh, key)
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
    compile_total = sum(compile_s.values())
    sites = init_weights.decomposed_sites(cfg, target)
    print(
        json.dumps(
            {
                "kind": kind,
                "sites": n_sites,
                "groups": len(set(sites.values())),
                "compile_s": compile_total,
                "run_s": wall - compile_total,
                "wall_s": wall,
                "arrays": len(jax.tree.leaves(out)),
            }
        )
    )


def measure(kind: str, n_sites: int, cap: float) -> dict:
    env = child_env()
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, *module_argv(__spec__.name, "--child", kind, n_sites)],
            env=env,
            capture_output=True,
            text=True,
            timeout=cap,
        )
    except subprocess.TimeoutExpired:
        return {"kind": kind, "sites": n_sites, "capped": True, "wall_s": time.perf_counter() - t0}
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def _fmt(r: dict, key: str) -> str:
    return f">{r['wall_s']:.0f} (cap)" if r.get("capped") else f"{r[key]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sites", type=int, nargs="+", default=[14, 112, 448])
    ap.add_argument("--cap", type=float, default=180.0, help="seconds per measurement")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SITES"))
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]))
        return
    print(machine_line())
    print("init_decomposition (V/U + CI fns + sources), 4 simulated CPU devices, fsdp=4")
    hdr = (
        f"{'sites':>6} {'groups':>6} | {'per-item compile':>16} {'run':>6} | "
        f"{'stacked compile':>15} {'run':>6} | {'compile ratio':>13}"
    )
    print(hdr)
    print("-" * len(hdr))
    for n in a.sites:
        g = measure("grouped", n, a.cap)
        p = measure("per_item", n, a.cap)
        if p.get("capped"):
            ratio = f">{p['wall_s'] / g['compile_s']:.0f}x"
        else:
            ratio = f"{p['compile_s'] / g['compile_s']:.1f}x"
        print(
            f"{n:>6} {g['groups']:>6} | {_fmt(p, 'compile_s'):>16} "
            f"{'-' if p.get('capped') else _fmt(p, 'run_s'):>6} | "
            f"{_fmt(g, 'compile_s'):>15} {_fmt(g, 'run_s'):>6} | {ratio:>13}",
            flush=True,
        )


if __name__ == "__main__":
    main()
