"""Masks over components: stochastic masks, masks from adversarial sources, and routing masks.

Every mask interpolates between the causal importance and 1: `m = ci + (1 - ci) * r`, with
r ~ U[0, 1) (continuous sampling), r ~ Bernoulli(1/2) (binomial sampling, as the reference's
`torch.randint(0, 2, ...)`), or r = an adversarial source. The delta component (W - V U) gets
its own mask per example/position: U[0, 1) for stochastic masks, the source's last entry for
adversarial ones. Routing masks (bool, one per site over the example/position axes) pick which
examples/positions take the components at a site at all; the others keep the target's weight.
"""

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from pdctl.science.spd.components import expand_left
from pdctl.science.spd.grouped import map_sites

Array = jax.Array
Dict = Mapping[str, Array]

ROUTINGS = ("all", "uniform_k", "static_p")


def stochastic_masks(
    key: Array, ci_lower: Dict, sampling: str, delta: bool, grouped: bool = False
) -> tuple[dict[str, Array], dict[str, Array] | None]:
    """One draw of stochastic masks for every site in `ci_lower` (site i uses fold_in(key, i);
    `grouped`: same-shaped sites drawn under one vmap, the same bits)."""
    if sampling not in ("continuous", "binomial"):
        raise ValueError(f"unknown sampling {sampling!r}")

    def one(i, ci: Array) -> tuple[Array, Array | None]:
        k_r, k_d = jax.random.split(jax.random.fold_in(key, i))
        if sampling == "continuous":
            r = jax.random.uniform(k_r, ci.shape, ci.dtype)
        else:
            r = jax.random.bernoulli(k_r, 0.5, ci.shape).astype(ci.dtype)
        d = jax.random.uniform(k_d, ci.shape[:-1], ci.dtype) if delta else None
        return ci + (1 - ci) * r, d

    out = map_sites(one, list(ci_lower), ci_lower, grouped=grouped)
    masks = {p: m for p, (m, _) in out.items()}
    return masks, ({p: d for p, (_, d) in out.items()} if delta else None)


def source_masks(
    ci_lower: Dict, sources: Dict, delta: bool
) -> tuple[dict[str, Array], dict[str, Array] | None]:
    """Masks from sources in [0, 1] whose trailing axis is C (+1 for the delta component) and
    whose leading axes align with the right end of ci's: () shared, (T,) per position, (B,) or
    (B, T) per example (and position). They broadcast over the rest."""
    masks: dict[str, Array] = {}
    delta_masks: dict[str, Array] | None = {} if delta else None
    for path, ci in ci_lower.items():
        C = ci.shape[-1]
        s = expand_left(sources[path], ci.ndim).astype(ci.dtype)
        masks[path] = ci + (1 - ci) * s[..., :C]
        if delta_masks is not None:
            delta_masks[path] = jnp.broadcast_to(s[..., C], ci.shape[:-1])
    return masks, delta_masks


def routing_masks(
    key: Array, paths: Sequence[str], shape: tuple[int, ...], routing: str, p: float = 0.5
) -> dict[str, Array] | None:
    """Which examples/positions (`shape`) each site routes to its components; None = all.

    - `uniform_k`: per example/position, k ~ U{1, ..., n_sites}, then a uniformly random subset
      of k sites (the reference's `sample_uniform_k_subset_routing_masks`: ranks of uniform
      noise along the site axis, `rank < k`).
    - `static_p`: every site independently with probability p (`StaticProbabilityRouter`).
    """
    if routing == "all":
        return None
    n = len(paths)
    if routing == "uniform_k":
        k_k, k_perm = jax.random.split(key)
        k = jax.random.randint(k_k, shape, 1, n + 1)
        noise = jax.random.uniform(k_perm, (n, *shape))
        ranks = jnp.argsort(jnp.argsort(noise, axis=0), axis=0)
        return {path: ranks[i] < k for i, path in enumerate(paths)}
    if routing == "static_p":
        return {
            path: jax.random.uniform(jax.random.fold_in(key, i), shape) < p
            for i, path in enumerate(paths)
        }
    raise ValueError(f"unknown routing {routing!r}; expected one of {ROUTINGS}")
