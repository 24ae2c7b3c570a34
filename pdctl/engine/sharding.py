"""The device mesh and every PartitionSpec rule, in one place.

Mesh axes are ('data', 'fsdp'). Specs are derived once from abstract shapes (`jax.eval_shape`)
by the ordered table RULES (pattern over the array's dotted path -> PartitionSpec):
- decomposition factors shard over their component axis: `...V` (d_in, C) as P(None, axes),
  `...U` (C, d_out) as P(axes, None) (when C divides), where `axes` is 'fsdp', or every axis
  of the mesh ('data', 'fsdp') under `[mesh] decomposition = "all"` (the default for LM
  targets): each device then holds, differentiates and updates 1/N of every site's components
  instead of repeating all of that weight-space work on every data-parallel device;
- any other array with at least `fsdp_min_param_size` elements shards its largest dimension that
  the fsdp axis divides; smaller arrays stay replicated.
The rules depend only on a leaf's path and shape, so optimizer state (whose Adam moments mirror
the parameter tree) inherits the parameter specs when the table is applied to `tx.init`'s
abstract output. Batches shard their leading axis over ('data', 'fsdp'), and so do arrays that
go with the batch (per-example PPGD sources, `leading_batch_shardings`).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdctl.errors import PdctlError

AXES = ("data", "fsdp")
BATCH_AXES = ("data", "fsdp")
DECOMPOSITION_MODES = ("auto", "fsdp", "all")


@dataclass(frozen=True)
class Decomp:
    """The mesh axes the decomposition's component axis shards over, and their total size."""

    axes: tuple[str, ...] = ("fsdp",)
    size: int = 1

    @property
    def spec_axes(self) -> Any:
        """The axes as one PartitionSpec entry: a name, or a tuple of names."""
        return self.axes if len(self.axes) > 1 else self.axes[0]


def decomp_axes(mesh: Mesh, mode: str, lm: bool) -> Decomp:
    """`[mesh] decomposition`: "fsdp" (the fsdp axis only), "all" (every mesh axis larger than
    1), or "auto" = "all" for LM targets (`lm`: whose site weight-space work is large next to
    their per-device tokens) and "fsdp" for the toys (small matrices, large batches)."""
    if mode not in DECOMPOSITION_MODES:
        raise ValueError(f"decomposition mode must be one of {DECOMPOSITION_MODES}, got {mode!r}")
    if mode == "auto":
        mode = "all" if lm else "fsdp"
    axes = ("fsdp",) if mode == "fsdp" else tuple(a for a in AXES if mesh.shape[a] > 1)
    axes = axes or ("fsdp",)
    return Decomp(axes, math.prod(mesh.shape[a] for a in axes))


def resolve_mesh_shape(data: int, fsdp: int, n_devices: int) -> tuple[int, int]:
    """Fill in the -1 axis; a mesh that does not fit the devices is a config error."""
    if data == -1:
        if n_devices % fsdp:
            raise PdctlError(f"mesh.fsdp: {fsdp} does not divide the {n_devices} available devices")
        data = n_devices // fsdp
    elif fsdp == -1:
        if n_devices % data:
            raise PdctlError(f"mesh.data: {data} does not divide the {n_devices} available devices")
        fsdp = n_devices // data
    if data * fsdp != n_devices:
        raise PdctlError(
            f"mesh: data={data} x fsdp={fsdp} = {data * fsdp} devices, but {n_devices} are "
            f"available; set mesh.data = -1 to use them all"
        )
    return data, fsdp


def make_mesh(data: int, fsdp: int, devices: list[Any] | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    data, fsdp = resolve_mesh_shape(data, fsdp, len(devices))
    if devices == list(jax.devices()) and jax.process_count() > 1:
        # Multi-host: let JAX order devices so that collectives stay within hosts where possible.
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh((data, fsdp), devices=devices)
    else:
        arr = np.array(devices).reshape(data, fsdp)
    return Mesh(arr, AXES)


@dataclass(frozen=True)
class WeightSpace:
    """Where the faithfulness term's d_in x d_out work runs when the components shard their
    component axis as `decomp` says: on gathered V and U (the token path gathers them anyway),
    each device forming only its rows of W - V U. Left to itself GSPMD contracts the sharded
    component axis and all-reduces every site's whole d_in x d_out partial product (at 90
    SmolLM2 sites that was 318 MB per step); this way the term's only collectives are V / U
    sized (C x (d_in + d_out))."""

    mesh: Mesh
    decomp: Decomp

    def gathered(self, x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P()))

    def rows(self, x: jax.Array) -> jax.Array:
        if x.shape[0] % self.decomp.size:
            return x
        spec = P(self.decomp.spec_axes, *([None] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def weight_space(mesh: Mesh, decomp: Decomp) -> WeightSpace | None:
    """The faithfulness layout for components sharded by `decomp` (None: not sharded)."""
    return WeightSpace(mesh, decomp) if decomp.size > 1 else None


def path_str(path: tuple[Any, ...]) -> str:
    """A pytree key path as a dotted string: ('layers', '0', 'mlp', 'up') -> 'layers.0.mlp.up'."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


@dataclass(frozen=True)
class Rule:
    """One line of the sharding table: arrays whose dotted path matches `pattern` get
    `spec(shape, fsdp, min_size)`, or the next rule when that returns None."""

    name: str
    pattern: str
    spec: Callable[[tuple[int, ...], int, int, Decomp], P | None]


def _scalar(shape: tuple[int, ...], fsdp: int, min_size: int, decomp: Decomp) -> P | None:
    return P() if not shape else None


def _no_fsdp(shape: tuple[int, ...], fsdp: int, min_size: int, decomp: Decomp) -> P | None:
    return P() if fsdp == 1 else None


def _component_axis(axis: int) -> Callable[[tuple[int, ...], int, int, Decomp], P | None]:
    def spec(shape: tuple[int, ...], fsdp: int, min_size: int, decomp: Decomp) -> P | None:
        # (d_in, C) / (C, d_out), or with a leading layer axis for stacked sites
        lead = len(shape) - 2
        if lead not in (0, 1) or decomp.size == 1:
            return None
        C = shape[lead + axis]
        if C % decomp.size == 0:
            axes = decomp.spec_axes
        elif fsdp > 1 and C % fsdp == 0:
            axes = "fsdp"  # C divides the fsdp axis but not the whole mesh
        else:
            return P()  # C not divisible: replicated
        return P(*([None] * lead), *((None, axes) if axis == 1 else (axes, None)))

    return spec


def _small(shape: tuple[int, ...], fsdp: int, min_size: int, decomp: Decomp) -> P | None:
    return P() if math.prod(shape) < min_size else None


def _largest_divisible(
    shape: tuple[int, ...], fsdp: int, min_size: int, decomp: Decomp
) -> P | None:
    # Largest dimension the axis divides; ties go to the leading one.
    order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
    for i in order:
        if shape[i] % fsdp == 0:
            spec = [None] * len(shape)
            spec[i] = "fsdp"
            return P(*spec)
    return None


def _replicated(shape: tuple[int, ...], fsdp: int, min_size: int, decomp: Decomp) -> P | None:
    return P()


# THE sharding rules, in order: the first rule that gives a spec wins. `pdctl inspect-sharding`
# names the rule of every array. The optimizer state mirrors the parameters' paths (optax's
# `mu.components.linear1.V`), so it inherits their specs through the same table.
RULES: tuple[Rule, ...] = (
    Rule("scalar", "*", _scalar),
    Rule("components V (d_in, C): the component axis", "*.V", _component_axis(1)),
    Rule("components U (C, d_out): the component axis", "*.U", _component_axis(0)),
    Rule("fsdp = 1", "*", _no_fsdp),
    Rule("below fsdp_min_param_size", "*", _small),
    Rule("the largest dimension fsdp divides", "*", _largest_divisible),
    Rule("no dimension fsdp divides", "*", _replicated),
)


def rule_for(
    path: str, shape: tuple[int, ...], fsdp: int, min_size: int, decomp: Decomp | None = None
) -> tuple[Rule, P]:
    """The rule that decides `path`'s spec, and the spec. `decomp` defaults to the fsdp axis."""
    decomp = Decomp(("fsdp",), fsdp) if decomp is None else decomp
    for rule in RULES:
        if fnmatch.fnmatchcase(path, rule.pattern):
            spec = rule.spec(shape, fsdp, min_size, decomp)
            if spec is not None:
                return rule, spec
    raise AssertionError("the last rule matches everything")


def spec_for(
    path: str, shape: tuple[int, ...], fsdp: int, min_size: int, decomp: Decomp | None = None
) -> P:
    """The PartitionSpec of one array, from its path and shape (see RULES)."""
    return rule_for(path, shape, fsdp, min_size, decomp)[1]


def tree_specs(abstract: Any, mesh: Mesh, min_size: int, decomp: Decomp | None = None) -> Any:
    fsdp = mesh.shape["fsdp"]
    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec_for(path_str(p), tuple(x.shape), fsdp, min_size, decomp), abstract
    )


def tree_shardings(abstract: Any, mesh: Mesh, min_size: int, decomp: Decomp | None = None) -> Any:
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        tree_specs(abstract, mesh, min_size, decomp),
        is_leaf=lambda x: isinstance(x, P),
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def leading_batch_shardings(abstract: Any, mesh: Mesh, lead: int = 0) -> Any:
    """Arrays whose leading axis (after `lead` others: the layer axis of stacked sites) is the
    (micro-)batch, sharded like the batch they go with (the per-example PPGD sources and their
    optimizer moments)."""

    def one(x: Any) -> NamedSharding:
        return NamedSharding(
            mesh, P(*([None] * lead), BATCH_AXES, *([None] * (len(x.shape) - lead - 1)))
        )

    return jax.tree.map(one, abstract)


def batch_shards(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_batch_divides(batch_size: int, mesh: Mesh, key: str, accum: int = 1) -> None:
    """Each of the `accum` micro-batches must split evenly over the batch shards."""
    n = batch_shards(mesh)
    if batch_size % (n * accum):
        extra = f" x grad_accum_steps {accum}" if accum > 1 else ""
        raise PdctlError(
            f"{key}: {batch_size} is not divisible by the {n} devices of the mesh "
            f"(data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}){extra}"
        )


def abstract_with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying their target sharding (what orbax restores into)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )


def describe_mesh(mesh: Mesh) -> dict[str, int]:
    return {"data": int(mesh.shape["data"]), "fsdp": int(mesh.shape["fsdp"])}
