"""Would a hand-written backward make the `mlp` CI function faster? A probe, kept because its
answer decided what not to build (issue 13).

pdctl's `ci_fn_apply("mlp", ...)` (one hidden layer of 16, autodiff backward) against a
`jax.custom_vjp` that saves only its input h and recomputes the (B, C, hidden) pre-activations in
the backward, computing dh, dW0, db0, dW1, db1 as elementwise products with reductions (no
einsum with a contraction of 1, no transposes). Both jitted as value-and-grad of a fixed
cotangent, on one CPU device, at the per-device shapes of the templates' train steps (2 devices:
half the batch each). Rounds interleave the two; the best round of each is kept.

    python benchmarks/ci_vjp.py [--rounds 5] [--iters 50]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from pdctl.science.spd.ci import ci_fn_apply

_INV_SQRT2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
SHAPES = {"tms (5-2)": (2048, 20), "tms-40-10": (4096, 200), "resid-mlp": (1024, 100)}
HIDDEN = 16


def _pre(h, w0, b0):
    return h[..., None] * w0[:, 0, :] + b0


@jax.custom_vjp
def mlp_ci_vjp(h, w0, b0, w1, b1):
    a = _pre(h, w0, b0)
    g = 0.5 * a * (1.0 + jax.lax.erf(a * _INV_SQRT2))
    return jnp.sum(g * w1[:, :, 0], -1) + b1[:, 0]


def _fwd(h, w0, b0, w1, b1):
    return mlp_ci_vjp(h, w0, b0, w1, b1), (h, w0, b0, w1)


def _bwd(res, dz):
    h, w0, b0, w1 = res
    a = _pre(h, w0, b0)
    e = 1.0 + jax.lax.erf(a * _INV_SQRT2)
    g = 0.5 * a * e
    da = dz[..., None] * w1[:, :, 0] * (0.5 * e + a * _INV_SQRT_2PI * jnp.exp(-0.5 * a * a))
    return (
        jnp.sum(da * w0[:, 0, :], -1),
        jnp.sum(da * h[..., None], 0)[:, None, :],
        jnp.sum(da, 0),
        jnp.sum(g * dz[..., None], 0)[:, :, None],
        jnp.sum(dz, 0)[:, None],
    )


mlp_ci_vjp.defvjp(_fwd, _bwd)


def _autodiff(h, w0, b0, w1, b1):
    params = {"0": {"W": w0, "b": b0}, "1": {"W": w1, "b": b1}}
    return ci_fn_apply("mlp", params, h, h)  # `mlp` reads only h


def _grad(f, ct):
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3, 4)))


def _time(f, args, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, 1 device; fwd+bwd ms per call")
    print(
        f"{'shape':<12} {'B':>5} {'C':>4} | {'autodiff':>9} {'custom_vjp':>10} {'ratio':>6} | "
        "max rel grad diff"
    )
    for name, (b, c) in SHAPES.items():
        k = jax.random.split(jax.random.PRNGKey(0), 6)
        args = (
            jax.random.normal(k[0], (b, c)),
            jax.random.normal(k[1], (c, 1, HIDDEN)),
            jax.random.normal(k[2], (c, HIDDEN)),
            jax.random.normal(k[3], (c, HIDDEN, 1)),
            jax.random.normal(k[4], (c, 1)),
        )
        ct = jax.random.normal(k[5], (b, c))
        ref, new = _grad(_autodiff, ct), _grad(mlp_ci_vjp, ct)
        diff = max(
            float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(x)))
            for x, y in zip(ref(*args), new(*args), strict=True)
        )
        best = {"ref": float("inf"), "new": float("inf")}
        iters = max(3, a.iters * 40_000 // (b * c))
        for _ in range(a.rounds):
            best["ref"] = min(best["ref"], _time(ref, args, iters))
            best["new"] = min(best["new"], _time(new, args, iters))
        print(
            f"{name:<12} {b:>5} {c:>4} | {best['ref']:>9.3f} {best['new']:>10.3f} "
            f"{best['ref'] / best['new']:>5.2f}x | {diff:.1e}"
        )
    print("ratio = autodiff / custom_vjp (> 1: the hand-written backward is faster)")


if __name__ == "__main__":
    main()
