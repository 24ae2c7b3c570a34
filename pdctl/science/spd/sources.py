"""The adversary's sources and their optimizer.

Persistent sources (PPGD) are train state: `{site: array}` with trailing axis C (+1 for the
delta component) and leading axes by scope (see `pdctl.config.ppgd_source_layout`). With the
sigmoid parametrisation they are unconstrained and the masks see `sigmoid(s)`; otherwise they
live in [0, 1] and are clipped after every step. Each step is an ASCENT step on the
reconstruction loss: Adam (bias-corrected, betas and eps configurable) or `lr * sign(grad)`.

Pooled sources (`scope = "pooled"`, goodfire-ai/param-decomp's pooled merged term, its
`PersistentSourcePool` / `sample_source_pool`): per example a minipool of K particles, each a
source for every site, `(B, K, C (+1))` per site. Each step every example draws one particle
index uniformly (`particle_indices`), the same at every site and position, and the ascent steps,
the loss and the sources' gradient of that step all use it (`pick_particles`): the gradient
reaches the picked particles only.

Storage may be bfloat16 (`[train.ppgd] dtype`): the sources and the first moment are kept in
it, every ascent step computes in float32 and rounds its result once, and the second moment
stays float32 (a bfloat16 average with b2 = 0.999 would not move: 0.999 * v rounds back to v).
The masks always see float32 sources.

Written out rather than taken from optax: the update must run under
`jax_numpy_dtype_promotion="strict"` (optax's bias correction mixes int and float) and the
moments are a plain dict that checkpoints and shards like the sources themselves.
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
Dict = Mapping[str, Array]
OPTIMIZERS = ("adam", "sign")


def effective(sources: Dict, sigmoid: bool) -> dict[str, Array]:
    """The sources as the masks see them, in [0, 1], float32 whatever their storage."""
    f32 = {p: s.astype(jnp.float32) for p, s in sources.items()}
    if sigmoid:
        return {p: jax.nn.sigmoid(s) for p, s in f32.items()}
    return f32


def particle_indices(key: Array, n_examples: int, pool_size: int) -> Array:
    """Each example's particle of a pool, uniform over its `pool_size` (int32, (n_examples,))."""
    return jax.random.randint(key, (n_examples,), 0, pool_size)


def pick_particles(sources: Dict, index: Array, n_positions: int) -> dict[str, Array]:
    """Pooled sources `(B, K, n)` per site (a stacked unit's `(members, B, K, n)`) -> each
    example's particle `index[b]` as per-example sources `(B, 1 x n_positions, n)`, whose unit
    position axes broadcast it over the example's positions in `masks.source_masks`."""

    def one(src: Array) -> Array:
        B, n = src.shape[-3], src.shape[-1]
        idx = index.reshape((1,) * (src.ndim - 3) + (B, 1, 1))
        picked = jnp.take_along_axis(src, idx, axis=-2)  # (..., B, 1, n)
        return picked.reshape(*src.shape[:-3], B, *(1,) * n_positions, n)

    return {p: one(s) for p, s in sources.items()}


def init_opt(sources: Dict, optimizer: str) -> dict[str, Any]:
    """{"count", "m", "v"} for Adam, {"count"} for sign steps."""
    state: dict[str, Any] = {"count": jnp.zeros((), jnp.float32)}
    if optimizer == "adam":
        state["m"] = {p: jnp.zeros_like(s) for p, s in sources.items()}  # the sources' dtype
        state["v"] = {p: jnp.zeros_like(s, jnp.float32) for p, s in sources.items()}
    elif optimizer != "sign":
        raise ValueError(f"unknown source optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    return state


def ascent_step(
    sources: Dict,
    grads: Dict,
    opt_state: Mapping[str, Any],
    *,
    optimizer: str,
    lr: Array | float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    sigmoid: bool = False,
) -> tuple[dict[str, Array], dict[str, Any]]:
    """One ascent step on every site's sources, then (without the sigmoid parametrisation) the
    projection onto [0, 1]."""
    count = opt_state["count"] + 1
    new_state: dict[str, Any] = {"count": count}
    f32 = jnp.float32
    grads = {p: g.astype(f32) for p, g in grads.items()}
    if optimizer == "adam":
        m = {p: b1 * opt_state["m"][p].astype(f32) + (1 - b1) * g for p, g in grads.items()}
        v = {p: b2 * opt_state["v"][p] + (1 - b2) * g * g for p, g in grads.items()}
        c1 = 1 - jnp.power(f32(b1), count)
        c2 = 1 - jnp.power(f32(b2), count)
        direction = {p: (m[p] / c1) / (jnp.sqrt(v[p] / c2) + eps) for p in grads}
        new_state["m"] = {p: m[p].astype(opt_state["m"][p].dtype) for p in m}
        new_state["v"] = v
    elif optimizer == "sign":
        direction = {p: jnp.sign(g) for p, g in grads.items()}
    else:
        raise ValueError(f"unknown source optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    new = {p: sources[p].astype(f32) + lr * direction[p] for p in sources}
    if not sigmoid:
        new = {p: jnp.clip(s, 0.0, 1.0) for p, s in new.items()}
    return {p: s.astype(sources[p].dtype) for p, s in new.items()}, new_state
