"""Masks over components: stochastic masks, masks from adversarial sources, and routing masks.

Every mask interpolates between the causal importance and 1: `m = ci + (1 - ci) * r`, with
r ~ U[0, 1) (continuous sampling), r ~ Bernoulli(1/2) (binomial sampling, as the reference's
`torch.randint(0, 2, ...)`), or r = an adversarial source. The delta component (W - V U) gets
its own mask per example/position: U[0, 1) for stochastic masks, the source's last entry for
adversarial ones. Mixed masks (the merged stochastic/PPGD term) take, per example, either
the adversarial sources or a fresh uniform draw. Routing masks (bool, one per site over the
example/position axes) pick which examples/positions take the components at a site at all; the
others keep the target's weight.

Every function takes dicts keyed by site paths or by stacked units (group keys whose arrays
carry a leading member axis, `grouped.map_sites`); `order` is the per-site order of all the
step's sites that fixes each site's draw (default: the dict's own sites in order).
"""

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from pdctl.science.spd.components import expand_left
from pdctl.science.spd.grouped import map_sites, members, site_shape, sites_of

Array = jax.Array
Dict = Mapping[str, Array]

ROUTINGS = ("all", "uniform_k", "static_p")


Window = tuple[Array | int, int] | None


def window_draw(draw: Callable[[Array, tuple[int, ...]], Array], key: Array,
                shape: tuple[int, ...], window: Window = None) -> Array:  # fmt: skip
    """`draw(key, shape)`; with `window` = (start, full), rows start .. start + shape[0] of
    `draw(key, (full, *shape[1:]))`: a micro-batch of a batch of `full` examples draws the bits
    the whole batch's draw gives its rows (`start` may be traced)."""
    if window is None:
        return draw(key, shape)
    start, full = window
    whole = draw(key, (full, *shape[1:]))
    return jax.lax.dynamic_slice_in_dim(whole, start, shape[0], axis=0)


def stochastic_masks(
    key: Array,
    ci_lower: Dict,
    sampling: str,
    delta: bool,
    grouped: bool = False,
    order: Sequence[str] | None = None,
    window: Window = None,
) -> tuple[dict[str, Array], dict[str, Array] | None]:
    """One draw of stochastic masks for every site in `ci_lower` (site i uses fold_in(key, i);
    `grouped`: same-shaped sites drawn under one vmap, the same bits). `window`: the CI are
    rows of a larger batch, and the masks are those rows of the larger batch's draw
    (`window_draw`)."""
    if sampling not in ("continuous", "binomial"):
        raise ValueError(f"unknown sampling {sampling!r}")

    def one(i, ci: Array) -> tuple[Array, Array | None]:
        k_r, k_d = jax.random.split(jax.random.fold_in(key, i))
        draw: Callable[[Array, tuple[int, ...]], Array]
        if sampling == "continuous":
            draw = functools.partial(jax.random.uniform, dtype=ci.dtype)
        else:
            draw = lambda k, s: jax.random.bernoulli(k, 0.5, s).astype(ci.dtype)  # noqa: E731
        r = window_draw(draw, k_r, ci.shape, window)
        d = None
        if delta:
            d = window_draw(functools.partial(jax.random.uniform, dtype=ci.dtype), k_d,
                            ci.shape[:-1], window)  # fmt: skip
        return ci + (1 - ci) * r, d

    out = map_sites(one, list(ci_lower), ci_lower, grouped=grouped, order=order)
    masks = {p: m for p, (m, _) in out.items()}
    return masks, ({p: d for p, (_, d) in out.items()} if delta else None)


def source_masks(
    ci_lower: Dict, sources: Dict, delta: bool
) -> tuple[dict[str, Array], dict[str, Array] | None]:
    """Masks from sources in [0, 1] whose trailing axis is C (+1 for the delta component) and
    whose leading axes align with the right end of ci's: () shared, (T,) per position, (B,) or
    (B, T) per example (and position). They broadcast over the rest."""

    def one(_, ci: Array, src: Array) -> tuple[Array, Array | None]:
        C = ci.shape[-1]
        s = expand_left(src, ci.ndim).astype(ci.dtype)
        d = jnp.broadcast_to(s[..., C], ci.shape[:-1]) if delta else None
        return ci + (1 - ci) * s[..., :C], d

    out = map_sites(one, list(ci_lower), ci_lower, sources, grouped=False)
    masks = {p: m for p, (m, _) in out.items()}
    return masks, ({p: d for p, (_, d) in out.items()} if delta else None)


def fixed_assignment(key: Array, n_examples: int, n_assigned: int) -> tuple[Array, Array]:
    """Exactly `n_assigned` of `n_examples` examples, uniformly: (assign bool (n_examples,),
    their indices int32 (n_assigned,), ascending)."""
    idx = jnp.sort(jax.random.permutation(key, n_examples)[:n_assigned]).astype(jnp.int32)
    return jnp.zeros((n_examples,), bool).at[idx].set(True), idx


def mixed_masks(
    key: Array,
    ci_lower: Dict,
    sources: Dict,
    adv_fraction: float | Array,
    delta: bool,
    grouped: bool = False,
    order: Sequence[str] | None = None,
    n_assigned: int | None = None,
) -> tuple[dict[str, Array], dict[str, Array] | None, Array]:
    """(masks, delta masks, assign) of the merged stochastic/PPGD term (goodfire-ai/param-decomp
    SPEC S34): `assign ~ Bernoulli(adv_fraction)` once per example (bool, (B,)), shared by its
    positions and every site (or, with `n_assigned`, exactly that many: `fixed_assignment`
    from the same key). An assigned example's masks are `source_masks`' (the sources,
    in [0, 1], aligned as there); every other example's are `stochastic_masks`' continuous ones,
    `ci + (1 - ci) r`, r ~ U[0, 1), with a U[0, 1) delta mask. A `where`, so the sources'
    gradient comes from the assigned examples only. Site i draws from fold_in(key, i) as in
    `stochastic_masks`."""
    k_assign, k_fresh = jax.random.split(key)
    unit = next(iter(ci_lower))
    n_examples = lead_shape(unit, ci_lower[unit])[0]
    if n_assigned is None:
        assign = jax.random.bernoulli(k_assign, adv_fraction, (n_examples,))
    else:
        assign, _ = fixed_assignment(k_assign, n_examples, n_assigned)

    def one(i, ci: Array, src: Array) -> tuple[Array, Array | None]:
        C = ci.shape[-1]
        k_r, k_d = jax.random.split(jax.random.fold_in(k_fresh, i))
        s = expand_left(src, ci.ndim).astype(ci.dtype)
        adv = assign.reshape(assign.shape + (1,) * (ci.ndim - 1))
        r = jax.random.uniform(k_r, ci.shape, ci.dtype)
        m = ci + (1 - ci) * jnp.where(adv, s[..., :C], r)
        if not delta:
            return m, None
        d_src = jnp.broadcast_to(s[..., C], ci.shape[:-1])
        d = jnp.where(adv[..., 0], d_src, jax.random.uniform(k_d, ci.shape[:-1], ci.dtype))
        return m, d

    out = map_sites(one, list(ci_lower), ci_lower, sources, grouped=grouped, order=order)
    masks = {p: m for p, (m, _) in out.items()}
    return masks, ({p: d for p, (_, d) in out.items()} if delta else None), assign


def route_assigned(routes: Dict | None, assign: Array) -> dict[str, Array] | None:
    """`routes` with every assigned example routed at every site and position (the merged
    term's `route = assign OR routing draw`); None (all routed) stays None."""
    if routes is None:
        return None
    out = {}
    for u, r in routes.items():
        lead = r.shape[1:] if members(u) is not None else r.shape
        out[u] = r | assign.reshape(assign.shape + (1,) * (len(lead) - 1))
    return out


def routing_masks(
    key: Array,
    paths: Sequence[str],
    shape: tuple[int, ...],
    routing: str,
    p: float = 0.5,
    order: Sequence[str] | None = None,
) -> dict[str, Array] | None:
    """Which examples/positions (`shape`) each site routes to its components; None = all.
    `paths` may hold stacked units (their masks stacked over their members).

    - `uniform_k`: per example/position, k ~ U{1, ..., n_sites}, then a uniformly random subset
      of k sites (the reference's `sample_uniform_k_subset_routing_masks`: ranks of uniform
      noise along the site axis, `rank < k`).
    - `static_p`: every site independently with probability p (`StaticProbabilityRouter`).
    """
    if routing == "all":
        return None
    order = list(order) if order is not None else sites_of(paths)
    index = {s: i for i, s in enumerate(order)}
    n = len(order)
    if routing == "uniform_k":
        k_k, k_perm = jax.random.split(key)
        k = jax.random.randint(k_k, shape, 1, n + 1)
        noise = jax.random.uniform(k_perm, (n, *shape))
        ranks = jnp.argsort(jnp.argsort(noise, axis=0), axis=0)
        out = {}
        for u in paths:
            ms = members(u)
            if ms is None:
                out[u] = ranks[index[u]] < k
            else:  # one gather for the whole group
                out[u] = jnp.take(ranks, jnp.asarray([index[m] for m in ms]), axis=0) < k
        return out
    if routing == "static_p":
        return map_sites(
            lambda i, _: jax.random.uniform(jax.random.fold_in(key, i), shape) < p,
            list(paths),
            {u: _placeholder(u) for u in paths},
            grouped=False,
            order=order,
        )
    raise ValueError(f"unknown routing {routing!r}; expected one of {ROUTINGS}")


def _placeholder(unit: str) -> Array:
    """A zero-size stand-in with the unit's member axis (for functions of the index alone)."""
    ms = members(unit)
    return jnp.zeros((0,) if ms is None else (len(ms), 0), jnp.float32)


def lead_shape(unit: str, ci: Array) -> tuple[int, ...]:
    """The example/position axes one site of `unit` sees in its CI (..., C)."""
    return site_shape(unit, ci)[:-1]
