"""Stacked sites: the train state of an LM holds each site that repeats over consecutive layers
(`model.layers.{0..29}.mlp.down_proj`) as ONE array with a leading layer axis.

Why: with one set of arrays per site, every per-array piece of the train step (the optimizer's
moments and update, gradient clipping, the finiteness guard, each gradient's all-reduce) is in
the program once per site, and the program, hence its compile time, grows with the depth of the
model. Stacked, it is there once per group (7 for a Llama with every projection decomposed),
whatever the depth. The SPD functions take the groups as they are (`grouped.map_sites` vmaps a
per-site function over a group's member axis; the scanned forward, `HFCausalLM.apply_sites`,
scans over it), so nothing is split into sites and stacked again inside the step.

A group's key names its layers: `model.layers.0-29.mlp.down_proj`. Checkpoints store the state
as it is; everything that reads a train checkpoint for analysis (`report`, `export`,
`init_from`) turns it back into per-site arrays with `per_site`, which needs nothing but the
keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pdctl.science.spd.grouped import group_key, members

__all__ = ["Stacking", "group_key", "is_stacked", "members", "per_site", "per_site_tree"]


@dataclass(frozen=True)
class Stacking:
    """Which sites the train state stacks: (group key, member paths) pairs, in the order of
    their first member among the sites. Sites in no group stay as they are."""

    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def trivial(self) -> bool:
        return not self.groups

    @classmethod
    def plan(
        cls,
        target: Any,
        paths: Sequence[str],
        signature: Callable[[str], Any],
    ) -> Stacking:
        """Groups of >= 2 sites of `target` with the same name in consecutive layers and equal
        `signature(path)` (the shapes and dtypes of what the state holds for the site). Only
        a target whose layers run as a scan (`scan_layers`) stacks."""
        if not getattr(target, "scan_layers", False) or not hasattr(target, "layer_site"):
            return cls()
        runs: list[list[tuple[int, str]]] = []  # each: [(layer, path), ...]
        open_run: dict[str, list[tuple[int, str]]] = {}
        for p in paths:
            where = target.layer_site(p)
            if where is None:
                continue
            layer, name = where
            run = open_run.get(name)
            if run and run[-1][0] == layer - 1 and signature(run[-1][1]) == signature(p):
                run.append((layer, p))
            else:
                run = [(layer, p)]
                open_run[name] = run
                runs.append(run)
        groups = []
        for run in runs:
            if len(run) < 2:
                continue
            (first, p0), (last, _) = run[0], run[-1]
            layer, name = target.layer_site(p0)
            prefix = p0[: -len(f".{layer}.{name}")]
            groups.append((group_key(prefix, first, last, name), tuple(p for _, p in run)))
        return cls(tuple(groups))

    def stack(self, per_site: Mapping[str, Any]) -> dict[str, Any]:
        """{site: tree} -> the state's layout: each group's trees stacked along a new leading
        axis under its key, the other sites as they are (in the sites' order)."""
        if self.trivial:
            return dict(per_site)
        first = {ms[0]: (key, ms) for key, ms in self.groups}
        grouped = {m for _, ms in self.groups for m in ms}
        out: dict[str, Any] = {}
        for p, tree in per_site.items():
            if p in first:
                key, ms = first[p]
                out[key] = jax.tree.map(lambda *xs: jnp.stack(xs), *(per_site[m] for m in ms))
            elif p not in grouped:
                out[p] = tree
        return out

    def units(self, paths: Sequence[str]) -> list[str]:
        """The state's keys for the sites `paths`: each group's key in place of its first
        member, its other members dropped, plain sites as they are."""
        first = {ms[0]: key for key, ms in self.groups}
        grouped = {m for _, ms in self.groups for m in ms}
        return [first.get(p, p) for p in paths if p in first or p not in grouped]


def per_site(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A restored state dict keyed by sites and group keys -> keyed by sites only (host-side
    numpy or device arrays, sliced along the leading layer axis). Plain sites pass through."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        ms = members(k)
        if ms is None:
            out[k] = v
            continue
        for j, m in enumerate(ms):
            out[m] = jax.tree.map(lambda a, j=j: a[j], v)
    return out


def is_stacked(tree: Mapping[str, Any]) -> bool:
    return any(members(k) is not None for k in tree)


def per_site_tree(tree: Any) -> Any:
    """`per_site` at every level of a nested dict (a whole checkpoint item: `trainable`'s
    components and CI functions, the sources, an optimizer's moments)."""
    if not isinstance(tree, Mapping):
        return tree
    return {k: per_site_tree(v) for k, v in per_site(tree).items()}
