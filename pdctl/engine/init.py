"""Seeded, sharded init with few outputs under jit.

A jit that Python-unrolls one RNG body per site and returns hundreds of separately sharded
arrays compiles for minutes at scale. Instead, items with the same static signature (same
shapes) form a group; one jit initialises every group with `vmap` over the group's keys (one
stacked output per group and leaf), then trivial slicing jits (one per group, the item index a
traced argument) fan the stacks out to per-item arrays with their own shardings, so both
compiles stay flat in the number of items. The fan-out does not donate: one stacked buffer can
never alias several per-item outputs, so donation would only warn.

The values equal, bit for bit, calling `init_one(keys[i], *sig_i)` item by item (with `arrays`:
`init_one(keys[i], arrays[i], *sig_i)`, the items' arrays stacked like their keys).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdctl.engine.sharding import path_str


def _groups(sigs: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    out: dict[Hashable, list[int]] = {}
    for i, s in enumerate(sigs):
        out.setdefault(s, []).append(i)
    return out


def _specs(name: str, abstract: Any, spec_fn: Callable[[str, tuple[int, ...]], P]) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec_fn(f"{name}.{path_str(p)}" if p else name, tuple(x.shape)), abstract
    )


def grouped_init(
    init_one: Callable[..., Any],
    names: Sequence[str],
    sigs: Sequence[tuple[Any, ...]],
    keys: jax.Array,
    mesh: Mesh,
    spec_fn: Callable[[str, tuple[int, ...]], P],
    arrays: Sequence[Any] | None = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """{name: init_one(keys[i], *sigs[i])}, sharded by `spec_fn(path, shape)` per leaf.

    `arrays` (optional, one pytree of arrays per item, e.g. the target weight a site's init
    is computed from): then `init_one(keys[i], arrays[i], *sigs[i])`; items with the same
    signature must have arrays of the same shapes (make the shapes part of the signature).
    A group's arrays are stacked (one copy, outside the jit) like its keys.

    Returns the per-item trees and the compile seconds of the stacked and the fan-out jits."""
    if arrays is not None:
        return _grouped_with_arrays(init_one, names, sigs, keys, mesh, spec_fn, arrays)
    groups = _groups(sigs)
    order = list(groups)
    stacked_specs = []
    item_specs: dict[str, Any] = {}
    for sig in order:
        idx = groups[sig]
        one = jax.eval_shape(lambda k, sig=sig: init_one(k, *sig), keys[0])
        spec = _specs(names[idx[0]], one, spec_fn)
        stacked_specs.append(
            jax.tree.map(
                lambda s: NamedSharding(mesh, P(None, *s)), spec, is_leaf=lambda x: isinstance(x, P)
            )
        )
        for i in idx:
            item_specs[names[i]] = jax.tree.map(
                lambda s: NamedSharding(mesh, s),
                _specs(names[i], one, spec_fn),
                is_leaf=lambda x: isinstance(x, P),
            )
    group_keys = tuple(keys[jax.numpy.asarray(groups[sig])] for sig in order)

    def stacked(group_keys):
        return tuple(
            jax.vmap(lambda k, sig=sig: init_one(k, *sig))(ks)
            for sig, ks in zip(order, group_keys, strict=True)
        )

    timings = {}
    t0 = time.perf_counter()
    init_c = jax.jit(stacked, out_shardings=tuple(stacked_specs)).lower(group_keys).compile()
    timings["stacked"] = time.perf_counter() - t0
    stacks = init_c(group_keys)
    # Fan-out: one slicing jit per group (and per item sharding), with the item index as a
    # traced argument, called once per item. One jit returning every item would have as many
    # separately sharded outputs as items x leaves, and its compile would grow with the sites.
    timings["fanout"] = 0.0
    takes: dict[Any, Any] = {}
    out: dict[str, Any] = {}
    for sig, stack in zip(order, stacks, strict=True):
        for j, i in enumerate(groups[sig]):
            sh = item_specs[names[i]]
            k = (sig, jax.tree.structure(sh), tuple(jax.tree.leaves(sh)))
            if k not in takes:
                t0 = time.perf_counter()
                take = jax.jit(lambda s, j: jax.tree.map(lambda x: x[j], s), out_shardings=sh)
                takes[k] = take.lower(stack, jax.numpy.int32(0)).compile()
                timings["fanout"] += time.perf_counter() - t0
            out[names[i]] = takes[k](stack, jax.numpy.int32(j))
    return {n: out[n] for n in names}, timings


def _grouped_with_arrays(init_one, names, sigs, keys, mesh, spec_fn, arrays):
    # The keys and the arrays travel together as one "key" per item: grouped_init's vmap
    # then hands each item its own slice of both.
    packed = [(keys[i], arrays[i]) for i in range(len(names))]

    def init_packed(pair, *sig):
        return init_one(pair[0], pair[1], *sig)

    return grouped_init(init_packed, names, sigs, _Packed(packed), mesh, spec_fn)


class _Packed:
    """Per-item (key, arrays) pairs indexed like a key stack: `p[i]` one pair, `p[idx]` (an
    index array) the pairs of a group stacked leaf by leaf."""

    def __init__(self, items: list[Any]):
        self.items = items

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, int):
            return self.items[i]
        return jax.tree.map(lambda *xs: jax.numpy.stack(xs), *(self.items[int(j)] for j in list(i)))


def per_item_init(
    init_one: Callable[..., Any],
    names: Sequence[str],
    sigs: Sequence[tuple[Any, ...]],
    keys: jax.Array,
    mesh: Mesh,
    spec_fn: Callable[[str, tuple[int, ...]], P],
) -> tuple[dict[str, Any], dict[str, float]]:
    """The naive form, for comparison: one jit that unrolls every item and returns each with its
    own sharding. Same values as `grouped_init`; compile time grows with the item count."""
    out_sh = {}
    for name, sig in zip(names, sigs, strict=True):
        one = jax.eval_shape(lambda k, sig=sig: init_one(k, *sig), keys[0])
        out_sh[name] = jax.tree.map(
            lambda s: NamedSharding(mesh, s),
            _specs(name, one, spec_fn),
            is_leaf=lambda x: isinstance(x, P),
        )

    def all_items(keys):
        return {n: init_one(keys[i], *s) for i, (n, s) in enumerate(zip(names, sigs, strict=True))}

    t0 = time.perf_counter()
    c = jax.jit(all_items, out_shardings=out_sh).lower(keys).compile()
    return c(keys), {"per_item": time.perf_counter() - t0}
