"""Per-site functions run once per group of sites instead of once per site.

An LM decomposition repeats the same site in every layer (`model.layers.{i}.mlp.down_proj`):
its CI function, mask draws and so on are the same computation on equally shaped arrays. Run
site by site, the program holds one copy of that computation per site, and its compile time
grows with the number of layers. Two ways round it, both here:

- *Stacked units.* A key that names a group of layers (`model.layers.0-29.mlp.down_proj`, see
  `group_key`) holds its members' arrays stacked along a leading axis, as the train state of
  a scanned target does (`science.spd.stacked`). `map_sites` `vmap`s the function over that
  axis directly: nothing is split or stacked, so the program is the same size at any depth.
- *Per-site keys, grouped.* `map_sites(..., grouped=True)` stacks same-shaped sites' arrays,
  `vmap`s the function over them and slices the results back (one copy per distinct shape,
  but a stack and a split per site).

Each call gets its site's index in `order` (the per-site order of every site of the step; a
traced uint32 under `vmap`), so keys derived as `fold_in(key, i)` draw the same bits whichever
way the sites are laid out; arithmetic agrees to float reassociation (a batched matmul may sum
in another order than the single one).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

_GROUP = re.compile(r"^(?P<pre>.+)\.(?P<a>\d+)-(?P<b>\d+)\.(?P<name>[^.].*)$")


def group_key(prefix: str, first: int, last: int, name: str) -> str:
    return f"{prefix}.{first}-{last}.{name}"


def members(key: str) -> list[str] | None:
    """The site paths of a group key, in layer order; None for a plain site path."""
    m = _GROUP.match(key)
    if m is None:
        return None
    a, b = int(m["a"]), int(m["b"])
    return [f"{m['pre']}.{i}.{m['name']}" for i in range(a, b + 1)]


def sites_of(units: Iterable[str]) -> list[str]:
    """The site paths of `units` (site paths and group keys), each group's members in order."""
    return [s for u in units for s in (members(u) or [u])]


def site_shape(unit: str, a: jax.Array) -> tuple[int, ...]:
    """The shape one site of `unit` sees (without a group's leading member axis)."""
    return tuple(a.shape[1:]) if members(unit) is not None else tuple(a.shape)


class Parts(tuple):
    """The per-member pieces of one stacked result (a marker type for the tree maps)."""


def is_parts(x: Any) -> bool:
    return isinstance(x, Parts)


def split_leading(a: jax.Array, n: int) -> Parts:
    return Parts(jnp.squeeze(p, 0) for p in jax.lax.split(a, [1] * n, axis=0))


def _signature(*leaves_of_site: Any) -> tuple:
    leaves, tree = jax.tree.flatten(leaves_of_site)
    return tree, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)


def groups(paths: Sequence[str], *per_site: Mapping[str, Any]) -> list[list[int]]:
    """Indices into `paths`, grouped by the structure, shapes and dtypes of the sites' values
    in `per_site`, groups and members in first-appearance order."""
    out: dict[tuple, list[int]] = {}
    for i, p in enumerate(paths):
        out.setdefault(_signature(*(t[p] for t in per_site)), []).append(i)
    return list(out.values())


def map_sites(
    fn: Callable[..., Any],
    paths: Sequence[str],
    *per_site: Mapping[str, Any],
    grouped: bool = True,
    order: Sequence[str] | None = None,
) -> dict[str, Any]:
    """{key: fn(i, per_site[0][key], per_site[1][key], ...)} for every key of `paths`.

    A key is a site path or a stacked unit (a group key, its values stacked over its members):
    `fn` sees one site either way; for a unit it runs under `jax.vmap` over the members and its
    outputs come back stacked. `i` is the site's index in `order` (default: `paths` with units
    expanded). With `grouped`, same-shaped plain sites also run as one `vmap` (`i` then a traced
    uint32); without, once per site with a Python int `i`."""
    paths = list(paths)
    index = {s: i for i, s in enumerate(order if order is not None else sites_of(paths))}
    out: dict[str, Any] = {}
    plain = []
    for u in paths:
        ms = members(u)
        if ms is None:
            plain.append(u)
            continue
        idx = jnp.asarray([index[m] for m in ms], jnp.uint32)
        out[u] = jax.vmap(fn)(idx, *(t[u] for t in per_site))
    if not grouped:
        out.update({p: fn(index[p], *(t[p] for t in per_site)) for p in plain})
        return {p: out[p] for p in paths}
    for group in groups(plain, *per_site):
        if len(group) == 1:
            p = plain[group[0]]
            out[p] = fn(index[p], *(t[p] for t in per_site))
            continue
        ps = [plain[j] for j in group]
        stacked = [jax.tree.map(lambda *xs: jnp.stack(xs), *(t[p] for p in ps)) for t in per_site]
        res = jax.vmap(fn)(jnp.asarray([index[p] for p in ps], jnp.uint32), *stacked)
        # lax.split, not a[j]: the transpose of n slices is n pads and adds of the whole
        # stack (an O(n^2) backward), that of one split a single concatenate.
        parts = jax.tree.map(lambda a, n=len(ps): split_leading(a, n), res)
        for j, p in enumerate(ps):
            out[p] = jax.tree.map(lambda pt, j=j: pt[j], parts, is_leaf=is_parts)
    return {p: out[p] for p in paths}


def per_site_views(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A dict of units -> one entry per site (each unit split along its member axis), for
    use under jit where a computation needs sites one by one (layerwise recon)."""
    out: dict[str, Any] = {}
    for u, v in tree.items():
        ms = members(u)
        if ms is None:
            out[u] = v
            continue
        parts = jax.tree.map(lambda a, n=len(ms): split_leading(a, n), v)
        for j, m in enumerate(ms):
            out[m] = jax.tree.map(lambda pt, j=j: pt[j], parts, is_leaf=is_parts)
    return out
