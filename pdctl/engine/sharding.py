"""The device mesh and every PartitionSpec rule, in one place.

Mesh axes are ('data', 'fsdp', 'tp'). Specs are derived once from abstract shapes
(`jax.eval_shape`) by the ordered table RULES (pattern over the array's dotted path ->
PartitionSpec):
- with `tp` > 1 (tensor parallelism, Megatron-style), the attention and MLP projections of the
  LM targets are split over the tp axis: column-parallel ones (q/k/v, gate/up, GPT-2's c_attn
  and c_fc) over their output dimension, row-parallel ones (o, down, GPT-2's c_proj) over their
  input dimension, so that a block needs one reduction per row-parallel projection. A site's
  components follow its matrix: U (C, d_out) of a column-parallel site and V (d_in, C) of a
  row-parallel one are split over tp the same way; their component axis shards as below;
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

AXES = ("data", "fsdp", "tp")
BATCH_AXES = ("data", "fsdp")  # the tp devices of a batch shard see the same examples
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
    # never tp: the components' model dimensions shard over it where their matrix's do
    axes = ("fsdp",) if mode == "fsdp" else tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    axes = axes or ("fsdp",)
    return Decomp(axes, math.prod(mesh.shape[a] for a in axes))


def resolve_mesh_shape(data: int, fsdp: int, n_devices: int, tp: int = 1) -> tuple[int, int]:
    """(data, fsdp) with the -1 axis filled in, for `n_devices` devices of which each group of
    `tp` is one tensor-parallel group; a mesh that does not fit the devices is a config error."""
    if tp < 1 or n_devices % tp:
        raise PdctlError(f"mesh.tp: {tp} does not divide the {n_devices} available devices")
    groups = n_devices // tp
    of = f" of the {n_devices} devices / tp {tp}" if tp > 1 else " available devices"
    if data == -1:
        if groups % fsdp:
            raise PdctlError(f"mesh.fsdp: {fsdp} does not divide the {groups}{of}")
        data = groups // fsdp
    elif fsdp == -1:
        if groups % data:
            raise PdctlError(f"mesh.data: {data} does not divide the {groups}{of}")
        fsdp = groups // data
    if data * fsdp * tp != n_devices:
        tp_part = f" x tp={tp}" if tp > 1 else ""
        raise PdctlError(
            f"mesh: data={data} x fsdp={fsdp}{tp_part} = {data * fsdp * tp} devices, but "
            f"{n_devices} are available; set mesh.data = -1 to use them all"
        )
    return data, fsdp


def make_mesh(data: int, fsdp: int, devices: list[Any] | None = None, tp: int = 1) -> Mesh:
    """The ('data', 'fsdp', 'tp') mesh; tp varies fastest, so a tensor-parallel group is
    consecutive devices (those of one host, where its collectives are cheapest)."""
    devices = list(jax.devices() if devices is None else devices)
    data, fsdp = resolve_mesh_shape(data, fsdp, len(devices), tp)
    if devices == list(jax.devices()) and jax.process_count() > 1:
        # Multi-host: let JAX order devices so that collectives stay within hosts where possible.
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh((data, fsdp, tp), devices=devices)
    else:
        arr = np.array(devices).reshape(data, fsdp, tp)
    return Mesh(arr, AXES)


def mesh_from_config(mc: Any, devices: list[Any] | None = None) -> Mesh:
    """The mesh of a `[mesh]` table (`config.MeshConfig`)."""
    return make_mesh(mc.data, mc.fsdp, devices, tp=mc.tp)


def axis_size(mesh: Mesh, axis: str) -> int:
    """The size of `axis` in `mesh` (1 when the mesh lacks it: a mesh built by hand)."""
    return int(dict(mesh.shape).get(axis, 1))


# ---- tensor parallelism ------------------------------------------------------------------
# The projections each LM target splits over the tp axis, by their site's last name(s): Llama /
# Qwen2 (`model.layers.3.self_attn.q_proj`), GPT-2 (`transformer.h.3.attn.c_attn`) and
# llama-mlp (`layers.3.attn.q`). Column-parallel: split over d_out; row-parallel: over d_in.
COLUMN_SITES = (
    "*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj",
    "*.attn.c_attn", "*.mlp.c_fc",
    "*.attn.q", "*.attn.k", "*.attn.v", "*.mlp.gate", "*.mlp.up",
)  # fmt: skip
ROW_SITES = ("*.o_proj", "*.down_proj", "*.attn.c_proj", "*.mlp.c_proj", "*.attn.o", "*.mlp.down")


def tp_role(site: str) -> str | None:
    """ "column", "row" or None (not split over tp) for a site path or group key."""
    if any(fnmatch.fnmatchcase(site, pat) for pat in COLUMN_SITES):
        return "column"
    if any(fnmatch.fnmatchcase(site, pat) for pat in ROW_SITES):
        return "row"
    return None


def _leaf_role(path: str) -> tuple[str | None, str]:
    """(the tp role of the site a leaf belongs to, the leaf's kind: weight | bias | V | U)."""
    for suffix in ("weight", "bias", "V", "U"):
        if path.endswith(f".{suffix}"):
            role = tp_role(path[: -len(suffix) - 1])
            if role is not None:
                return role, suffix
    if path.startswith(("sources.", "src_opt.")) or ".sources." in path:
        return None, ""  # a site's PPGD sources: keyed by the site, not its matrix
    return tp_role(path), "weight"  # llama-mlp keeps a site's matrix at the site's own path


@dataclass(frozen=True)
class WeightSpace:
    """Where the faithfulness term's d_in x d_out work runs when the components shard their
    component axis as `decomp` says: on gathered V and U (the token path gathers them anyway),
    each device forming only its rows of W - V U. Left to itself GSPMD contracts the sharded
    component axis and all-reduces every site's whole d_in x d_out partial product (at 90
    SmolLM2 sites that was 318 MB per step); this way the term's only collectives are V / U
    sized (C x (d_in + d_out)). Under tensor parallelism a site's matrix and components keep
    their tp split (`role`): a column-parallel site's rows of W - V U are split over the decomp
    axes and its columns over tp, a row-parallel site's rows over (tp, decomp axes)."""

    mesh: Mesh
    decomp: Decomp

    @property
    def tp(self) -> int:
        return axis_size(self.mesh, "tp")

    def role(self, site: str) -> str | None:
        return tp_role(site) if self.tp > 1 else None

    def _constrain(self, x: jax.Array, *spec: Any) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))

    def gathered(self, x: jax.Array, role: str | None = None, factor: str = "V") -> jax.Array:
        """`x` (V or U, (d_in, C) / (C, d_out)) whole along its component axis."""
        spec: list[Any] = [None] * x.ndim
        if role == "row" and factor == "V":
            spec[0] = "tp"
        elif role == "column" and factor == "U":
            spec[-1] = "tp"
        return self._constrain(x, *spec)

    def rows(self, x: jax.Array, role: str | None = None, factor: str = "W") -> jax.Array:
        """`x` (W (d_in, d_out) or V (d_in, C)) with its rows split over the decomp axes (and
        tp first, for a row-parallel site; a column-parallel site's W keeps its columns over
        tp); as it is when they do not divide."""
        rest: list[Any] = [None] * (x.ndim - 1)
        axes: tuple[str, ...] = self.decomp.axes
        if role == "row":
            axes = ("tp", *axes)
        elif role == "column" and factor == "W" and x.shape[-1] % self.tp == 0:
            rest[-1] = "tp"
        size = math.prod(axis_size(self.mesh, a) for a in axes)
        if x.shape[0] % size:
            return x
        return self._constrain(x, axes if len(axes) > 1 else axes[0], *rest)


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
class Ctx:
    """What a rule sees besides the array's shape: the fsdp and tp axis sizes, the
    `fsdp_min_param_size`, the component axis's layout, and the array's path."""

    fsdp: int
    min_size: int
    decomp: Decomp
    tp: int = 1
    path: str = ""


@dataclass(frozen=True)
class Rule:
    """One line of the sharding table: arrays whose dotted path matches `pattern` get
    `spec(shape, ctx)`, or the next rule when that returns None."""

    name: str
    pattern: str
    spec: Callable[[tuple[int, ...], Ctx], P | None]


def _scalar(shape: tuple[int, ...], ctx: Ctx) -> P | None:
    return P() if not shape else None


def _component_entry(C: int, ctx: Ctx) -> Any:
    """The spec entry of a component axis of size C (None: replicated)."""
    if C % ctx.decomp.size == 0:
        return ctx.decomp.spec_axes
    if ctx.fsdp > 1 and C % ctx.fsdp == 0:
        return "fsdp"  # C divides the fsdp axis but not the whole mesh
    return None


def _tensor_parallel(shape: tuple[int, ...], ctx: Ctx) -> P | None:
    """A tp site's leaf: its matrix (.., d_in, d_out) and bias (d_out,), or its components
    V (.., d_in, C) / U (.., C, d_out); a leading layer axis (stacked sites) stays whole."""
    if ctx.tp == 1 or not shape:
        return None
    role, kind = _leaf_role(ctx.path)
    if role is None:
        return None
    spec: list[Any] = [None] * len(shape)
    if kind == "bias":
        if role == "row":
            return None
        spec[-1] = "tp"
    elif len(shape) < 2:
        return None
    elif kind == "weight":
        # Only over tp: with fsdp on the other dimension too, GSPMD met a contraction (or
        # output) dimension sharded like the batch and gathered the activations instead of
        # the weight, so every device ran its fsdp group's whole batch (Llama-3.1-8B at data
        # 1 x fsdp 4 x tp 8: 303 GiB per device against 170 GiB at data 4 x tp 8).
        spec[-1 if role == "column" else -2] = "tp"
    elif kind == "V":
        if role == "column":
            return None  # (d_in, C): d_in is whole on every tp device
        spec[-2] = "tp"
        spec[-1] = _component_entry(shape[-1], ctx) if ctx.decomp.size > 1 else None
    else:  # U
        if role == "row":
            return None  # (C, d_out): d_out is whole on every tp device
        spec[-1] = "tp"
        spec[-2] = _component_entry(shape[-2], ctx) if ctx.decomp.size > 1 else None
    tp_dims = [i for i, e in enumerate(spec) if e == "tp"]
    if any(shape[i] % ctx.tp for i in tp_dims):
        return None  # not divisible (the target's check refuses such a mesh for LM runs)
    return P(*spec)


def _no_fsdp(shape: tuple[int, ...], ctx: Ctx) -> P | None:
    return P() if ctx.fsdp == 1 else None


def _component_axis(axis: int) -> Callable[[tuple[int, ...], Ctx], P | None]:
    def spec(shape: tuple[int, ...], ctx: Ctx) -> P | None:
        # (d_in, C) / (C, d_out), or with a leading layer axis for stacked sites
        lead = len(shape) - 2
        if lead not in (0, 1) or ctx.decomp.size == 1:
            return None
        axes = _component_entry(shape[lead + axis], ctx)
        if axes is None:
            return P()  # C not divisible: replicated
        return P(*([None] * lead), *((None, axes) if axis == 1 else (axes, None)))

    return spec


def _small(shape: tuple[int, ...], ctx: Ctx) -> P | None:
    return P() if math.prod(shape) < ctx.min_size else None


def _largest_divisible(shape: tuple[int, ...], ctx: Ctx) -> P | None:
    # Largest dimension the axis divides; ties go to the leading one.
    order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
    for i in order:
        if shape[i] % ctx.fsdp == 0:
            spec: list[str | None] = [None] * len(shape)
            spec[i] = "fsdp"
            return P(*spec)
    return None


def _replicated(shape: tuple[int, ...], ctx: Ctx) -> P | None:
    return P()


# THE sharding rules, in order: the first rule that gives a spec wins. `pdctl inspect-sharding`
# names the rule of every array. The optimizer state mirrors the parameters' paths (optax's
# `mu.components.linear1.V`), so it inherits their specs through the same table.
RULES: tuple[Rule, ...] = (
    Rule("scalar", "*", _scalar),
    Rule("tensor parallel: column over d_out, row over d_in", "*", _tensor_parallel),
    Rule("components V (d_in, C): the component axis", "*.V", _component_axis(1)),
    Rule("components U (C, d_out): the component axis", "*.U", _component_axis(0)),
    Rule("fsdp = 1", "*", _no_fsdp),
    Rule("below fsdp_min_param_size", "*", _small),
    Rule("the largest dimension fsdp divides", "*", _largest_divisible),
    Rule("no dimension fsdp divides", "*", _replicated),
)


def rule_for(
    path: str,
    shape: tuple[int, ...],
    fsdp: int,
    min_size: int,
    decomp: Decomp | None = None,
    tp: int = 1,
) -> tuple[Rule, P]:
    """The rule that decides `path`'s spec, and the spec. `decomp` defaults to the fsdp axis."""
    decomp = Decomp(("fsdp",), fsdp) if decomp is None else decomp
    ctx = Ctx(fsdp, min_size, decomp, tp, path)
    for rule in RULES:
        if fnmatch.fnmatchcase(path, rule.pattern):
            spec = rule.spec(shape, ctx)
            if spec is not None:
                return rule, spec
    raise AssertionError("the last rule matches everything")


def spec_for(
    path: str,
    shape: tuple[int, ...],
    fsdp: int,
    min_size: int,
    decomp: Decomp | None = None,
    tp: int = 1,
) -> P:
    """The PartitionSpec of one array, from its path and shape (see RULES)."""
    return rule_for(path, shape, fsdp, min_size, decomp, tp)[1]


def tree_specs(abstract: Any, mesh: Mesh, min_size: int, decomp: Decomp | None = None) -> Any:
    fsdp, tp = axis_size(mesh, "fsdp"), axis_size(mesh, "tp")
    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec_for(path_str(p), tuple(x.shape), fsdp, min_size, decomp, tp), abstract
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
    return axis_size(mesh, "data") * axis_size(mesh, "fsdp")


def check_batch_divides(batch_size: int, mesh: Mesh, key: str, accum: int = 1) -> None:
    """Each of the `accum` micro-batches must split evenly over the batch shards."""
    n = batch_shards(mesh)
    if batch_size % (n * accum):
        extra = f" x grad_accum_steps {accum}" if accum > 1 else ""
        data, fsdp, tp = (axis_size(mesh, a) for a in AXES)
        what = "devices" if tp == 1 else f"batch shards (the tp={tp} devices of each share it)"
        raise PdctlError(
            f"{key}: {batch_size} is not divisible by the {n} {what} of the mesh "
            f"(data={data} x fsdp={fsdp}){extra}"
        )


def abstract_with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying their target sharding (what orbax restores into)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )


def describe_mesh(mesh: Mesh) -> dict[str, int]:
    return {a: axis_size(mesh, a) for a in AXES}
