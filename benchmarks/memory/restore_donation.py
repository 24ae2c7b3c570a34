"""Are arrays restored by orbax donatable? (jax-ml/jax#18617) The donated fraction of a
checkpoint's arrays fed straight into a donating step, and after `checkpoint.rematerialize`.

A state of a replicated 1 MiB leaf, an fsdp-sharded 4 MiB leaf and a tiny one is saved with
pdctl's `Checkpointer`, restored `--restores` times into abstract arrays that carry the target
shardings, and each restore goes through a donating `x + 1` step, either as orbax returned it
("direct") or re-materialised first ("rematerialize", what every stage does before its first
step). The fraction is bytes-weighted buffer-pointer reuse (`engine.donation`), the figure the
loop's DONATION FAILED check reads.

On JAX 0.10.2 / orbax 0.12.8 / CPU, restored host buffers that happen to be 64-byte aligned
are adopted zero-copy and never donated, so "direct" varies from restore to restore (measured
0.02-0.99) while "rematerialize" is always 1.00. When "direct" reads 1.00 on every restore, the
JAX bug is gone and `rematerialize` is a cheap no-op copy that could be dropped.

    python -m benchmarks.memory.restore_donation [--devices 4] [--restores 5]

Exits 1 when a re-materialised restore is not fully donated (pdctl's fix stopped working).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchmarks._harness import machine_line

SIZES = {"rep": 1 << 18, "shard": 1 << 20, "small": 16}  # float32 elements


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
    ap.add_argument("--restores", type=int, default=5)
    args = ap.parse_args()
    print(machine_line())
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pdctl.engine import donation, sharding
    from pdctl.engine.checkpoint import Checkpointer, rematerialize

    n = jax.device_count()
    mesh = sharding.make_mesh(1, n)
    specs = {"rep": P(), "shard": P("fsdp"), "small": P()}
    sh = {k: NamedSharding(mesh, specs[k]) for k in specs}
    make = jax.jit(
        lambda: {k: jnp.arange(m, dtype=jnp.float32) for k, m in SIZES.items()},
        out_shardings=sh,
    )
    step = jax.jit(
        lambda s: jax.tree.map(lambda x: x + 1, s),
        in_shardings=(sh,),
        out_shardings=sh,
        donate_argnums=(0,),
    )

    def fraction(tree) -> float:
        before = donation.buffer_bytes_by_ptr(tree)
        out = step(tree)
        jax.block_until_ready(out)
        return donation.reused_fraction(before, out)[0]

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(Path(tmp) / "ckpt", keep=1)
        state = make()
        ckpt.save(1, {"state": state})
        ckpt.wait()
        abstract = {"state": sharding.abstract_with_shardings(state, sh)}
        fresh = fraction(make())
        direct, remat = [], []
        for _ in range(args.restores):
            direct.append(fraction(ckpt.restore(1, abstract)[0]["state"]))
            remat.append(fraction(rematerialize(ckpt.restore(1, abstract)[0]["state"], sh)))
        ckpt.close()

    def span(xs: list[float]) -> str:
        return f"min {min(xs):.2f} max {max(xs):.2f}"

    print(
        f"jax {jax.__version__}, orbax {ocp.__version__}, {n} {jax.devices()[0].platform} "
        f"device(s), {args.restores} restores; donated fraction (bytes-weighted pointer reuse):"
    )
    print(f"  {'fresh jit output':<25}{fresh:.2f}")
    print(f"  {'restored, direct':<25}{span(direct)}  ({' '.join(f'{x:.2f}' for x in direct)})")
    print(f"  {'restored, rematerialize':<25}{span(remat)}")
    bug = "present" if min(direct) < 1.0 else "not seen (every direct restore fully donated)"
    print(f"jax#18617 (restored arrays not reliably donatable): {bug}")
    ok = min(remat) == 1.0
    print(f"rematerialize makes every restore fully donatable: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
