"""`pdctl inspect-sharding`: how a stage's arrays are laid out on the mesh, without allocating.

Everything here is abstract: `jax.eval_shape` through the stages' own `build` functions gives the
shapes, `sharding.tree_specs` gives the PartitionSpecs the stage will use, and bytes per device
are shape x itemsize / shards. Nothing takes the run lock or reads checkpoints, so it works on a
fresh run directory and next to a running stage. `--compile` lowers and compiles the stage's
donating step from `jax.ShapeDtypeStruct`s carrying their shardings and reports XLA's
`memory_analysis()`; `--devices N` previews another device count in a child process with N
simulated CPU devices.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
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
from pdctl.engine import donation, sharding
from pdctl.errors import PdctlError
from pdctl.stages.inputs import (
    abstract_target,
    check_tensor_parallel,
    decomp_layout,
    target_from_config,
)
from pdctl.stages.registry import STAGES

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
CHILD_ENV = "PDCTL_INSPECT_CHILD"
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
    fields = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tp": cfg.mesh.tp, **override}
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
    notes += layer_notes(cfg, stage, target)
    return Plan(stage, cfg, mesh, args, prog, notes=notes, decomp=decomp, target=target)


def layer_notes(cfg: Config, stage: str, target: Any) -> list[str]:
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
        on = scan_layers(cfg, target)
        n = len({target.layer_of(p) for p in sites} - {None})
        how = (
            f'"auto": sites in {n} layer(s), on from {AUTO_SCAN_LAYERS}'
            if cfg.train.scan_layers == "auto"
            else "as set"
        )
        notes.append(f"scan_layers: {'on' if on else 'off'} ({how})")
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


def memory_report(compiled: Any, donated_bytes: int) -> dict[str, Any]:
    """XLA's per-device sizes, the estimated peak and how much of the donated state aliases."""
    m = compiled.memory_analysis()
    if m is None:
        return {"available": False}
    arg, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    frac = alias / donated_bytes if donated_bytes else 1.0
    rep = {
        "available": True,
        "argument_bytes": arg,
        "output_bytes": out,
        "alias_bytes": alias,
        "temp_bytes": temp,
        "generated_code_bytes": int(m.generated_code_size_in_bytes),
        "peak_bytes_estimate": arg + out + temp - alias,
        "donated_bytes": donated_bytes,
        "alias_fraction": frac,
        "donation_ok": frac >= donation.THRESHOLD,
    }
    xla_peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    if xla_peak:
        rep["xla_peak_bytes"] = xla_peak
    return rep


# ---- the whole report ----------------------------------------------------------------------------
def inspect(
    cfg: Config,
    stage: str = "train",
    mesh_override: dict[str, int] | None = None,
    compile: bool = False,
    expand: bool = False,
    devices: list[Any] | None = None,
    root: Path | None = None,
    budget: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """The `inspect-sharding` report as a JSON-ready dict: rows, totals and (with `compile`)
    the compiled step's memory; with a device `budget` (bytes, as given) also the fit check
    (`stages.fit`: the step and the evaluation's programs against it)."""
    compile = compile or budget is not None
    stage = parse_stage(stage)
    devices = list(jax.devices() if devices is None else devices)
    mc = mesh_config(cfg, mesh_override)
    check_mesh_fits(mc, len(devices), from_flag=bool(mesh_override))
    cfg = cfg.model_copy(update={"mesh": mc})
    mesh = sharding.mesh_from_config(mc, devices)
    p = plan(cfg, stage, mesh, root)
    rows = array_rows(p)
    report: dict[str, Any] = {
        "stage": stage,
        "devices": len(devices),
        "platform": devices[0].platform,
        "mesh": sharding.describe_mesh(mesh),
        "fsdp_min_param_size": mc.fsdp_min_param_size,
        # the axes V / U shard over by their component axis ([mesh] decomposition)
        "decomposition": list(p.decomp.axes) if p.decomp else ["fsdp"],
        "rows": rows if expand else group_rows(rows),
        "grouped": not expand,
        "totals": totals(rows, p),
        "notes": list(p.notes),
    }
    if compile:
        if p.program is None:
            report["notes"].append("--compile: init_weights has no step to compile")
            report["memory"] = None
        else:
            compiled, secs = compile_step(p)
            report["memory"] = memory_report(compiled, report["totals"]["donated_per_device"])
            report["memory"]["compile_s"] = round(secs, 3)
            if budget is not None:
                from pdctl.stages import fit

                programs = fit.compile_all(p, compiled, secs)
                report["fit"] = fit.check(p, programs, budget, rows)
    return report


# ---- --devices N: a child process with N simulated devices ---------------------------------------
def needs_child(n: int, cfg: Config, override: dict[str, int] | None) -> bool:
    """Whether `--devices N` needs a child process (JAX here sees another device count); checks
    N and an explicit --mesh against N first, so a bad preview fails without starting one."""
    if n < 1:
        raise PdctlError(f"--devices: must be >= 1, got {n}")
    if override:
        check_mesh_fits(mesh_config(cfg, override), n, from_flag=True)
    have = jax.device_count()
    if have == n:
        return False
    if os.environ.get(CHILD_ENV):
        raise PdctlError(f"--devices: asked for {n} simulated devices but JAX sees {have}")
    return True


def child_env(n: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={n}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env[CHILD_ENV] = "1"
    # The child imports the pdctl this process runs, also when that one is importable only
    # from the directory this process was started in (a source checkout).
    root = str(Path(__file__).resolve().parents[2])
    if root not in _import_path():
        env["PYTHONPATH"] = os.pathsep.join(
            [root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
        )
    return env


def _import_path() -> set[str]:
    """The directories on this interpreter's import path that a child started with `-P` has
    too: all but the current or script directory Python put first."""
    entries = sys.path if sys.flags.safe_path else sys.path[1:]
    return {os.path.realpath(p) for p in entries if p}


CHILD_CWD = "/"  # not the run directory: nothing there is imported, even via PYTHONPATH=":..."


def child_argv(project: Path | None) -> list[str]:
    """`python -P -m pdctl --project RUN`: `-P` keeps the current directory off the child's
    import path (a `typer.py` or `jax.py` next to someone else's pdctl.toml would otherwise
    run), and the run directory is named explicitly since the child does not start in it.
    Not `-I`: that would also drop PYTHONPATH and the user site, where pdctl may live."""
    from pdctl.project import find_project_file

    path = find_project_file(explicit=Path(project)) if project is not None else find_project_file()
    return [sys.executable, "-P", "-m", "pdctl", "--project", str(path)]


def child_death(n: int, returncode: int, stderr: str) -> str | None:
    """The one line to end with when the child died instead of exiting (0 done, 1 pdctl's own
    error line already printed, 2 a user mistake): a signal or a C++ abort gives no error
    line of pdctl's. Seen: 64 simulated devices of an 8B model, where XLA:CPU's LLVM ran out
    of section memory after 7.5 min ("LLVM ERROR: Unable to allocate section memory!", exit
    250) with 22 GiB free: the process's memory-map count is bounded by vm.max_map_count
    (65,530 by default); with 262,144 the same compile finished in 12.5 min."""
    if returncode in (0, 1, 2, 3):
        return None
    how = f"signal {-returncode}" if returncode < 0 else f"exit {returncode}"
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    said = f" (its last line: {last[:200]!r})" if last else ""
    if "section memory" in stderr:  # LLVM's JIT out of memory maps, not of RAM
        fix = (
            "raise the memory-map limit (sysctl -w vm.max_map_count=262144) or use fewer --devices"
        )
    else:
        fix = "try fewer --devices on this machine, or more memory"
    return (
        f"inspect-sharding: the process compiling for {n} simulated devices died ({how}){said}; "
        + fix
    )


def run_child(
    n: int,
    project: Path | None,
    stage: str,
    mesh: str | None,
    compile: bool,
    as_json: bool,
    expand: bool,
    columns: int | None = None,
    device_memory: str | None = None,
    device_kind: str | None = None,
) -> subprocess.CompletedProcess:
    """Rerun this inspection in `sys.executable -P -m pdctl` with N simulated CPU devices,
    started outside the run directory with the current directory off its import path."""
    argv = child_argv(project)
    argv += ["inspect-sharding", "--stage", stage, "--devices", str(n)]
    if mesh is not None:
        argv += ["--mesh", mesh]
    argv += [f for f, on in (("--compile", compile), ("--json", as_json), ("--all", expand)) if on]
    for flag, value in (("--device-memory", device_memory), ("--device-kind", device_kind)):
        if value:
            argv += [flag, value]
    env = child_env(n)
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run(argv, env=env, cwd=CHILD_CWD, capture_output=True, text=True, check=False)


# ---- text output -------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def render(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    mesh = report["mesh"]
    t = report["totals"]
    console.print(
        f"{report['stage']}: {report['devices']} {report['platform']} devices, mesh "
        f"data={mesh['data']} x fsdp={mesh['fsdp']} x tp={mesh.get('tp', 1)}, "
        "fsdp_min_param_size="
        f"{report['fsdp_min_param_size']}, components over "
        f"{' x '.join(report['decomposition'])}, {t['arrays']} arrays",
        markup=False,
    )
    table = Table(title_justify="left")
    for col, just in (
        ("path", "left"),
        ("n", "right"),
        ("shape", "left"),
        ("dtype", "left"),
        ("spec", "left"),
        ("bytes", "right"),
        ("per device", "right"),
        ("layout", "left"),
        ("rule", "left"),
    ):
        table.add_column(col, justify=just, overflow="fold")
    for r in report["rows"]:
        layout = f"sharded /{r['shards']}" if r["sharded"] else "replicated"
        if r["donated"]:
            layout += ", donated"
        table.add_row(
            r["path"],
            str(r["count"]),
            str(tuple(r["shape"])),
            r["dtype"],
            r["spec_str"],
            fmt_bytes(r["bytes"]),
            fmt_bytes(r["bytes_per_device"]),
            layout,
            r["rule"],
        )
    console.print(table)
    if report["grouped"]:
        console.print("(rows with n > 1 group same-shaped sites/layers; --all lists every array)")
    kinds = Table(title="per device", title_justify="left")
    kinds.add_column("kind")
    kinds.add_column("per device", justify="right")
    kinds.add_column("total", justify="right")
    for k, v in t["per_device"].items():
        kinds.add_row(KIND_LABEL[k], fmt_bytes(v), fmt_bytes(t["bytes"][k]))
    kinds.add_row("all", fmt_bytes(t["per_device_total"]), fmt_bytes(t["bytes_total"]))
    console.print(kinds)
    console.print(
        f"sharded {fmt_bytes(t['sharded_per_device'])} / replicated "
        f"{fmt_bytes(t['replicated_per_device'])} per device; donated state "
        f"{fmt_bytes(t['donated_per_device'])} per device",
        markup=False,
    )
    if t["largest_replicated"]:
        console.print("largest replicated arrays (what to shard next):", markup=False)
        for r in t["largest_replicated"]:
            console.print(
                f"  {r['path']} {tuple(r['shape'])} {fmt_bytes(r['bytes_per_device'])} "
                f"({r['why']})",
                markup=False,
            )
    for note in report["notes"]:
        console.print(f"note: {note}", markup=False)
    m = report.get("memory")
    if m:
        if not m.get("available"):
            console.print("compiled: memory_analysis() is not available here", markup=False)
            return
        console.print(
            f"compiled step ({m['compile_s']:.2f} s), per device: argument "
            f"{fmt_bytes(m['argument_bytes'])}, output {fmt_bytes(m['output_bytes'])}, alias "
            f"{fmt_bytes(m['alias_bytes'])}, temp {fmt_bytes(m['temp_bytes'])}; estimated peak "
            f"{fmt_bytes(m['peak_bytes_estimate'])} (argument + output + temp - alias)",
            markup=False,
        )
        verdict = "ok" if m["donation_ok"] else "DONATION FAILED"
        console.print(
            f"donation: aliased {fmt_bytes(m['alias_bytes'])} of "
            f"{fmt_bytes(m['donated_bytes'])} donated state = {m['alias_fraction']:.1%} "
            f"({verdict}, threshold {donation.THRESHOLD:.0%})",
            markup=False,
        )
    if report.get("fit"):
        from pdctl.stages import fit

        fit.render(report["fit"], console, fmt_bytes)
