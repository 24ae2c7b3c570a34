"""How a stage's arrays are laid out on the mesh, without allocating: `plan` (the stage's step
arguments, abstract), `array_rows` / `group_rows` (one row per array: shape, PartitionSpec, bytes
per device, the sharding rule that gave it), `totals`, and `compile_step`.

Everything here is abstract: `jax.eval_shape` through the stages' own `program` functions gives
the shapes, `sharding.tree_specs` the PartitionSpecs the stage will use, and bytes per device are
shape x itemsize / shards.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pydantic import ValidationError

from pdctl.config import Config, MeshConfig
from pdctl.engine import sharding
from pdctl.errors import PdctlError
from pdctl.registry import STAGES
from pdctl.stages.inputs import (
    abstract_target,
    check_tensor_parallel,
    decomp_layout,
    target_from_config,
)

KINDS = ("target", "components", "ci_fns", "sources", "optimizer", "loop", "batch", "other")
KIND_LABEL = {
    "target": "target",
    "components": "components (V/U)",
    "ci_fns": "CI functions",
    "sources": "PPGD sources",
    "optimizer": "optimizer state",
    "loop": "loop counters",
    "batch": "batch",
    "other": "other",
}
N_LARGEST = 5


# ---- option parsing ------------------------------------------------------------------------
def parse_stage(value: str) -> str:
    stage = value.strip().replace("-", "_")
    if stage not in STAGES:
        raise PdctlError(f"--stage: unknown stage {value!r} (choose from {', '.join(STAGES)})")
    return stage


def parse_mesh(value: str | None) -> dict[str, int] | None:
    """`data=A,fsdp=B,tp=C` (any key may be left out; -1 = all remaining devices)."""
    if value is None:
        return None
    out: dict[str, int] = {}
    for part in value.split(","):
        key, eq, num = part.partition("=")
        key = key.strip()
        try:
            n = int(num)
        except ValueError:
            n = None
        if not eq or key not in sharding.AXES or key in out or n is None:
            raise PdctlError(
                f"--mesh: expected data=A,fsdp=B,tp=C (integers, -1 = the rest), got {value!r}"
            )
        out[key] = n
    return out


def mesh_config(cfg: Config, override: dict[str, int] | None) -> MeshConfig:
    if not override:
        return cfg.mesh
    fields: dict[str, Any] = {
        "data": cfg.mesh.data,
        "fsdp": cfg.mesh.fsdp,
        "tp": cfg.mesh.tp,
        **override,
    }
    if "data" in override and "fsdp" not in override and override["data"] != -1:
        fields["fsdp"] = -1  # data=A alone: the rest of the devices shard parameters
    if "fsdp" in override and "data" not in override and override["fsdp"] != -1:
        fields["data"] = -1
    fields["fsdp_min_param_size"] = cfg.mesh.fsdp_min_param_size
    fields["decomposition"] = cfg.mesh.decomposition
    try:
        return MeshConfig.model_validate(fields)
    except ValidationError as e:
        msg = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise PdctlError(f"--mesh: {msg}") from None


def check_mesh_fits(mc: MeshConfig, n_devices: int, from_flag: bool) -> tuple[int, int]:
    try:
        return sharding.resolve_mesh_shape(mc.data, mc.fsdp, n_devices, mc.tp)
    except PdctlError as e:
        if from_flag:
            tp = f",tp={mc.tp}" if mc.tp > 1 else ""
            raise PdctlError(
                f"--mesh: data={mc.data},fsdp={mc.fsdp}{tp} does not fit: {e}"
            ) from None
        raise


# ---- what a stage's step sees ----------------------------------------------------------------
@dataclass
class Arg:
    """One argument of the stage's step: its abstract tree, specs, and whether it is donated."""

    name: str
    abstract: Any
    specs: Any
    donated: bool
    prefix: str = ""  # row paths are prefix + tree path


@dataclass
class Plan:
    stage: str
    cfg: Config
    mesh: Any
    args: list[Arg]
    program: Any = None  # the stage's StepProgram (None: init_weights has no step)
    notes: list[str] = field(default_factory=list)
    decomp: sharding.Decomp | None = None  # the axes the components shard over
    target: Any = None


def _specs(abstract: Any, cfg: Config, mesh, target) -> Any:
    return sharding.tree_specs(
        abstract, mesh, cfg.mesh.fsdp_min_param_size, decomp_layout(cfg, mesh, target)
    )


def _spec_tree(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.spec, shardings)


def plan(cfg: Config, stage: str, mesh, root: Path | None = None) -> Plan:
    """The abstract arguments of `stage`'s step (or, for init_weights, what it creates), from
    the stage's own `program` (the one the stage compiles); `root` is the run directory (an
    imported model's relative path starts there)."""
    from pdctl.stages import pretrain, train, warmup
    from pdctl.stages.decomposition import abstract_decomposition

    target = target_from_config(cfg, root, need_weights=False)  # shapes only: no weights read
    check_tensor_parallel(target, mesh)
    decomp = decomp_layout(cfg, mesh, target)
    if stage == "init_weights":
        abstract_params = abstract_target(cfg, target)
        dec = abstract_decomposition(cfg, target)
        return Plan(
            stage,
            cfg,
            mesh,
            [
                Arg(
                    "target",
                    abstract_params,
                    _specs(abstract_params, cfg, mesh, target),
                    False,
                    "target",
                ),
                Arg("decomposition", dec, _specs(dec, cfg, mesh, target), False),
            ],
            notes=["init_weights has no step; rows are what it creates"],
            decomp=decomp,
            target=target,
        )
    if stage == "pretrain" and target.kind == "hf":
        raise PdctlError("--stage: an imported model (target.kind = hf) has no pretrain stage")
    module = {"pretrain": pretrain, "warmup": warmup, "train": train}[stage]
    prog = module.program(cfg, mesh, target)
    args = [
        Arg("target", a, _spec_tree(s), False, "target")
        for a, s in zip(prog.frozen_abstract, prog.frozen_shardings, strict=True)
    ]
    args.append(Arg("state", prog.abstract_state, _spec_tree(prog.state_shardings), True))
    batch_specs = None if prog.batch_abstract is None else _spec_tree(prog.batch_shardings)
    args.append(Arg("batch", prog.batch_abstract, batch_specs, False, "batch"))
    notes = weight_space_notes(stage, decomp) + tensor_parallel_notes(mesh)
    notes += layer_notes(cfg, stage, target, mesh)
    return Plan(stage, cfg, mesh, args, prog, notes=notes, decomp=decomp, target=target)


def layer_notes(cfg: Config, stage: str, target: Any, mesh: Any = None) -> list[str]:
    """Whether the train step scans the layers (`[train] scan_layers`, "auto" resolved) and
    where its masked forwards start (`losses.prefix_layer`)."""
    if stage != "train" or not hasattr(target, "layer_of"):
        return []
    from pdctl.config import AUTO_SCAN_LAYERS, match_sites
    from pdctl.science.spd.losses import prefix_layer
    from pdctl.stages.inputs import scan_layers

    sites = list(match_sites(cfg, target.site_paths()))
    notes = []
    if hasattr(target, "scan_layers"):
        on = scan_layers(cfg, target, mesh)
        n = len({target.layer_of(p) for p in sites} - {None})
        how = (
            f'"auto": sites in {n} layer(s), on from {AUTO_SCAN_LAYERS}'
            + (", the site-less layers scanned on a TPU" if n < AUTO_SCAN_LAYERS else "")
            if cfg.train.scan_layers == "auto"
            else "as set"
        )
        state = "on, site-less layers too" if on == "all" else "on" if on else "off"
        notes.append(f"scan_layers: {state} ({how})")
    first = prefix_layer(target, sites)
    if first is not None:
        notes.append(
            f"masked forwards start at layer {first}: the clean forward keeps the stream "
            f"entering it, and layers 0-{first - 1} run once per step, not once per forward"
        )
    return notes


def weight_space_notes(stage: str, decomp: sharding.Decomp) -> list[str]:
    """How the step does each site's weight-space work (components.masked_site_fn,
    losses.faithfulness_loss), for the report."""
    if stage not in ("warmup", "train"):
        return []
    where = (
        f"on gathered V / U, each of the {decomp.size} devices forming its rows"
        if decomp.size > 1
        else "on one device's whole V / U"
    )
    notes = [f"faithfulness: W - V U formed once per step per site, {where}"]
    if stage == "train":
        notes.append(
            "masked forwards: every site on the token path, (x V * (m - m_delta)) U + m_delta "
            "x W; no d_in x d_out matrix per forward (never cheaper: it would add C d_in d_out "
            "per forward and twice that in the backward, to the same token work)"
        )
    return notes


def tensor_parallel_notes(mesh) -> list[str]:
    tp = sharding.axis_size(mesh, "tp")
    if tp == 1:
        return []
    return [
        f"tensor parallel over tp={tp}: column-parallel projections (q/k/v, gate/up) split "
        "their output dimension and U (C, d_out); row-parallel ones (o, down) their input "
        "dimension and V (d_in, C); one all-reduce per row-parallel projection, the batch "
        "shared by the tp devices"
    ]


# ---- rows ------------------------------------------------------------------------------------
def _kind(arg: str, path: str) -> str:
    if arg in ("target", "batch"):
        return arg
    head = path.split(".", 2)
    first = head[0]
    if first == "trainable" and len(head) > 1:
        first = head[1]
    if first == "params":
        return "target"
    if first in ("components", "ci_fns", "sources"):
        return first
    if first in ("opt_state", "src_opt"):
        return "optimizer"
    if first == "loop":
        return "loop"
    return "other"


def _spec_axes(spec: P, ndim: int) -> list[Any]:
    axes = list(spec) + [None] * (ndim - len(spec))
    return [list(a) if isinstance(a, tuple) else a for a in axes]


def spec_str(axes: list[Any]) -> str:
    if all(a is None for a in axes):
        return "P()"

    def one(a):
        if a is None:
            return "None"
        if isinstance(a, list):
            return "(" + ", ".join(repr(x) for x in a) + ")"
        return repr(a)

    return "P(" + ", ".join(one(a) for a in axes) + ")"


def shard_count(axes: list[Any], mesh_shape: dict[str, int]) -> int:
    n = 1
    for a in axes:
        for name in a if isinstance(a, list) else [a]:
            if name is not None:
                n *= mesh_shape[name]
    return n


def _group_path(keys: tuple[Any, ...]) -> str:
    """The path with layer/site indices (numeric dict-key segments) replaced by '*'.

    Tuple indices (optax chain positions) stay literal: they name different states."""
    parts = []
    for k in keys:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(".".join("*" if s.isdigit() else s for s in str(k.key).split(".")))
        else:
            parts.append(sharding.path_str((k,)))
    return ".".join(parts)


def rule_name(arg: str, path: str, shape: tuple[int, ...], axes: list[Any], p: Plan) -> str:
    """The sharding rule (engine.sharding.RULES, by name) that gave this array its spec."""
    if arg == "batch":
        return "the batch: leading axis over (data, fsdp)"
    fsdp, min_size = p.mesh.shape["fsdp"], p.cfg.mesh.fsdp_min_param_size
    tp = sharding.axis_size(p.mesh, "tp")
    rule, spec = sharding.rule_for(path, shape, fsdp, min_size, p.decomp, tp)
    if _spec_axes(spec, len(shape)) != axes:
        return "with the batch (per-example PPGD sources)"
    return rule.name


def array_rows(p: Plan) -> list[dict[str, Any]]:
    """One row per array of the plan, in argument and tree order."""
    mesh_shape = sharding.describe_mesh(p.mesh)
    rows = []
    for arg in p.args:
        if arg.abstract is None:
            continue
        leaves = jax.tree_util.tree_leaves_with_path(arg.abstract)
        specs = jax.tree.leaves(arg.specs, is_leaf=lambda x: isinstance(x, P))
        for (keys, x), spec in zip(leaves, specs, strict=True):
            path = sharding.path_str(keys)
            tree_path = path
            group = _group_path(keys)
            if arg.prefix:
                path, group = f"{arg.prefix}.{path}", f"{arg.prefix}.{group}"
            shape = tuple(int(d) for d in x.shape)
            axes = _spec_axes(spec, len(shape))
            shards = shard_count(axes, mesh_shape)
            nbytes = math.prod(shape) * jnp.dtype(x.dtype).itemsize
            sh = NamedSharding(p.mesh, P(*[tuple(a) if isinstance(a, list) else a for a in axes]))
            per_device = math.prod(sh.shard_shape(shape)) * jnp.dtype(x.dtype).itemsize
            rows.append(
                {
                    "path": path,
                    "group": group,
                    "kind": _kind(arg.name, path),
                    "arg": arg.name,
                    "shape": list(shape),
                    "dtype": str(jnp.dtype(x.dtype)),
                    "spec": axes,
                    "spec_str": spec_str(axes),
                    "shards": shards,
                    "count": 1,
                    "bytes": int(nbytes),
                    "bytes_per_device": int(per_device),
                    "sharded": shards > 1,
                    "donated": arg.donated,
                    "rule": rule_name(arg.name, tree_path, shape, axes, p),
                }
            )
    order = {k: i for i, k in enumerate(KINDS)}
    return sorted(rows, key=lambda r: order[r["kind"]])  # stable: tree order within a kind


def group_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Same leaf name + shape + dtype + spec across sites/layers: one row with a count."""
    groups: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (r["arg"], r["group"], tuple(r["shape"]), r["dtype"], r["spec_str"])
        g = groups.get(key)
        if g is None:
            groups[key] = {**r, "paths": [r["path"]]}
            continue
        g["count"] += 1
        g["bytes"] += r["bytes"]
        g["bytes_per_device"] += r["bytes_per_device"]
        g["paths"].append(r["path"])
    out = []
    for g in groups.values():
        if g["count"] > 1:
            g["path"] = _pattern(g["paths"])
        else:
            del g["paths"]
        out.append(g)
    return out


def _pattern(paths: list[str]) -> str:
    """Member paths with the segments that differ (the layer/site indices) as '*'."""
    split = [p.split(".") for p in paths]
    if len({len(s) for s in split}) != 1:
        return paths[0]
    return ".".join(s[0] if len(set(s)) == 1 else "*" for s in zip(*split, strict=True))


def totals(rows: list[dict[str, Any]], p: Plan) -> dict[str, Any]:
    per_device = {k: 0 for k in KINDS}
    logical = {k: 0 for k in KINDS}
    for r in rows:
        per_device[r["kind"]] += r["bytes_per_device"]
        logical[r["kind"]] += r["bytes"]
    used = [k for k in KINDS if logical[k]]
    sharded = sum(r["bytes_per_device"] for r in rows if r["sharded"])
    replicated = sorted(
        (r for r in rows if not r["sharded"] and r["shape"]),
        key=lambda r: (-r["bytes_per_device"], r["path"]),
    )[:N_LARGEST]
    return {
        "per_device": {k: per_device[k] for k in used},
        "per_device_total": sum(per_device.values()),
        "bytes": {k: logical[k] for k in used},
        "bytes_total": sum(logical.values()),
        "donated_per_device": sum(r["bytes_per_device"] for r in rows if r["donated"]),
        "sharded_per_device": sharded,
        "replicated_per_device": sum(per_device.values()) - sharded,
        "arrays": len(rows),
        "largest_replicated": [
            {
                "path": r["path"],
                "shape": r["shape"],
                "bytes_per_device": r["bytes_per_device"],
                "why": r["rule"],
            }
            for r in replicated
        ],
    }


# ---- compile -----------------------------------------------------------------------------------
def compile_step(p: Plan, donate: bool = True) -> tuple[Any, float]:
    """(compiled step, seconds to lower + compile): the stage's own program, lowered from
    abstract, sharded arguments (the same jit the stage runs: shardings, donation, remat,
    precision, accumulation)."""
    if p.program is None:
        raise PdctlError(f"--compile: {p.stage} has no step to compile")
    t0 = time.perf_counter()
    compiled = p.program.lower(donate).compile()
    return compiled, time.perf_counter() - t0
