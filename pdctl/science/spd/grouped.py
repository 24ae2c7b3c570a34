"""Per-site functions run once per group of same-shaped sites instead of once per site.

An LM decomposition repeats the same site in every layer (`model.layers.{i}.mlp.down_proj`):
its CI function, mask draws and so on are the same computation on equally shaped arrays. Run
site by site, the program holds one copy of that computation per site, and its compile time
grows with the number of layers. `map_sites` stacks the sites' arrays per group, `vmap`s the
function over the group and slices the results back, so the program holds one copy per
distinct shape. Each call still gets its site's index (a traced uint32 under `vmap`), so keys
derived as `fold_in(key, i)` draw the same bits either way; arithmetic agrees to float
reassociation (a batched matmul may sum in another order than the single one).

The per-site dicts at the edges keep every caller, checkpoint and report speaking per site.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp


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
) -> dict[str, Any]:
    """{path: fn(i, per_site[0][path], per_site[1][path], ...)} for i, path in enumerate(paths).

    With `grouped`, `fn` runs once per group of same-shaped sites under `jax.vmap` (its `i` a
    traced uint32, its outputs any pytree); without, once per site with a Python int `i`."""
    paths = list(paths)
    if not grouped:
        return {p: fn(i, *(t[p] for t in per_site)) for i, p in enumerate(paths)}
    out: dict[str, Any] = {}
    for members in groups(paths, *per_site):
        if len(members) == 1:
            i = members[0]
            out[paths[i]] = fn(i, *(t[paths[i]] for t in per_site))
            continue
        stacked = [
            jax.tree.map(lambda *xs: jnp.stack(xs), *(t[paths[i]] for i in members))
            for t in per_site
        ]
        res = jax.vmap(fn)(jnp.asarray(members, jnp.uint32), *stacked)
        # lax.split, not a[j]: the transpose of n slices is n pads and adds of the whole
        # stack (an O(n^2) backward), that of one split a single concatenate.
        parts = jax.tree.map(lambda a, n=len(members): split_leading(a, n), res)
        for j, i in enumerate(members):
            out[paths[i]] = jax.tree.map(lambda ps, j=j: ps[j], parts, is_leaf=is_parts)
    return {p: out[p] for p in paths}
