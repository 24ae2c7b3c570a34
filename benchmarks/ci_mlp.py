"""The TMS CI function (`mlp`, one hidden layer of 16, C = 20 per site) forward + backward on
one device at a TMS per-device batch, in formulations that move its (B, C, 16) arrays through
memory differently, interleaved, best of R windows; each against pdctl's own
(`ci.ci_fn_apply`: einsums). Issue 23 item 2's probe: which formulation XLA:CPU runs faster.

    python benchmarks/ci_mlp.py [--batch 2048] [--repeats 5]

Set XLA_FLAGS before it starts to compare XLA options (e.g. an empty
`--xla_cpu_experimental_ynn_fusion_type=` turns off the YNNPACK reduction fusions).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
import jax.numpy as jnp

from pdctl.science.spd.ci import _gelu, ci_fn_apply

C, H = 20, 16
_INV_SQRT2 = 0.7071067811865476
_INV_SQRT2PI = 0.3989422804014327


def pdctl_form(p, h):
    return ci_fn_apply("mlp", p, None, h)


def broadcast_form(p, h):
    """No einsum: a broadcast multiply-add, GELU, a multiply and a sum over the hidden axis."""
    a = _gelu(h[..., None] * p["0"]["W"][:, 0, :] + p["0"]["b"])
    return jnp.sum(a * p["1"]["W"][:, :, 0], axis=-1) + p["1"]["b"][:, 0]


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


FORMS = {"pdctl (einsum)": pdctl_form, "broadcast": broadcast_form,
         "custom_vjp recompute": recompute_form, "layout (C, H, B)": lanes_form}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {"0": {"W": jax.random.normal(k[0], (C, 1, H)), "b": jax.random.normal(k[1], (C, H))},
              "1": {"W": jax.random.normal(k[2], (C, H, 1)),
                    "b": jax.random.normal(k[3], (C, 1))}}  # fmt: skip
    h = jax.random.normal(k[4], (args.batch, C))
    g = jax.random.normal(k[5], (args.batch, C))

    def step(f):
        # the CI's use in the loss: squashed, then weighted (a stand-in for the loss terms)
        return jax.jit(jax.value_and_grad(
            lambda p, h: jnp.sum(jnp.clip(f(p, h), 0, 1) * g), argnums=(0, 1)))  # fmt: skip

    fns = {n: step(f) for n, f in FORMS.items()}
    ref = fns["pdctl (einsum)"](params, h)
    diffs = {}
    for n, f in fns.items():
        out = f(params, h)
        pairs = zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True)
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
    base = best["pdctl (einsum)"]
    flags = os.environ.get("XLA_FLAGS")
    print(f"CI MLP fwd+bwd, one site, ({args.batch}, {C}, {H}), 1 device, "
          f"XLA_FLAGS={flags!r}, best of {args.repeats} x {args.calls}")  # fmt: skip
    print(f"{'formulation':<22} {'ms':>8} {'vs pdctl':>9} {'max |diff|':>11}")
    for n in fns:
        print(f"{n:<22} {best[n] * 1e3:>8.3f} {base / best[n]:>8.2f}x {diffs[n]:>11.2e}")


if __name__ == "__main__":
    main()
