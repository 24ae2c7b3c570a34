"""The CI function (`mlp`, one hidden layer of 16) forward + backward on one device at the
per-device shapes of the templates' train steps (2 devices: half the batch each), in
formulations that move its (B, C, 16) arrays through memory differently, interleaved, best of
R rounds; each against pdctl's own (`ci.ci_fn_apply`). The first probe (a hand-written
backward, then `benchmarks/ci_vjp.py`) and the second (the layers of width 1 as products and
sums, XLA:CPU's YNNPACK reduction fusions) in one script.

    python benchmarks/ci_mlp.py [--shapes tms ...] [--repeats 5]

XLA_FLAGS as the environment sets it, else pdctl's (`runtime.cpu_xla_flags`); set
`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_dot,reduce` to see XLA's default.
"""

from __future__ import annotations

import argparse
import os
import time

from pdctl.engine.runtime import cpu_xla_flags

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
).strip()
cpu_xla_flags()

import jax  # noqa: E402  (after the XLA flags)
import jax.numpy as jnp  # noqa: E402

from pdctl.science.spd.ci import _gelu, ci_fn_apply  # noqa: E402

H = 16
SHAPES = {"tms": (2048, 20), "tms-40-10": (4096, 200), "resid-mlp": (1024, 100)}  # (B, C)
_INV_SQRT2 = 0.7071067811865476
_INV_SQRT2PI = 0.3989422804014327


def pdctl_form(p, h):
    return ci_fn_apply("mlp", p, None, h)


def einsum_form(p, h):
    """pdctl's before `ci._per_component`: both layers as batched einsums (contractions of 1
    and 16)."""
    a = h[..., None]
    for i in ("0", "1"):
        a = jnp.einsum("...ci,cio->...co", a, p[i]["W"]) + p[i]["b"]
        a = _gelu(a) if i == "0" else a
    return a[..., 0]


@jax.custom_vjp
def _mlp1(w1, b1, w2, b2, h):
    return jnp.sum(_gelu(h[..., None] * w1 + b1) * w2, axis=-1) + b2


def _mlp1_fwd(w1, b1, w2, b2, h):
    return _mlp1(w1, b1, w2, b2, h), (w1, b1, w2, h)  # saves only the (B, C) input


def _mlp1_bwd(res, gz):
    w1, b1, w2, h = res
    pre = h[..., None] * w1 + b1  # recomputed, not stored
    cdf = 0.5 * (1.0 + jax.lax.erf(pre * _INV_SQRT2))
    dpre = (gz[..., None] * w2) * (cdf + pre * _INV_SQRT2PI * jnp.exp(-0.5 * pre * pre))
    lead = tuple(range(h.ndim - 1))
    return (jnp.sum(dpre * h[..., None], axis=lead), jnp.sum(dpre, axis=lead),
            jnp.sum(gz[..., None] * pre * cdf, axis=lead), jnp.sum(gz, axis=lead),
            jnp.sum(dpre * w1, axis=-1))  # fmt: skip


_mlp1.defvjp(_mlp1_fwd, _mlp1_bwd)


def recompute_form(p, h):
    """A custom VJP whose backward recomputes the pre-activations inside the reductions."""
    return _mlp1(p["0"]["W"][:, 0, :], p["0"]["b"], p["1"]["W"][:, :, 0], p["1"]["b"][:, 0], h)


def lanes_form(p, h):
    """Layout (C, H, B): the batch on the vector lanes."""
    pre = h.T[:, None, :] * p["0"]["W"][:, 0, :, None] + p["0"]["b"][:, :, None]
    return (jnp.sum(_gelu(pre) * p["1"]["W"][:, :, 0, None], axis=1) + p["1"]["b"]).T


FORMS = {"pdctl": pdctl_form, "einsum (before)": einsum_form,
         "custom_vjp recompute": recompute_form, "layout (C, H, B)": lanes_form}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    print(f"CI MLP fwd+bwd, one site, 1 device, XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}, "
          f"best of {args.repeats} x {args.calls}")  # fmt: skip
    print(f"{'shape':<10} {'formulation':<22} {'ms':>8} {'vs pdctl':>9} {'max |diff|':>11}")
    for name in args.shapes:
        B, C = SHAPES[name]
        k = jax.random.split(jax.random.PRNGKey(0), 6)
        params = {
            "0": {"W": jax.random.normal(k[0], (C, 1, H)), "b": jax.random.normal(k[1], (C, H))},
            "1": {"W": jax.random.normal(k[2], (C, H, 1)), "b": jax.random.normal(k[3], (C, 1))},
        }
        h = jax.random.normal(k[4], (B, C))
        g = jax.random.normal(k[5], (B, C))

        def step(f, g=g):
            # the CI's use in the loss: squashed, then weighted (a stand-in for the loss terms)
            return jax.jit(jax.value_and_grad(
                lambda p, x: jnp.sum(jnp.clip(f(p, x), 0, 1) * g), argnums=(0, 1)))  # fmt: skip

        fns = {n: step(f) for n, f in FORMS.items()}
        ref = fns["pdctl"](params, h)
        diffs = {}
        for n, f in fns.items():
            pairs = zip(jax.tree.leaves(f(params, h)), jax.tree.leaves(ref), strict=True)
            diffs[n] = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.repeats):
            for n, f in fns.items():
                jax.block_until_ready(f(params, h))
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    r = f(params, h)
                jax.block_until_ready(r)
                best[n] = min(best[n], (time.perf_counter() - t0) / args.calls)
        for n in fns:
            print(f"{name:<10} {n:<22} {best[n] * 1e3:>8.3f} {best['pdctl'] / best[n]:>8.2f}x "
                  f"{diffs[n]:>11.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
